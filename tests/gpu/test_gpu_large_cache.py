"""A KV cache of more than 2^31 elements per half (K or V): a step whose blocks
all lie past element 2^31 of the key half, so that every slot offset a kernel
computes overflows int32 unless it is done in int64. 32 query heads over 8 KV
heads of 128 in float16: 2^31 elements are 4 GiB per half, the cache ~8 GiB, and
check_backend's copies of it (the cache before and after each write) ~36 GiB at
most, within an 80 GB H100."""

from __future__ import annotations

import random

import pytest
import torch

from gpu_cases import TARGETS, at_the_end, load_target, serve_or_skip, tolerances
from layouts import check_backend, random_layout

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

HEADS, KV_HEADS, HEAD_SIZE = 32, 8, 128
DTYPE = torch.float16
INT32_LIMIT = 2**31
GIB = 2**30


@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("target", TARGETS)
def test_blocks_past_element_2_pow_31_match_float64(target, block_size, monkeypatch):
    backend = load_target(target, monkeypatch)
    serve_or_skip(backend, DTYPE, HEAD_SIZE, block_size)
    per_block = block_size * KV_HEADS * HEAD_SIZE  # elements of one block in one half
    first_block = -(-INT32_LIMIT // per_block)
    seqs, num_blocks = at_the_end(*random_layout(random.Random(block_size), block_size, "mixed"), first_block)
    half_elements = num_blocks * per_block
    used = [b for s in seqs for b in s.table + s.cross]
    assert half_elements > INT32_LIMIT and min(used) * per_block >= INT32_LIMIT
    cache_bytes = 2 * half_elements * torch.empty((), dtype=DTYPE).element_size()
    total = torch.cuda.get_device_properties(0).total_memory
    if total < 4.5 * cache_bytes:  # the cache, its copy, the copy _check_write makes, the changed-element mask
        pytest.skip(f"needs ~{4.5 * cache_bytes / GIB:.0f} GiB of GPU memory, this GPU has {total / GIB:.0f}")
    check_backend(backend, block_size, block_size, KV_HEADS, HEAD_SIZE, device="cuda", dtype=DTYPE,
                  num_heads=HEADS, tolerances=tolerances(DTYPE), layout=(seqs, num_blocks))
    torch.cuda.empty_cache()
