"""cpu_flash: the bf16 flash-attention op for encoder runs against float64 attention
of the same bfloat16 inputs (run lengths around its blocks, several heads, strided
inputs as a fused QKV projection gives them), its independence from the thread
count, its argument checks, and when the encoder path takes it or keeps SDPA (the
selection tests run on any CPU; the kernel tests need avx512_bf16)."""

from __future__ import annotations

import pytest
import torch

from helpers import count_flash_calls
from tandem.backends.cpu_flash import encoder, ops

try:
    OP = ops.load()
    WHY = ""
except ops.CPUOpUnavailable as e:
    OP, WHY = None, str(e)
needs_op = pytest.mark.skipif(OP is None, reason=f"the bf16 flash op is unavailable here: {WHY} "
                                                 "(it needs a CPU with avx512_bf16 and a C++ compiler)")

U = 2.0**-8  # bfloat16's unit roundoff (8 significant bits)


def _qkv(lens, heads, head_size, seed):
    """Q, K, V ``[T, H, D]`` bfloat16 as views into one ``[T, 3, H, D]`` projection
    (strided rows, as the engine's fused QKV split passes them) and the runs."""
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(sum(lens), 3, heads, head_size, generator=g) * 2).to(torch.bfloat16)
    runs, start = [], 0
    for n in lens:
        runs.append((start, n))
        start += n
    return qkv[:, 0], qkv[:, 1], qkv[:, 2], runs


