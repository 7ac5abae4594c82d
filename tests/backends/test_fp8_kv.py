"""The fp8 KV cache (``kv_cache_dtype="fp8"``, ``tandem/core/kv/fp8.py``): quantizing and
calibrating against the formats' own rounding, cpu_paged's op on fp8 storage against a
float64 reference over the dequantized cache, block moves (copy-on-write, swap) as
bytes, one byte per element in the pool's sizing, the capability check, and the option."""

from __future__ import annotations

import math

import pytest
import torch

from tandem.backends.cpu_paged import ops
from tandem.backends.cpu_paged.backend import CPUPagedBackend
from tandem.backends.flash_attn import FlashAttnBackend
from tandem.backends.torch_sdpa import TorchSDPABackend
from tandem.backends.triton.backend import TritonBackend
from tandem.backends.xformers import XFormersBackend
from tandem.core.attention import AttentionType
from tandem.core.config import EngineConfig
from tandem.core.kv import fp8

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# Unit roundoff (half an ulp, relative) of each format's normal numbers: 3 and 2 mantissa bits.
UNIT_ROUNDOFF = {E4M3: 2.0 ** -4, E5M2: 2.0 ** -3}
# Smallest normal magnitude of each format.
MIN_NORMAL = {E4M3: 2.0 ** -6, E5M2: 2.0 ** -14}

try:
    OP = ops.load()
except ops.CPUOpUnavailable:
    OP = None
needs_op = pytest.mark.skipif(OP is None, reason="cpu_paged's C++ op is unavailable here")


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_quantize_rounds_within_the_unit_roundoff_and_saturates(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=g, dtype=torch.float64) * 3
    scale = fp8.calibrated_scale(x, dtype)
    assert math.log2(scale) == int(math.log2(scale))  # a power of two: scaling is exact
    amax = float(x.abs().max())
    # The largest value sits HEADROOM..2*HEADROOM below the format's largest.
    assert fp8.HEADROOM <= torch.finfo(dtype).max * scale / amax < 2 * fp8.HEADROOM
    back = fp8.dequantize(fp8.quantize(x, scale, dtype), scale, torch.float64)
    normal = x.abs() >= MIN_NORMAL[dtype] * scale
    rel = ((back - x).abs() / x.abs())[normal]
    assert float(rel.max()) <= UNIT_ROUNDOFF[dtype]
    # Beyond the range: the largest finite value, never inf or NaN.
    big = fp8.quantize(torch.tensor([1e30, -1e30]), 1.0, dtype).float()
    assert big.tolist() == [torch.finfo(dtype).max, -torch.finfo(dtype).max]


def test_scales_calibrate_once_on_the_first_nonzero_write():
    s = fp8.KVScales()
    s.calibrate(torch.zeros(3, 2, 4), torch.ones(3, 2, 4), E4M3)
    assert not s.calibrated and s.k_scale == 1.0  # all-zero keys: nothing to calibrate on
    s.calibrate(torch.full((1, 1, 4), 4.0), torch.full((1, 1, 4), 0.5), E4M3)
    # 4 * 16 / 448 -> 2^-2; 0.5 * 16 / 448 -> 2^-5
    assert (s.k_scale, s.v_scale, s.calibrated) == (0.25, 2.0 ** -5, True)
    s.calibrate(torch.full((1, 1, 4), 1000.0), torch.full((1, 1, 4), 1000.0), E4M3)
    assert (s.k_scale, s.v_scale) == (0.25, 2.0 ** -5)  # fixed after


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_the_default_write_quantizes_by_slot_and_the_scale(dtype):
    impl = TorchSDPABackend.get_impl_cls()(4, 8, 1.0, 2)
    cache = TorchSDPABackend.allocate_kv_cache(3, 4, 2, 8, dtype, "cpu")
    k = torch.randn(5, 2, 8) * 7
    v = torch.randn(5, 2, 8) * 0.01
    slots = torch.tensor([0, 5, 6, 11, 2])
    impl.write_kv_cache(k, v, cache, slots)
    s = impl.kv_scales
    assert s.calibrated and s.k_scale != s.v_scale  # keys and values scaled each by its own range
    flat = cache.view(2, -1, 2, 8)
    torch.testing.assert_close(flat[0, slots].float() * s.k_scale, fp8.quantize(k, s.k_scale, dtype).float() * s.k_scale,
                               rtol=0, atol=0)
    got = fp8.dequantize(flat[1, slots], s.v_scale, torch.float32)
    assert float(((got - v).abs() / v.abs().clamp_min(MIN_NORMAL[dtype] * s.v_scale)).max()) <= UNIT_ROUNDOFF[dtype]
    assert flat[:, [1, 3, 4]].float().abs().sum() == 0  # other slots untouched


