"""BART end to end on the GPU through every attention backend (each flash_attn
kernel source forced in turn), greedy, token for token against torch_sdpa in the
same dtype (bfloat16, float16).

Two runs that differ only in their attention kernels round differently inside
attention, so where the reference's own top two tokens are nearly tied either
may win. Measured on CPU with this checkpoint (torch_sdpa against cpu_paged, the
same prompts): chosen-token log-probabilities differ by at most 0.033 in
bfloat16 and 0.0036 in float16 while the sequences agree, and they parted only
at margins of 0.0 and 0.031. So each prompt is compared token by token up to
the first step where the reference's margin (top-1 minus top-2 log-probability)
is at most MARGIN, ~3x the largest swing both sides together could make
(2 x 0.033 bfloat16; float16 a quarter, as its unit roundoff); past it the
sequences may rightly part."""

from __future__ import annotations

import gc
import random

import pytest
import torch

from gpu_cases import TARGETS, backend_name, load_target, serve_or_skip
from helpers import make_bart
from tandem import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

D_MODEL, HEADS = 256, 4  # head size 64, as BART-base's
MARGIN = {torch.bfloat16: 0.2, torch.float16: 0.05}
_rng = random.Random(0)
PROMPTS = [{"prompt_token_ids": [0, *(_rng.randrange(4, 96) for _ in range(n)), 2]}
           for n in (1, 5, 9, 16, 23, 40, 77, 150)]
NEW_TOKENS = 24
_reference: dict = {}


@pytest.fixture(scope="module")
def bart256(tmp_path_factory):
    # Weights of std 0.15 keep activations O(1) (bfloat16 keeps ~3 significant
    # digits) while the greedy output still depends on the prompt.
    return make_bart(tmp_path_factory.mktemp("bart256") / "ckpt", seed=0, weight_std=0.15, d_model=D_MODEL,
                     encoder_attention_heads=HEADS, decoder_attention_heads=HEADS, encoder_ffn_dim=2 * D_MODEL,
                     decoder_ffn_dim=2 * D_MODEL, max_position_embeddings=256)


def _generate(model, backend: str, dtype: torch.dtype):
    llm = LLM(model=str(model), attention_backend=backend, device="cuda", dtype=str(dtype).removeprefix("torch."),
              block_size=16)
    try:
        assert llm.engine.attn_backend.name == backend and llm.engine.kv_caches[0].is_cuda
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, logprobs=2)
        return [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    finally:
        del llm
        gc.collect()
        torch.cuda.empty_cache()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("target", [t for t in TARGETS if t != "torch_sdpa"])
def test_greedy_tokens_equal_torch_sdpa(bart256, target, dtype, monkeypatch):
    backend = load_target(target, monkeypatch)
    serve_or_skip(backend, dtype, D_MODEL // HEADS, 16)
    if dtype not in _reference:
        _reference[dtype] = _generate(bart256, "torch_sdpa", dtype)
    ref, got = _reference[dtype], _generate(bart256, backend_name(target), dtype)
    compared = 0
    for prompt, r, g in zip(PROMPTS, ref, got):
        assert len(g.token_ids) == NEW_TOKENS
        for j, (want, have) in enumerate(zip(r.token_ids, g.token_ids)):
            top = sorted(r.logprobs[j].values(), reverse=True)
            if top[0] - top[1] <= MARGIN[dtype]:
                break  # a near-tie in the reference: from here the sequences may part
            assert have == want, (f"prompt of {len(prompt['prompt_token_ids'])} tokens, step {j}: {target} chose "
                                  f"{have}, torch_sdpa {want} (reference margin {top[0] - top[1]:.3f})")
            compared += 1
    assert compared >= len(PROMPTS), f"only {compared} tokens were decisive enough to compare"
