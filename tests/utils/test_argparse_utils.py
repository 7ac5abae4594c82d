"""tandem.utils.FlexibleArgumentParser and vLLM's EngineArgs.add_cli_args / from_cli_args
pattern on tandem's EngineArgs."""

from __future__ import annotations

import dataclasses

import pytest

from tandem import LLM, EngineArgs, SamplingParams
from tandem.demo_whisper import PATH as WHISPER, SAMPLE_RATE, synthesize
from tandem.utils import FlexibleArgumentParser
from tandem.utils.argparse_utils import FlexibleArgumentParser as FromArgparseUtils


def test_flags_take_underscores_as_vllms_parser_does():
    assert FromArgparseUtils is FlexibleArgumentParser
    p = FlexibleArgumentParser()
    p.add_argument("--num-prompts", type=int, default=1)
    p.add_argument("--audio_path")  # registered with underscores: left as it is
    p.add_argument("rest", nargs="*")
    a = p.parse_args(["--num_prompts", "3", "--audio_path=x_y.wav", "--", "--not_a_flag"])
    assert (a.num_prompts, a.audio_path, a.rest) == (3, "x_y.wav", ["--not_a_flag"])
    assert p.parse_args(["--num_prompts=4"]).num_prompts == 4


def test_engine_args_add_cli_args_and_from_cli_args():
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    parser.set_defaults(model=str(WHISPER))
    args = parser.parse_args(["--max_model_len", "448", "--max-num-seqs", "3", "--limit-mm-per-prompt",
                              '{"audio": 1}', "--kv-cache-dtype", "auto", "--seed", "5"])
    engine_args = EngineArgs.from_cli_args(args)
    assert (engine_args.model, engine_args.max_model_len, engine_args.max_num_seqs, engine_args.seed) == \
        (str(WHISPER), 448, 3, 5)
    assert engine_args.limit_mm_per_prompt == {"audio": 1}
    assert vars(args) == dataclasses.asdict(engine_args)  # so LLM(**vars(args)), as vLLM's scripts call it
    llm = LLM(**vars(args))
    assert llm.llm_engine.config.max_num_seqs == 3
    out = llm.generate({"prompt": "", "multi_modal_data": {"audio": (synthesize("hello world", seed=1), SAMPLE_RATE)}},
                       SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert out[0].error is None and out[0].outputs[0].text.strip() == "hello world"


def test_cli_errors_name_the_bad_value(capsys):
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "m", "--limit-mm-per-prompt", "audio=1"])
    assert "'audio=1' is not a JSON object" in capsys.readouterr().err
    with pytest.raises(ValueError, match="no model: pass --model"):
        EngineArgs.from_cli_args(parser.parse_args([]))
