"""Every GPU backend's kernels against float64 at production shapes: 32 query
heads over 32, 8 or 1 KV heads; head sizes 64, 72, 80, 128 and 256; block sizes
16, 128 and 256; every dtype the backend declares (float16 with its own bar, see
gpu_cases.py); each flash_attn kernel source forced in turn. Through the same
``check_backend`` as the CPU conformance suite (tests/backends/layouts.py): the
three attention kinds on random paged layouts, and the cache each wrote."""

from __future__ import annotations

import pytest
import torch

from gpu_cases import TARGETS, case_id, dtypes_of, grid, load_target, serve_or_skip, tolerances
from layouts import check_backend

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _cases():
    for target in TARGETS:
        for seed, (dtype, ratio, head_size, block_size) in enumerate(grid(dtypes_of(target))):
            yield pytest.param(target, dtype, ratio, head_size, block_size, seed,
                               id=case_id(target, dtype, ratio, head_size, block_size))


# "mixed": prefills, chunks and decodes in one step (triton's varlen kernel);
# "decodes": single-token queries only (triton's split-K decode kernel, torch_sdpa's
# batched decode, flash_attn with max_seqlen_q = 1).
@pytest.mark.parametrize("mix", ["mixed", "decodes"])
@pytest.mark.parametrize("target,dtype,ratio,head_size,block_size,seed", list(_cases()))
def test_kernels_match_float64(target, dtype, ratio, head_size, block_size, seed, mix, monkeypatch):
    backend = load_target(target, monkeypatch)
    serve_or_skip(backend, dtype, head_size, block_size)
    heads, kv_heads = ratio
    check_backend(backend, seed, block_size, kv_heads, head_size, mix, device="cuda", dtype=dtype,
                  num_heads=heads, tolerances=tolerances(dtype))
