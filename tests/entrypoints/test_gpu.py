"""The same parity checks on CUDA (selected with ``-m gpu`` on a machine with a GPU)."""

import pytest
import torch

from helpers import hf_greedy
from tandem import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_cuda_float32_matches_hf(bart_dir):
    prompts = [{"prompt_token_ids": [0, *range(5, 5 + n), 2]} for n in (1, 7, 30, 60, 90)]
    llm = LLM(model=str(bart_dir), dtype="float32", device="cuda")
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
    assert llm.engine.kv_caches[0].is_cuda
    for o in outs:
        assert o.outputs[0].token_ids == hf_greedy(bart_dir, o.encoder_prompt_token_ids, o.prompt_token_ids, 16)


def test_cuda_preemption_by_swap(bart_dir):
    prompts = [{"prompt_token_ids": [0, *range(5, 5 + n), 2]} for n in range(10, 40, 3)]
    params = SamplingParams(temperature=0.0, max_tokens=30, min_tokens=30)
    small = LLM(model=str(bart_dir), dtype="float32", device="cuda", block_size=4, num_kv_blocks=60,
                preemption_mode="swap")
    outs = small.generate(prompts, params, use_tqdm=False)
    assert small.get_stats()["swapped_out_blocks"] > 0
    ref = LLM(model=str(bart_dir), dtype="float32", device="cuda", block_size=4).generate(prompts, params,
                                                                                          use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [r.outputs[0].token_ids for r in ref]
