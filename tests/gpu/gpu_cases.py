"""What the GPU plan's tests share: the shapes they cover, the tolerance per dtype,
and how a test takes a backend (or one flash_attn kernel source) or skips with the
reasons the backend itself gives.

A *target* is a backend name, or ``flash_attn:<source>`` for the flash_attn backend
with one of its kernel sources (``tandem.backends.flash_attn.KERNELS``) forced.
"""

from __future__ import annotations

import itertools
import os
import random
from dataclasses import replace

import pytest
import torch

from tandem.core.attention import AttentionType
from tandem.plugins import default_backend_registry

CUDA = torch.device("cuda")
ALL_KINDS = frozenset(AttentionType)

# (query heads, KV heads): MHA, GQA 4:1 and MQA, at a production head count.
RATIOS = ((32, 32), (32, 8), (32, 1))
# 72 and 80 are multiples of 8 but not of 16 (FA4's sm90 paged path); 256 is the
# largest any backend advertises (and triton's fp32 shared-memory edge).
HEAD_SIZES = (64, 72, 80, 128, 256)
# 16: the engine's default; 128: FA4's key tile (its TMA path); 256: FA2's and
# torch's paged block_table path (page size divisible by 256).
BLOCK_SIZES = (16, 128, 256)
FLASH_SOURCES = ("fa4", "fa2", "torch")
TARGETS = ("torch_sdpa", "triton", "xformers", *(f"flash_attn:{s}" for s in FLASH_SOURCES))

# float16 has unit roundoff u = 2^-11 (4.9e-4), a quarter of bfloat16's 2^-9. The
# bfloat16 bars (tests/backends/layouts.py, docs/backends.md "Conformance") come
# from two roundings of that size, the output stored in the dtype and, in
# flash-style kernels, the softmax weights cast to it before P.V, with a factor of
# ~4 to spare; the same derivation at u = 2^-11 gives a quarter of each bar:
# norm-wise 1e-2 / 4 = 2.5e-3, per element 3e-2 / 4 ~ 8e-3 absolute and
# 2e-2 / 4 = 5e-3 relative. float32 accumulation inside the kernels (u = 6e-8) adds
# nothing at this scale, and the inputs (randn, |x| < 6) sit far inside float16's
# range, scores included (scale 1/sqrt(D)), so no overflow or subnormal loss.
ATOL_FP16, RTOL_FP16, REL_FP16 = 8e-3, 5e-3, 2.5e-3

# The covering design below keeps the default run short; TANDEM_GPU_FULL=1 runs
# the full product (135 layouts per target and mix for three dtypes).
FULL = os.environ.get("TANDEM_GPU_FULL") == "1"


def tolerances(dtype: torch.dtype) -> tuple[float, float, float] | None:
    """(absolute, relative, norm-wise) bars for ``check_backend``; None: its own
    (float32, bfloat16)."""
    return (ATOL_FP16, RTOL_FP16, REL_FP16) if dtype == torch.float16 else None


def backend_name(target: str) -> str:
    return target.partition(":")[0]


def dtypes_of(target: str) -> tuple[torch.dtype, ...]:
    """The dtypes the target's backend declares (flash_attn: 16-bit only)."""
    return default_backend_registry().load(backend_name(target)).capabilities.dtypes


def grid(dtypes: tuple[torch.dtype, ...]) -> list[tuple]:
    """``(dtype, (heads, kv_heads), head_size, block_size)`` rows: every head ratio
    with every head size, the dtype and block size turning with them so that every
    pair of values of any two of the four factors occurs at least once (15 rows
    instead of the full product's 45 per dtype: the test of that property is in
    tests/test_gpu_plan.py). A defect tied to a pair of values (T1: float32 at head
    size 256; F2: FA4 at head size 72 with block size 16) is always reached."""
    if FULL:
        return list(itertools.product(dtypes, RATIOS, HEAD_SIZES, BLOCK_SIZES))
    return [(dtypes[(h + r) % len(dtypes)], ratio, hs, BLOCK_SIZES[(h + 2 * r) % len(BLOCK_SIZES)])
            for h, hs in enumerate(HEAD_SIZES) for r, ratio in enumerate(RATIOS)]


def case_id(target: str, dtype: torch.dtype, ratio: tuple[int, int], head_size: int, block_size: int) -> str:
    short = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]
    return f"{target}-{short}-h{ratio[0]}kv{ratio[1]}-d{head_size}-bs{block_size}"


def force_flash_source(source: str, monkeypatch) -> None:
    """Make the flash_attn backend consider kernel source ``source`` only: the
    backend's own rules (installed, interface, GPU, head size) still decide
    whether it serves, and ``serve_or_skip`` skips with its reasons when not."""
    import tandem.backends.flash_attn as fa

    kernels = {k.name: k for k in fa.KERNELS}
    if source not in kernels:
        pytest.fail(f"flash_attn has no kernel source {source!r}; it has {sorted(kernels)}")
    monkeypatch.setattr(fa, "KERNELS", (kernels[source],))


def load_target(target: str, monkeypatch):
    """The backend class of ``target``, with its flash_attn source forced if named."""
    name, _, source = target.partition(":")
    if source:
        force_flash_source(source, monkeypatch)
    return default_backend_registry().load(name)


def serve_or_skip(backend, dtype: torch.dtype, head_size: int, block_size: int) -> None:
    """Skip, with the backend's own reasons, a configuration it says it cannot serve."""
    reasons = backend.unsupported_reasons(CUDA, dtype, head_size, ALL_KINDS, block_size, dtype)
    if reasons:
        pytest.skip(f"{backend.name} does not serve cuda/{dtype}/head {head_size}/block {block_size}: "
                    + "; ".join(reasons))


def _blocks(n: int, block_size: int) -> int:
    return -(-n // block_size)


LONG = 8192  # keys of the long decode


def long_layout(block_size: int, q_len: int, seed: int):
    """Decoder sequences over long caches, no encoder run (every sequence has cached
    tokens): one with ``LONG`` self keys (``q_len`` new after ``LONG - q_len``
    cached) and a Whisper-length (1500) cross run; two sharing one cross table of
    ``LONG`` keys (as beams do), one of them with a single cached token, so that
    split-K sees a sequence whose later slices are empty. Blocks scattered over a
    pool twice the size needed. Returns ``(seqs, num_blocks)`` for
    ``check_backend(layout=...)``."""
    from layouts import Seq

    work = [(0, LONG - q_len, q_len, 1500), (1, 1, 1, LONG), (1, 3000, 1, LONG)]  # group, ctx, q_len, enc_len
    needed = sum(_blocks(c + q, block_size) for _, c, q, _ in work)
    needed += _blocks(1500, block_size) + _blocks(LONG, block_size)
    num_blocks = 2 * needed + 8
    free = list(range(num_blocks))
    random.Random(seed).shuffle(free)
    cross = {}
    seqs = []
    for group, ctx, q, enc_len in work:
        if group not in cross:
            cross[group] = [free.pop() for _ in range(_blocks(enc_len, block_size))]
        table = [free.pop() for _ in range(_blocks(ctx + q, block_size))]
        seqs.append(Seq(group, ctx, q, table, enc_len, cross[group], run_encoder=False))
    return seqs, num_blocks


def at_the_end(seqs, num_blocks: int, first_block: int):
    """The same layout with every block moved up by ``first_block``: a pool of
    ``first_block + num_blocks`` whose first ``first_block`` blocks nobody uses."""
    moved = [replace(s, table=[b + first_block for b in s.table], cross=[b + first_block for b in s.cross])
             for s in seqs]
    return moved, first_block + num_blocks