def _reference(q, cache, tables, lens, scale, group, k_scale, v_scale):
    """float64 attention over the dequantized cache (each fp8 value times its scale)."""
    block_size = cache.shape[2]
    out = []
    for i, n in enumerate(lens):
        blocks = tables[i, : -(-n // block_size)]
        k = cache[0, blocks].flatten(0, 1)[:n].double().repeat_interleave(group, dim=1) * k_scale
        v = cache[1, blocks].flatten(0, 1)[:n].double().repeat_interleave(group, dim=1) * v_scale
        w = torch.einsum("hd,lhd->hl", q[i].double(), k) * scale
        out.append(torch.einsum("hl,lhd->hd", w.softmax(-1), v))
    return torch.stack(out)


@needs_op
@pytest.mark.parametrize("cache_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_size,num_heads,num_kv_heads", [(64, 8, 2), (12, 4, 4)], ids=["vector", "scalar"])
def test_the_op_reads_fp8_storage_as_the_dequantized_cache(cache_dtype, query_dtype, head_size, num_heads,
                                                           num_kv_heads):
    lens, block_size = [1, 9, 16, 40, 130], 16
    g = torch.Generator().manual_seed(3)
    total = sum(-(-n // block_size) for n in lens) + 2
    k_scale, v_scale = 2.0 ** -3, 2.0 ** 2
    cache = fp8.quantize(torch.randn(2, total, block_size, num_kv_heads, head_size, generator=g) * 2, 1.0, cache_dtype)
    perm = torch.randperm(total, generator=g)
    tables = torch.full((len(lens), 10), int(perm[-1]), dtype=torch.long)
    at = 0
    for i, n in enumerate(lens):
        nb = -(-n // block_size)
        tables[i, :nb] = perm[at: at + nb]
        at += nb
    q = torch.randn(len(lens), num_heads, head_size, generator=g).to(query_dtype)
    out = torch.empty_like(q)
    rows = seqs = torch.arange(len(lens))
    scale = head_size ** -0.5
    OP(q, cache, out, rows, seqs, torch.tensor(lens), tables, scale, None, None, k_scale, v_scale)
    ref = _reference(q, cache, tables, lens, scale, num_heads // num_kv_heads, k_scale, v_scale)
    # The op's arithmetic is float32 on exactly the dequantized values (the scales are
    # powers of two), as on a float32 cache: the float32 test's tolerance, times v_scale
    # (values up to ~8 * 4); a bfloat16 output rounds once more (2^-8 relative).
    rtol = 1e-4 if query_dtype == torch.float32 else 2.0 ** -8
    torch.testing.assert_close(out.double(), ref, atol=5e-5 * v_scale * 4, rtol=rtol)
    # A grouped call (rows sharing one table) reads the same bytes the same way.
    grouped = torch.empty_like(q)
    same = torch.zeros(3, dtype=torch.long)
    OP(q[:3], cache, grouped[:3], torch.arange(3), same, torch.tensor(lens), tables, scale, None,
       torch.tensor([0, 3]), k_scale, v_scale)
    alone = torch.empty_like(q)
    OP(q[:3], cache, alone[:3], torch.arange(3), same, torch.tensor(lens), tables, scale, None, None, k_scale, v_scale)
    assert torch.equal(grouped[:3], alone[:3])


@needs_op
def test_the_op_refuses_scales_on_a_cache_in_the_model_dtype():
    cache = torch.zeros(2, 1, 4, 1, 8)
    q = torch.zeros(1, 1, 8)
    with pytest.raises(RuntimeError, match="k_scale and v_scale apply to an fp8 cache only"):
        OP(q, cache, torch.empty_like(q), torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long),
           torch.ones(1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long), 1.0, None, None, 0.5, 1.0)


def _fp8_layout(dtype, seed, num_blocks=10, block_size=4, num_kv_heads=2, head_size=16):
    """An fp8 cache with scales that are not 1, and the float32 cache it stands for."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randn(2, num_blocks, block_size, num_kv_heads, head_size, generator=g) * 3
    k_scale, v_scale = 0.25, 2.0
    q8 = torch.stack([fp8.quantize(raw[0], k_scale, dtype), fp8.quantize(raw[1], v_scale, dtype)])
    deq = torch.stack([fp8.dequantize(q8[0], k_scale, torch.float32), fp8.dequantize(q8[1], v_scale, torch.float32)])
    return q8, deq, (k_scale, v_scale)


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_triton_kernels_read_fp8_tiles_as_the_dequantized_cache(dtype):
    """In Triton's interpreter (on CPU): the decode kernel (split-K included) and the varlen
    kernel (a paged, causal prefill and a decode) on fp8 bytes with scales give what they
    give on the float32 cache those bytes stand for (the upcast is exact, the scales
    powers of two: equal up to float32 summation, which is the same here)."""
    pytest.importorskip("triton")
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the kernels are compiled for a GPU here (TRITON_INTERPRET is off)")
    from tandem.backends.triton import configs, kernels

    c8, cf, scales = _fp8_layout(dtype, seed=5)
    g = torch.Generator().manual_seed(6)
    H, D = 4, 16
    tables = torch.tensor([[3, 1, 0, 0], [2, 4, 5, 6], [7, 0, 0, 0]])
    lens = torch.tensor([5, 14, 1], dtype=torch.int32)
    q = torch.randn(3, H, D, generator=g)
    rows = torch.arange(3, dtype=torch.int32)
    cfg = configs.decode(80, torch.float32, D, H // 2)
    for splits in (1, 2):
        o8, of = torch.empty_like(q), torch.empty_like(q)
        kernels.decode_attention(q, c8, o8, rows, lens, tables, scale=0.25, num_splits=splits, config=cfg,
                                 kv_scales=scales)
        kernels.decode_attention(q, cf, of, rows, lens, tables, scale=0.25, num_splits=splits, config=cfg)
        torch.testing.assert_close(o8, of, rtol=1e-6, atol=1e-6)
    # A 3-token prefill after 2 cached tokens (sequence 0: 5 keys) and a decode (sequence 1).
    qv = torch.randn(4, H, D, generator=g)
    q_start = torch.tensor([0, 3, 4], dtype=torch.int32)
    vlens = torch.tensor([5, 14], dtype=torch.int32)
    vcfg = configs.varlen(80, torch.float32, D, 3)
    tile_seq = torch.tensor([0, 1], dtype=torch.int32)
    tile_row = torch.zeros(2, dtype=torch.int32)
    o8, of = torch.empty_like(qv), torch.empty_like(qv)
    for cache, out, kw in ((c8, o8, {"kv_scales": scales}), (cf, of, {})):
        kernels.varlen_attention(qv, cache, None, out, tile_seq, tile_row, q_start, vlens, scale=0.25, causal=True,
                                 config=vcfg, block_table=tables[:2], **kw)
    torch.testing.assert_close(o8, of, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("backend", [TorchSDPABackend, CPUPagedBackend, TritonBackend])
def test_copy_on_write_and_swap_move_fp8_blocks_byte_for_byte(backend, dtype):
    caches = [backend.allocate_kv_cache(6, 4, 2, 8, dtype, "cpu") for _ in range(2)]
    for c in caches:
        c.view(torch.uint8).copy_(torch.randint(0, 126, c.shape, dtype=torch.uint8))  # finite fp8 bytes
    before = [c.view(torch.uint8).clone() for c in caches]
    backend.copy_blocks(caches, torch.tensor([1, 4]), torch.tensor([4, 0]))  # 4 is read before it is written
    for c, b in zip(caches, before):
        raw = c.view(torch.uint8)
        assert torch.equal(raw[:, 4], b[:, 1]) and torch.equal(raw[:, 0], b[:, 4])
        assert torch.equal(raw[:, [1, 2, 3, 5]], b[:, [1, 2, 3, 5]])
    host = backend.allocate_kv_cache(3, 4, 2, 8, dtype, "cpu", zeroed=False)
    backend.swap_blocks(caches[0], host, torch.tensor([0, 5]), torch.tensor([2, 0]))
    back = backend.allocate_kv_cache(6, 4, 2, 8, dtype, "cpu")
    backend.swap_blocks(host, back, torch.tensor([2, 0]), torch.tensor([3, 1]))
    assert torch.equal(back.view(torch.uint8)[:, [3, 1]], caches[0].view(torch.uint8)[:, [0, 5]])


@pytest.mark.parametrize("backend", [TorchSDPABackend, CPUPagedBackend, TritonBackend])
def test_a_block_takes_one_byte_per_element(backend):
    size = dict(block_size=16, num_kv_heads=4, head_size=64)
    fp32 = backend.kv_cache_block_bytes(**size, dtype=torch.float32)
    bf16 = backend.kv_cache_block_bytes(**size, dtype=torch.bfloat16)
    for dtype in (E4M3, E5M2):
        b = backend.kv_cache_block_bytes(**size, dtype=dtype)
        assert b == 2 * 16 * 4 * 64 and 2 * b == bf16 and 4 * b == fp32


CPU = torch.device("cpu")
CUDA = torch.device("cuda")


def _reasons(backend, device, dtype, kv):
    return backend.unsupported_reasons(device, dtype, 64, frozenset(AttentionType), 16, kv)


@pytest.mark.parametrize("kv", [E4M3, E5M2])
def test_the_capability_check_serves_fp8_where_the_kernels_read_it(kv):
    for dtype in (torch.float32, torch.bfloat16):
        assert _reasons(TorchSDPABackend, CPU, dtype, kv) == []
    assert not [r for r in _reasons(TritonBackend, CUDA, torch.float16, kv) if "fp8" in r]
    if OP is not None:
        assert _reasons(CPUPagedBackend, CPU, torch.float32, kv) == []
    name = str(kv).removeprefix("torch.")
    for backend, why in ((FlashAttnBackend, "FlashAttention's paged kernels"), (XFormersBackend, "xFormers'")):
        reasons = _reasons(backend, CUDA, torch.float16, kv)
        assert any(f"an fp8 KV cache ({name}) is not served" in r and why in r for r in reasons), reasons


def test_the_option_takes_vllm_s_names_and_refuses_others(tmp_path):
    for name, dtype in (("fp8", E4M3), ("fp8_e4m3", E4M3), ("fp8_e5m2", E5M2)):
        assert EngineConfig.__dataclass_fields__["kv_cache_dtype"].metadata["choices"].count(name) == 1
        assert fp8.FP8_KV_DTYPES[name] == dtype
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8_e4m3fnuz': must be one of 'auto', 'fp8'"):
        EngineConfig(model=str(tmp_path), kv_cache_dtype="fp8_e4m3fnuz")
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8' with kv_compress"):
        EngineConfig(model=str(tmp_path), kv_cache_dtype="fp8", kv_compress=True)
