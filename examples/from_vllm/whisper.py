"""Whisper through ``LLM.generate`` with vLLM's prompt forms.

The same calls as vLLM's examples/offline_inference/whisper.py; the import (``vllm`` ->
``tandem``), the model (the shipped demo Whisper), its audio (tone speech the demo was
trained on, in place of vLLM's AudioAsset clips) and one value differs: ``max_model_len``
is the demo's 64 decoder positions (whisper-large's is 448). ``kv_cache_dtype="fp8"`` is
vLLM's: an fp8 KV cache with per-tensor scales (docs/backends.md). The demo was trained on
the full Whisper prompt only, so the prompts spell it; a real Whisper continues from
``<|startoftranscript|>`` alone.
"""

import time

from tandem import LLM, SamplingParams
from tandem.demo_whisper import PATH, SAMPLE_RATE, synthesize

PROMPT = "<|startoftranscript|><|en|><|transcribe|><|notimestamps|>"


def audio_and_sample_rate(words, seed=0):
    return synthesize(words, seed=seed), SAMPLE_RATE


def main(copies=4):
    llm = LLM(
        model=str(PATH),
        max_model_len=64,
        max_num_seqs=400,
        limit_mm_per_prompt={"audio": 1},
        kv_cache_dtype="fp8",
    )
    prompts = [
        {
            "prompt": PROMPT,
            "multi_modal_data": {"audio": audio_and_sample_rate("three one four one five nine")},
        },
        {  # the explicit encoder/decoder form
            "encoder_prompt": {"prompt": "", "multi_modal_data": {"audio": audio_and_sample_rate("hello world", 1)}},
            "decoder_prompt": PROMPT,
        },
    ] * copies
    sampling_params = SamplingParams(temperature=0, top_p=1.0, max_tokens=40)
    start = time.time()
    outputs = llm.generate(prompts, sampling_params)
    for output in outputs:
        print(f"Encoder prompt: {output.encoder_prompt!r}, Decoder prompt: {output.prompt!r}, "
              f"Generated text: {output.outputs[0].text!r}")
    duration = time.time() - start
    print("Duration:", duration)
    print("RPS:", len(prompts) / duration)
    return prompts, outputs


if __name__ == "__main__":
    main()