def _reference(q, k, v, runs, scale):
    """float64 attention of each run over its own rows, and ``sum_j p_j |v_j|`` (the
    scale the error bound is relative to)."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    mag = torch.zeros(q.shape, dtype=torch.float64)
    for s, n in runs:
        qq, kk, vv = (t[s : s + n].double().transpose(0, 1) for t in (q, k, v))
        p = torch.softmax(qq @ kk.transpose(1, 2) * scale, dim=-1)
        out[s : s + n] = (p @ vv).transpose(0, 1)
        mag[s : s + n] = (p @ vv.abs()).transpose(0, 1)
    return out, mag


def _bound(mag):
    # Each probability is rounded to bf16 before P V: a relative error <= U in its
    # weight, so <= U * sum_j p_j |v_j| in the output. The output is rounded to bf16:
    # <= U * |o| <= U * (1 + U) * sum_j p_j |v_j|. float32 sums, the degree-5 exp2
    # (relative 3e-6) and float32 scores (|q.k| * scale up to ~30 here, float32's
    # 6e-8 relative of that moves a weight by ~2e-6) stay under 1e-5 of the same scale.
    return (U + U * (1 + U) + 1e-5) * mag


@needs_op
@pytest.mark.parametrize("head_size", [64, 32, 128])
@pytest.mark.parametrize("lens", [[1], [17], [64], [100], [1500], [3, 17, 64, 100, 33, 1, 257]])
def test_matches_float64_within_bf16_rounding(lens, head_size):
    heads = 3
    q, k, v, runs = _qkv(lens, heads, head_size, seed=len(lens) * 1000 + lens[0] + head_size)
    scale = head_size**-0.5
    out = torch.full(q.shape, float("nan"), dtype=torch.bfloat16)
    OP(q, k, v, out, torch.tensor(runs).view(-1, 2), scale)
    ref, mag = _reference(q, k, v, runs, scale)
    err = (out.double() - ref).abs()
    assert torch.isfinite(out).all()
    assert (err <= _bound(mag)).all(), (err / mag).max().item()
    # And not trivially: the probabilities' rounding is visible (a kernel that kept P
    # in float32 or dropped a block would show as zero or O(1) error here).
    assert (err / mag).max().item() < 4 * U


@needs_op
def test_same_output_whatever_the_thread_count_and_batch():
    q, k, v, runs = _qkv([1500, 100, 17], heads=4, head_size=64, seed=3)
    idx = torch.tensor(runs).view(-1, 2)
    outs = []
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            o = torch.empty(q.shape, dtype=torch.bfloat16)
            OP(q, k, v, o, idx, 0.125)
            outs.append(o)
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    # A run alone gives what it gives in the batch: each task reads only its own run.
    s, n = runs[1]
    alone = torch.empty((n, 4, 64), dtype=torch.bfloat16)
    OP(q[s : s + n], k[s : s + n], v[s : s + n], alone, torch.tensor([[0, n]]), 0.125)
    assert torch.equal(alone, outs[0][s : s + n])


@needs_op
def test_rejects_bad_arguments_with_a_reason():
    q, k, v, runs = _qkv([20], heads=2, head_size=64, seed=0)
    out = torch.empty(q.shape, dtype=torch.bfloat16)
    idx = torch.tensor(runs).view(-1, 2)
    with pytest.raises(RuntimeError, match="bfloat16"):
        OP(q.float(), k, v, out, idx, 1.0)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        OP(q[..., :48], k[..., :48], v[..., :48], out[..., :48], idx, 1.0)
    with pytest.raises(RuntimeError, match="does not lie within"):
        OP(q, k, v, out, torch.tensor([[10, 11]]), 1.0)
    with pytest.raises(RuntimeError, match="one shape"):
        OP(q, k[:, :1], v[:, :1], out, idx, 1.0)


# Selection: runs on any CPU.

def test_unsupported_cpu_names_the_missing_instruction():
    assert "avx512_bf16" in ops.unsupported_cpu({"avx512f", "avx2"}, "AVX512")
    assert "AVX2" in ops.unsupported_cpu({"avx512f", "avx512_bf16"}, "AVX2")
    assert ops.unsupported_cpu({"avx512f", "avx512_bf16"}, "AVX512") is None


def test_unsupported_inputs_keep_sdpa(monkeypatch):
    q, k, v, _ = _qkv([5], heads=2, head_size=64, seed=0)
    assert encoder.unsupported(q, k, v) is None
    assert "bfloat16" in encoder.unsupported(q.float(), k.float(), v.float())
    assert "head size 48" in encoder.unsupported(q[..., :48], k[..., :48], v[..., :48])
    assert "GQA" in encoder.unsupported(q, k[:, :1], v[:, :1])
    strided = torch.empty(5, 2, 128, dtype=torch.bfloat16)[..., ::2]
    assert "strided" in encoder.unsupported(strided, strided, strided)
    monkeypatch.setenv(encoder.ENV, "0")
    assert encoder.ENV in encoder.unsupported(q, k, v)
    assert encoder.attend(q, k, v, [(0, 5)], 0.125) is None


def test_op_that_cannot_load_keeps_sdpa(monkeypatch):
    def fail():
        raise ops.CPUOpUnavailable("no compiler here")

    monkeypatch.setattr(ops, "load", fail)
    q, k, v, _ = _qkv([5], heads=2, head_size=64, seed=0)
    assert encoder.attend(q, k, v, [(0, 5)], 0.125) is None


def _encoder_layer_output(monkeypatch, dtype):
    """One ENCODER call of torch_sdpa's impl over two runs; also whether the op served it."""
    from tandem.backends.torch_sdpa import TorchSDPABackend
    from tandem.core.attention import AttentionType

    calls = count_flash_calls(monkeypatch)
    impl = TorchSDPABackend.get_impl_cls()(num_heads=2, head_size=64, scale=0.125, num_kv_heads=2)
    q, k, v, runs = _qkv([40, 40], heads=2, head_size=64, seed=7)
    md = type("MD", (), {"encoder_runs": runs})()
    impl.write_new_kv = lambda *a, **kw: None
    out = impl.forward(q.to(dtype), k.to(dtype), v.to(dtype), None, md, AttentionType.ENCODER)
    return out, (q, k, v, runs), calls


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_encoder_path_takes_the_op_for_bf16_where_it_builds(monkeypatch, dtype):
    out, (q, k, v, runs), calls = _encoder_layer_output(monkeypatch, dtype)
    assert calls == [dtype == torch.bfloat16 and OP is not None]
    ref, mag = _reference(q.to(dtype), k.to(dtype), v.to(dtype), runs, 0.125)
    err = (out.double() - ref).abs()
    assert (err <= (_bound(mag) if dtype == torch.bfloat16 else 1e-5 * mag + 1e-6)).all()
