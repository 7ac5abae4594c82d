"""T5's length limit. Its positions are relative, so no table bounds them and HF runs any
length; tandem takes the limit from the checkpoint: ``n_positions`` in config.json (512 in
t5-small's, flan-t5's and ul2's: the length they were trained on, and the tokenizers'
``model_max_length``), 512 where a config has none (mt5's). A longer prompt is that
request's error, naming its length and the limit; the others are served. A checkpoint that
says more (``n_positions: 1024``) runs longer prompts, equal to HF."""

from __future__ import annotations

import json
import random

from helpers import T5_EOS, hf_greedy, make_t5
from tandem import LLM, SamplingParams


def _source(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(2, 96) for _ in range(n - 1)] + [T5_EOS]


def test_a_prompt_over_n_positions_is_its_own_error_and_the_rest_are_served(tmp_path):
    path = make_t5("t5-small", tmp_path / "ckpt")
    assert json.loads((path / "config.json").read_text()).get("n_positions") is None  # transformers 5 writes none
    llm = LLM(model=str(path), dtype="float32", device="cpu")
    rng = random.Random(0)
    sources = [_source(rng, 40), _source(rng, 513), _source(rng, 512), _source(rng, 7)]
    outs = llm.generate([{"prompt_token_ids": s} for s in sources],
                        SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)
    assert outs[1].error == "encoder prompt has 513 tokens; the model accepts at most 512"
    for i in (0, 2, 3):
        assert outs[i].error is None, outs[i].error
        assert outs[i].outputs[0].token_ids == hf_greedy(path, sources[i], [0], 6)


def test_n_positions_in_the_config_is_the_limit(tmp_path):
    path = make_t5("flan-t5-base", tmp_path / "ckpt")
    cfg = json.loads((path / "config.json").read_text())
    for n_positions, ok, too_long in ((64, 64, 65), (1024, 700, 1025)):
        cfg["n_positions"] = n_positions
        (path / "config.json").write_text(json.dumps(cfg))
        llm = LLM(model=str(path), dtype="float32", device="cpu")
        rng = random.Random(n_positions)
        sources = [_source(rng, ok), _source(rng, too_long)]
        outs = llm.generate([{"prompt_token_ids": s} for s in sources],
                            SamplingParams(temperature=0.0, max_tokens=5), use_tqdm=False)
        assert outs[0].error is None, outs[0].error
        assert outs[0].outputs[0].token_ids == hf_greedy(path, sources[0], [0], 5)  # HF runs it too
        assert outs[1].error == f"encoder prompt has {too_long} tokens; the model accepts at most {n_positions}"
