"""Adapters under int8 base GEMMs and under tensor parallelism.

int8: the base projections are quantized (per output channel, activations per tensor) and
the adapters stay in float32 on top of them. The oracle is float32: PEFT's merged model
run by tandem without quantization. int8 moves log-probabilities by the quantization
error of the base weights whatever the adapter; float32 adapters on top should add no
error of their own. So the test measures, over the first token after varied decoder
prefixes (no generated history to diverge), how far int8 is from float32 for PEFT's merged
model quantized whole (``d_merged``: the int8 error of the adapted model) and for the int8
base + float32 adapter (``d_lora``), and asserts ``d_lora <= 1.5 * d_merged + 1e-3``,
while the adapter's own effect on the log-probabilities is over twice ``d_lora`` (so the
adapter is really applied; measured 0.28 vs 1.03).

Tensor parallelism (two gloo ranks, slow): column-parallel layers keep all of A and
their rows of B, row-parallel ones their columns of A and all of B; a mixed batch
equals one process up to float32 reassociation (tests/entrypoints/test_tensor_parallel.py's bound).
"""

from __future__ import annotations

import random

import pytest
import torch

from helpers import make_bart
from lora_adapters import make_adapter, merged_checkpoint
from tandem import LLM, LoRARequest, SamplingParams

PROMPTS = [{"prompt_token_ids": [0, 5, 17, 33, 9, 41, 2]}, {"prompt_token_ids": [0, 60, 7, 7, 12, 2]},
           {"prompt_token_ids": [0, 11, 90, 4, 30, 30, 8, 2]}, {"prompt_token_ids": [0, 44, 2]}]
ALL = ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_engines")
    base = make_bart(root / "base", seed=6)
    adapters = [make_adapter(base, root / f"a{i}", ALL, seed=10 + i, std=0.2) for i in (1, 2)]
    return base, adapters, root


def _near_tie_prefix(ref, tol):
    """Per output, the positions before the first whose top two candidates are within ``2 tol``."""
    out = []
    for tokens, top in zip(ref.outputs[0].token_ids, ref.outputs[0].logprobs):
        best = sorted(top.values(), reverse=True)
        if len(best) > 1 and best[0] - best[1] < 2 * tol:
            break
        out.append(tokens)
    return out


def _first_token_logprobs(llm, prompts, lora=None) -> list[dict[int, float]]:
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=8)
    outs = llm.generate(prompts, params, lora_request=lora, use_tqdm=False)
    assert all(o.error is None for o in outs), [o.error for o in outs]
    return [o.outputs[0].logprobs[0] for o in outs]


def _max_diff(a: list[dict], b: list[dict]) -> float:
    return max(abs(x[t] - y[t]) for x, y in zip(a, b) for t in x.keys() & y.keys())


def test_int8_base_with_float32_adapters_adds_no_error_of_its_own(model):
    root = model[2]
    # Weights near 1/sqrt(d_model), as trained ones: activations O(1), where int8 is accurate
    # (with the wide std-1 test weights int8 alone moves log-probabilities by ~5).
    base = make_bart(root / "calm", seed=7, weight_std=0.2, logits_bias_std=0.0)
    adapters = [make_adapter(base, root / "calm_a1", ALL, seed=3, std=0.2)]
    merged = merged_checkpoint(base, adapters[0], root / "merged1")
    rng = random.Random(0)
    prompts = [{"encoder_prompt": {"prompt_token_ids": [0, *(rng.randrange(4, 96) for _ in range(rng.randint(3, 15))),
                                                          2]},
                "decoder_prompt": {"prompt_token_ids": [2, 0, *(rng.randrange(4, 96) for _ in range(rng.randint(0, 8)))]}}
               for _ in range(16)]
    lora = LoRARequest("a1", 1, str(adapters[0]))
    int8 = LLM(str(base), dtype="float32", quantization="int8", enable_lora=True)
    assert all(b.dtype == torch.float32 for layer in int8.llm_engine.executor.worker.lora.layers.values()
               for b in layer.b)
    int8_lora, int8_base = _first_token_logprobs(int8, prompts, lora), _first_token_logprobs(int8, prompts)
    fp32_merged = _first_token_logprobs(LLM(str(merged), dtype="float32"), prompts)
    fp32_base = _first_token_logprobs(LLM(str(base), dtype="float32"), prompts)
    int8_merged = _first_token_logprobs(LLM(str(merged), dtype="float32", quantization="int8"), prompts)
    d_base, d_lora = _max_diff(int8_base, fp32_base), _max_diff(int8_lora, fp32_merged)
    d_merged = _max_diff(int8_merged, fp32_merged)
    effect = _max_diff(fp32_merged, fp32_base)
    assert d_lora <= 1.5 * d_merged + 1e-3, (d_lora, d_merged, d_base)
    # Measured: d_base 0.16, d_merged 0.29, d_lora 0.28, effect 1.03 (max over the top-8 log-probabilities).
    assert effect > 2 * d_lora, (effect, d_lora)


@pytest.mark.slow  # spawns two tensor-parallel ranks
def test_tensor_parallel_mixed_adapters_equal_one_process(model):
    base, adapters, _ = model
    loras = [LoRARequest(f"a{i}", i, str(p)) for i, p in enumerate(adapters, start=1)]
    mix = [loras[0], None, loras[1], loras[0]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    kw = dict(model=str(base), dtype="float32", enable_lora=True, max_loras=2)
    ref = LLM(**kw).generate(PROMPTS, params, lora_request=mix, use_tqdm=False)
    tp = LLM(**kw, tensor_parallel_size=2)
    try:
        outs = tp.generate(PROMPTS, params, lora_request=mix, use_tqdm=False)
    finally:
        tp.llm_engine.shutdown()
    tol, compared = 1e-3, 0
    for r, o in zip(ref, outs):
        assert o.error is None, o.error
        keep = _near_tie_prefix(r, tol)
        assert o.outputs[0].token_ids[: len(keep)] == keep
        for i, tok in enumerate(keep):
            assert o.outputs[0].logprobs[i][tok] == pytest.approx(r.outputs[0].logprobs[i][tok], abs=tol)
        compared += len(keep)
    assert compared >= 0.8 * sum(len(r.outputs[0].token_ids) for r in ref)
