"""Attention over 8,192 cached keys (self and cross) against float64: triton's
split-K decode (16 slices merged by their log-sum-exp) and its varlen kernel on a
chunk over the same cache, and every other GPU backend on the same layouts."""

from __future__ import annotations

import pytest
import torch

from gpu_cases import LONG, TARGETS, dtypes_of, load_target, long_layout, serve_or_skip, tolerances
from layouts import check_backend, step_inputs, to_device
from tandem.core.attention import KVCacheSpec

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

HEADS, KV_HEADS, HEAD_SIZE = 32, 8, 128
SHORT = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def _cases():
    for target in TARGETS:
        for dtype in dtypes_of(target):
            for block_size in (16, 256):
                yield pytest.param(target, dtype, block_size, id=f"{target}-{SHORT[dtype]}-bs{block_size}")


@pytest.mark.parametrize("q_len", [1, 9], ids=["decode", "chunk"])
@pytest.mark.parametrize("target,dtype,block_size", list(_cases()))
def test_attention_over_8192_keys_matches_float64(target, dtype, block_size, q_len, monkeypatch):
    backend = load_target(target, monkeypatch)
    serve_or_skip(backend, dtype, HEAD_SIZE, block_size)
    layout = long_layout(block_size, q_len, seed=block_size + q_len)
    seqs, _ = layout
    assert max(s.ctx + s.q_len for s in seqs) == LONG and max(s.enc_len for s in seqs) == LONG
    if target == "triton" and q_len == 1:
        # The step takes the decode kernel with its keys split, self and cross alike.
        builder = backend.get_metadata_builder_cls()(block_size, torch.device("cuda"),
                                                     KVCacheSpec(1, KV_HEADS, HEAD_SIZE))
        md = builder.build(to_device(step_inputs(seqs, block_size), "cuda"))
        assert md.decode_only and md.self_splits > 1 and md.cross_splits > 1, (md.self_splits, md.cross_splits)
    check_backend(backend, 0, block_size, KV_HEADS, HEAD_SIZE, device="cuda", dtype=dtype, num_heads=HEADS,
                  tolerances=tolerances(dtype), layout=layout)
