"""The Whisper part of vLLM's examples/offline_inference/audio_language.py: ``EngineArgs``,
``LLM(**asdict(engine_args))`` and a ``multi_modal_data`` list of ``(samples, rate)``.

Only the import, the model (the shipped demo Whisper), its audio (demo tone speech)
and ``max_model_len`` (the demo's 64 positions) differ; the prompt is the full Whisper
prompt the demo was trained on (see whisper.py).
"""

import argparse
from dataclasses import asdict
from typing import NamedTuple, Optional

from tandem import LLM, EngineArgs, SamplingParams
from tandem.demo_whisper import PATH, SAMPLE_RATE, synthesize

audio_clips = [("three one four", 0), ("hello world", 1)]


class ModelRequestData(NamedTuple):
    engine_args: EngineArgs
    prompt: str
    stop_token_ids: Optional[list[int]] = None
    lora_requests: Optional[list] = None


def run_whisper(audio_count: int) -> ModelRequestData:
    assert audio_count == 1, "Whisper only support single audio input per prompt"
    engine_args = EngineArgs(
        model=str(PATH),
        max_model_len=64,
        max_num_seqs=5,
        limit_mm_per_prompt={"audio": audio_count},
    )
    return ModelRequestData(engine_args=engine_args, prompt="<|startoftranscript|><|en|><|transcribe|><|notimestamps|>")


def main(args):
    req_data = run_whisper(args.num_audios)
    default_limits = {"image": 0, "video": 0, "audio": 0}
    req_data.engine_args.limit_mm_per_prompt = default_limits | dict(req_data.engine_args.limit_mm_per_prompt or {})
    engine_args = asdict(req_data.engine_args) | {"seed": args.seed}
    llm = LLM(**engine_args)
    # temperature 0.2: batched copies of one prompt may differ
    sampling_params = SamplingParams(temperature=0.2, max_tokens=40, stop_token_ids=req_data.stop_token_ids)
    mm_data = {"audio": [(synthesize(words, seed=seed), SAMPLE_RATE) for words, seed in audio_clips[: args.num_audios]]}
    inputs = {"prompt": req_data.prompt, "multi_modal_data": mm_data}
    if args.num_prompts > 1:
        inputs = [inputs] * args.num_prompts
    lora_request = req_data.lora_requests * args.num_prompts if req_data.lora_requests else None
    outputs = llm.generate(inputs, sampling_params=sampling_params, lora_request=lora_request)
    for o in outputs:
        print(o.outputs[0].text)
    return inputs, outputs


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Whisper through LLM.generate, as vLLM's audio_language example")
    parser.add_argument("--num-prompts", type=int, default=1)
    parser.add_argument("--num-audios", type=int, default=1, choices=[1])
    parser.add_argument("--seed", type=int, default=None)
    return parser.parse_args(argv)


if __name__ == "__main__":
    main(parse_args())
