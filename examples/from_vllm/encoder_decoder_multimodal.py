"""vLLM's examples/offline_inference/encoder_decoder_multimodal.py on tandem: Whisper with the
implicit and the explicit encoder/decoder prompt.

Changed from vLLM's: the imports (``vllm`` -> ``tandem``), the model (the demo Whisper
shipped in the package, in place of openai/whisper-large-v3-turbo), and no
``VLLM_WORKER_MULTIPROC_METHOD`` (a vLLM worker setting; tandem runs one process here).
``max_model_len=448``, ``max_num_seqs=16``, ``dtype="half"``, the prompts, the seed and
the sampling (``max_tokens=64``, ``skip_special_tokens=False``) are vLLM's.
"""

import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import NamedTuple

import tandem
from tandem import LLM, EngineArgs, PromptType, SamplingParams
from tandem.assets.audio import AudioAsset
from tandem.utils import FlexibleArgumentParser

MODEL = str(Path(tandem.__file__).parent / "demo_whisper")  # vLLM's: "openai/whisper-large-v3-turbo"


class ModelRequestData(NamedTuple):
    engine_args: EngineArgs
    prompts: Sequence[PromptType]


def run_whisper():
    engine_args = EngineArgs(
        model=MODEL,
        max_model_len=448,
        max_num_seqs=16,
        limit_mm_per_prompt={"audio": 1},
        dtype="half",
    )
    prompts = [
        {  # implicit: the text is the decoder prompt, the audio the encoder's input
            "prompt": "<|startoftranscript|>",
            "multi_modal_data": {"audio": AudioAsset("mary_had_lamb").audio_and_sample_rate},
        },
        {  # explicit
            "encoder_prompt": {
                "prompt": "",
                "multi_modal_data": {"audio": AudioAsset("winning_call").audio_and_sample_rate},
            },
            "decoder_prompt": "<|startoftranscript|>",
        },
    ]
    return ModelRequestData(engine_args=engine_args, prompts=prompts)


model_example_map = {"whisper": run_whisper}


def parse_args(argv=None):
    parser = FlexibleArgumentParser(
        description="Offline inference with the explicit/implicit prompt format on encoder/decoder multimodal models")
    parser.add_argument("--model-type", "-m", type=str, default="whisper", choices=model_example_map.keys(),
                        help='Huggingface "model_type".')
    parser.add_argument("--seed", type=int, default=None, help="the seed LLM is built with")
    return parser.parse_args(argv)


def main(args):
    model = args.model_type
    if model not in model_example_map:
        raise ValueError(f"Model type {model} is not supported.")
    req_data = model_example_map[model]()
    # No other modality: an encoder/decoder model takes one encoder input
    default_limits = {"image": 0, "video": 0, "audio": 0}
    req_data.engine_args.limit_mm_per_prompt = default_limits | dict(req_data.engine_args.limit_mm_per_prompt or {})
    engine_args = asdict(req_data.engine_args) | {"seed": args.seed}
    llm = LLM(**engine_args)
    prompts = req_data.prompts
    sampling_params = SamplingParams(temperature=0, top_p=1.0, max_tokens=64, skip_special_tokens=False)
    start = time.time()
    outputs = llm.generate(prompts, sampling_params)
    for output in outputs:
        print(f"Decoder prompt: {output.prompt!r}, Generated text: {output.outputs[0].text!r}")
    duration = time.time() - start
    print("Duration:", duration)
    print("RPS:", len(prompts) / duration)
    return prompts, outputs


if __name__ == "__main__":
    main(parse_args())
