"""vLLM's examples/offline_inference/whisper.py on tandem.

Changed from vLLM's: the imports (``vllm`` -> ``tandem``), the model (the demo Whisper
shipped in the package, in place of openai/whisper-large-v3) and the prompts' repetition
(vLLM's ``* 1024``, cut to ``* COPIES`` for a 2-core CPU). Everything else is vLLM's:
``max_model_len=448``, ``max_num_seqs=400``, ``kv_cache_dtype="fp8"``, the two prompt forms
with ``<|startoftranscript|>`` alone, ``max_tokens=200``. ``AudioAsset`` reads vLLM's
recordings from the assets folder when they are there, else uses the demo's tone speech
(docs/from_vllm.md). As a real Whisper, the demo goes on from ``<|startoftranscript|>``
alone with the language, the task, ``<|notimestamps|>`` and the transcript.
"""

import time
from pathlib import Path

import tandem
from tandem import LLM, SamplingParams
from tandem.assets.audio import AudioAsset

MODEL = str(Path(tandem.__file__).parent / "demo_whisper")  # vLLM's: "openai/whisper-large-v3"
COPIES = 2  # vLLM's: 1024

llm = LLM(
    model=MODEL,
    max_model_len=448,
    max_num_seqs=400,
    limit_mm_per_prompt={"audio": 1},
    kv_cache_dtype="fp8",
)

prompts = [
    {
        "prompt": "<|startoftranscript|>",
        "multi_modal_data": {"audio": AudioAsset("mary_had_lamb").audio_and_sample_rate},
    },
    {  # the explicit encoder/decoder form
        "encoder_prompt": {
            "prompt": "",
            "multi_modal_data": {"audio": AudioAsset("winning_call").audio_and_sample_rate},
        },
        "decoder_prompt": "<|startoftranscript|>",
    },
] * COPIES

sampling_params = SamplingParams(temperature=0, top_p=1.0, max_tokens=200)

start = time.time()
outputs = llm.generate(prompts, sampling_params)
for output in outputs:
    print(f"Encoder prompt: {output.encoder_prompt!r}, Decoder prompt: {output.prompt!r}, "
          f"Generated text: {output.outputs[0].text!r}")
duration = time.time() - start
print("Duration:", duration)
print("RPS:", len(prompts) / duration)
