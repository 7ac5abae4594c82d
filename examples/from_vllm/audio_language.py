"""vLLM's examples/offline_inference/audio_language.py on tandem: its Whisper model type.

Changed from vLLM's: the imports (``vllm`` -> ``tandem``), the model (the demo Whisper
shipped in the package, in place of openai/whisper-large-v3-turbo), and ``--model-type``,
whose only choice and default is ``whisper``: vLLM's other audio models (its default,
``ultravox``, and the rest) are decoder-only language models, which tandem does not serve.
The engine arguments (``max_model_len=448``, ``max_num_seqs=5``), the prompt, the flags
and the sampling (``temperature=0.2``, ``max_tokens=64``) are vLLM's.
"""

from dataclasses import asdict
from pathlib import Path
from typing import Any, NamedTuple

import tandem
from tandem import LLM, EngineArgs, SamplingParams
from tandem.assets.audio import AudioAsset
from tandem.lora import LoRARequest
from tandem.utils.argparse_utils import FlexibleArgumentParser

MODEL = str(Path(tandem.__file__).parent / "demo_whisper")  # vLLM's: "openai/whisper-large-v3-turbo"

audio_assets = [AudioAsset("mary_had_lamb"), AudioAsset("winning_call")]
question_per_audio_count = {
    0: "What is 1+1?",
    1: "What is recited in the audio?",
    2: "What sport and what nursery rhyme are referenced?",
}


class ModelRequestData(NamedTuple):
    engine_args: EngineArgs
    prompt: str | None = None
    prompt_token_ids: dict[str, list[int]] | None = None
    multi_modal_data: dict[str, Any] | None = None
    stop_token_ids: list[int] | None = None
    lora_requests: list[LoRARequest] | None = None


def run_whisper(question: str, audio_count: int) -> ModelRequestData:
    assert audio_count == 1, "Whisper only support single audio input per prompt"
    engine_args = EngineArgs(
        model=MODEL,
        max_model_len=448,
        max_num_seqs=5,
        limit_mm_per_prompt={"audio": audio_count},
    )
    return ModelRequestData(engine_args=engine_args, prompt="<|startoftranscript|>")


model_example_map = {"whisper": run_whisper}


def parse_args(argv=None):
    parser = FlexibleArgumentParser(description="Offline inference with the right prompt format on audio models")
    parser.add_argument("--model-type", "-m", type=str, default="whisper", choices=model_example_map.keys(),
                        help='Huggingface "model_type".')
    parser.add_argument("--num-prompts", type=int, default=1, help="Number of prompts to run.")
    parser.add_argument("--num-audios", type=int, default=1, choices=[0, 1, 2],
                        help="Number of audio items per prompt.")
    parser.add_argument("--seed", type=int, default=0, help="the seed LLM is built with")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=None,
                        help="Tensor parallel size to override the model's default setting.")
    return parser.parse_args(argv)


def main(args):
    model = args.model_type
    if model not in model_example_map:
        raise ValueError(f"Model type {model} is not supported.")
    if args.tensor_parallel_size is not None and args.tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {args.tensor_parallel_size}")
    audio_count = args.num_audios
    req_data = model_example_map[model](question_per_audio_count[audio_count], audio_count)
    # No other modality: an encoder/decoder model takes one encoder input
    default_limits = {"image": 0, "video": 0, "audio": 0}
    req_data.engine_args.limit_mm_per_prompt = default_limits | dict(req_data.engine_args.limit_mm_per_prompt or {})
    engine_args = asdict(req_data.engine_args) | {"seed": args.seed}
    if args.tensor_parallel_size is not None:
        engine_args["tensor_parallel_size"] = args.tensor_parallel_size
    llm = LLM(**engine_args)
    # temperature 0.2: batched copies of one prompt may come out different
    sampling_params = SamplingParams(temperature=0.2, max_tokens=64, stop_token_ids=req_data.stop_token_ids)

    def get_input(start, end):
        mm_data = req_data.multi_modal_data
        if not mm_data:
            mm_data = {}
            if end - start > 0:
                mm_data = {"audio": [asset.audio_and_sample_rate for asset in audio_assets[start:end]]}
        inputs = {"multi_modal_data": mm_data}
        if req_data.prompt:
            inputs["prompt"] = req_data.prompt
        else:
            inputs["prompt_token_ids"] = req_data.prompt_token_ids
        return inputs

    assert args.num_prompts > 0
    if audio_count != 1:
        inputs = [get_input(0, audio_count)] * args.num_prompts
    else:
        # one audio a prompt: each prompt its own clip, in turn
        inputs = [get_input(i % len(audio_assets), i % len(audio_assets) + 1) for i in range(args.num_prompts)]
    lora_request = req_data.lora_requests * args.num_prompts if req_data.lora_requests else None
    outputs = llm.generate(inputs, sampling_params=sampling_params, lora_request=lora_request)
    for o in outputs:
        print(o.outputs[0].text)
    return inputs, outputs


if __name__ == "__main__":
    main(parse_args())
