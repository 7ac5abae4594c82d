"""Launch configurations of the triton backend's kernels, chosen per GPU target,
dtype and head size, and the targets' resource limits they must fit.

A configuration fixes the tile sizes (``block_m`` query rows, ``block_n`` keys per
inner-loop step), the warps per program and the software-pipelining depth
(``num_stages``: K/V tiles in flight in shared memory). Shared memory grows with
``block_n * padded head size * element size * 2 (K and V) * num_stages``; a
configuration that exceeds the target's per-block limit fails with
``OutOfResources`` at the first launch, so every one chosen here is compiled for
each target in CI (``tests/backends/test_triton_compile.py``) and checked against
:data:`TARGETS` -- no GPU needed.

The choices, and why:

- 16-bit prefill / chunk / encoder tiles on Hopper (sm90+): 64 query rows on 4
  warps, the shape Triton lowers to Hopper's warpgroup MMA (``wgmma``), which
  ``mma.sync`` (all Ampere has) reaches only a fraction of. On Ampere the same
  64-row tile runs ``mma.sync`` with four warps sharing it instead of one 16-row
  strip per program. Steps whose longest query run is short (decodes mixed with
  short chunks) keep 16-row tiles: a 64-row tile would mostly compute padding.
- float32 is computed in IEEE float32 on the CUDA cores (not TF32, so float32
  means float32): no tensor cores; the tile is sized by its elements per
  thread (``_float32``), so the operands stay in registers and nothing goes to
  the stack.
- 16-bit key tiles are 64 keys, 32 for heads over 128 and for padded heads.
- Decode: the rows are the query heads of one KV head (GQA fills them; 16 at
  least), two stages.
- With the relative position bias (T5), 64-row 16-bit tiles of heads over 128
  on Ampere-class parts take 8 warps: the bias tile would spill otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Target:
    """What a CUDA compute capability allows one program (thread block): from the CUDA
    C++ Programming Guide's table of technical specifications per compute capability."""

    arch: int  # major * 10 + minor
    name: str
    max_shared_bytes: int  # shared memory per block, opt-in maximum
    max_regs_per_thread: int = 255
    regs_per_block: int = 65536  # the register file a block may take (64K 32-bit registers)


TARGETS: dict[int, Target] = {t.arch: t for t in (
    Target(80, "A100 (sm80)", 163 * 1024),
    Target(86, "RTX 30xx / A10 (sm86)", 99 * 1024),
    Target(89, "L4 / RTX 40xx (sm89)", 99 * 1024),
    Target(90, "H100 / H200 (sm90)", 227 * 1024),
    Target(100, "B200 (sm100)", 227 * 1024),
    Target(120, "RTX 50xx (sm120)", 99 * 1024),
)}


def target(arch: int) -> Target:
    """The limits for ``arch``; an arch between table rows takes the row below it."""
    known = [a for a in TARGETS if a <= arch]
    if not known:
        raise ValueError(f"compute capability {arch // 10}.{arch % 10}: the triton backend needs 8.0 or newer")
    return TARGETS[max(known)]


@dataclass(frozen=True)
class LaunchConfig:
    block_m: int  # query rows (varlen) or query heads (decode) per program
    block_n: int  # keys per inner-loop tile
    num_warps: int
    num_stages: int


# A step's longest query run from which the wide (64-row) tiles pay.
WIDE_TILE_MIN_ROWS = 64


# float32 on the CUDA cores: the dot operands live in registers spread over the
# program's threads, so a tile is sized by its elements per thread, rows * block_n *
# padded head / (32 * warps): up to 512 (256 for a head padded to the next power of
# two, whose masked lanes cost the same registers) stays in registers; 1024 and more
# went to 5-8 KB of per-thread stack (and 64 x 256 x 4 B K/V stages, 3 deep, overflowed
# sm90's 227 KB: the T1 defect).
_FLOAT32_BUDGET = 512


def _float32(rows: int, head_size: int, kv_fp8: bool = False) -> LaunchConfig:
    d = block_d(head_size)
    budget = _FLOAT32_BUDGET if d == head_size else _FLOAT32_BUDGET // 2
    if kv_fp8:  # the fp8 tiles' upcasts hold their own registers: 4 warps x 64 keys at d = 64 kept 160-200 B of stack
        budget //= 2
    for warps, n in ((4, 64), (8, 64), (8, 32), (8, 16)):
        if rows * n * d <= budget * 32 * warps:
            return LaunchConfig(block_m=rows, block_n=n, num_warps=warps, num_stages=2)
    return LaunchConfig(block_m=rows, block_n=16, num_warps=8, num_stages=2)


def _key_tile_16bit(head_size: int) -> int:
    """Keys per tile for 16-bit dots: 64, halved for heads over 128 and for padded heads
    (72, 80, 96, ...), whose K/V tiles and address registers otherwise crowd out the
    accumulator (ptxas spilled them at 255 registers)."""
    d = block_d(head_size)
    return 32 if (d > 128 or d != head_size) else 64


def block_d(head_size: int) -> int:
    """The head dimension as the kernels hold it: padded to a power of two, at least 16."""
    return max(16, 1 << (head_size - 1).bit_length())


def varlen(arch: int, dtype: torch.dtype, head_size: int, longest_query: int, bias: bool = False,
           kv_fp8: bool = False) -> LaunchConfig:
    """The ``_varlen_attn`` launch (prefill, chunks, mixed steps, cross attention of
    a mixed step, the encoder) for a step whose longest query run is ``longest_query``;
    ``bias``: with the relative position bias (``HAS_BIAS``); ``kv_fp8``: over an fp8 cache."""
    if dtype == torch.float32:
        return _float32(16, head_size, kv_fp8)
    block_n = _key_tile_16bit(head_size)
    if longest_query < WIDE_TILE_MIN_ROWS:
        return LaunchConfig(block_m=16, block_n=block_n, num_warps=4, num_stages=2)
    # 64-row tiles: wgmma on sm90+ (three stages fit 227 KB up to d = 128), mma.sync on
    # Ampere-class parts (99-163 KB of shared memory: two stages).
    stages = 3 if (arch >= 90 and block_d(head_size) <= 128) else 2
    # The bias tile (64 x block_n float32 and its addresses) on top of a 64 x 256
    # accumulator: mma.sync's causal tile went to 144 B of stack at 255 registers on
    # 4 warps (sm80); on 8 warps it takes 196, no stack. wgmma's fits on 4 (254).
    # The same for an fp8 cache's upcast K/V tiles (sm89, d = 256: spilled on 4 warps).
    warps = 8 if ((bias or kv_fp8) and arch < 90 and block_d(head_size) > 128) else 4
    return LaunchConfig(block_m=64, block_n=block_n, num_warps=warps, num_stages=stages)


def decode(arch: int, dtype: torch.dtype, head_size: int, queries_per_kv: int, kv_fp8: bool = False) -> LaunchConfig:
    """The ``_decode_attn`` launch (one query token per sequence, split-K): the rows are
    the query heads that share one KV head, at least 16 (the smallest dot tile);
    ``kv_fp8``: over an fp8 cache."""
    rows = max(16, 1 << (queries_per_kv - 1).bit_length())
    if dtype == torch.float32:
        return _float32(rows, head_size, kv_fp8)
    return LaunchConfig(block_m=rows, block_n=_key_tile_16bit(head_size), num_warps=4, num_stages=2)
