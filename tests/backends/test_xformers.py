"""The xformers backend. xFormers has no CPU kernels, so on CPU its plumbing runs
with the kernel replaced by a float64 reference of the same contract, built on
the mask xFormers itself would apply (``attn_bias.materialize()``): every gather,
bias and GQA reshape the backend builds is checked against the conformance
layouts. The kernels run under ``-m gpu``."""

from __future__ import annotations

import inspect
import random

import pytest
import torch

from layouts import MIXES, check_backend, random_layout, step_inputs
from tandem.core.attention import AttentionType, KVCacheSpec
from tandem.plugins import default_backend_registry
from tandem.registry import BackendUnavailableError

pytest.importorskip("xformers.ops.fmha.attn_bias")
import tandem.backends.xformers as xf  # noqa: E402
from tandem.backends.xformers import XFormersBackend  # noqa: E402

CPU = torch.device("cpu")
ALL_KINDS = frozenset(AttentionType)


def reference_fmha(query, key, value, attn_bias, scale):
    """``memory_efficient_attention``'s contract in float64: ``[1, M, G, H, D]``
    queries over ``[1, N, G, H, D]`` keys (KV heads may be broadcast views) under the
    bias xFormers materializes as an additive ``[M, N]`` mask of 0 / -inf."""
    assert query.dim() == key.dim() == value.dim() == 5 and query.shape[0] == 1
    m, n = query.shape[1], key.shape[1]
    mask = attn_bias.materialize((m, n), dtype=torch.float64)
    scores = torch.einsum("mghd,nghd->ghmn", query[0].double(), key[0].double()) * scale + mask
    out = torch.einsum("ghmn,nghd->mghd", scores.softmax(-1), value[0].double())
    return out.unsqueeze(0).to(query.dtype)


@pytest.fixture
def reference_kernel(monkeypatch):
    calls = []
    monkeypatch.setattr(xf, "_fmha", lambda *a: calls.append(type(a[3]).__name__) or reference_fmha(*a))
    return calls


@pytest.mark.parametrize("heads", [(4, 8), (2, 8), (1, 64)], ids=["mha", "gqa", "mqa-d64"])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("seed", range(2))
def test_plumbing_matches_float64_with_the_materialized_masks(heads, block_size, mix, seed, reference_kernel):
    check_backend(XFormersBackend, seed, block_size, heads[0], heads[1], mix)
    assert {"BlockDiagonalCausalFromBottomRightMask", "BlockDiagonalMask"} <= set(reference_kernel)


@pytest.mark.parametrize("mix", list(MIXES))
def test_the_kernel_call_binds_to_xformers_own_signature(mix, monkeypatch):
    """``_fmha`` itself, on CPU: xFormers' Python API imports without its kernels, so the
    call must bind to the real ``memory_efficient_attention`` (then the reference runs)."""
    import xformers.ops

    real_sig = inspect.signature(xformers.ops.memory_efficient_attention)
    calls = []

    def bound(*a, **kw):
        args = real_sig.bind(*a, **kw).arguments
        calls.append(sorted(args))
        return reference_fmha(args["query"], args["key"], args["value"], args["attn_bias"], args["scale"])

    monkeypatch.setattr(xformers.ops, "memory_efficient_attention", bound)
    check_backend(XFormersBackend, 0, 4, 2, 8, mix)
    assert calls and all(c == ["attn_bias", "key", "query", "scale", "value"] for c in calls)


@pytest.mark.parametrize("seed", range(4))
def test_masks_equal_ones_derived_from_the_layout(seed):
    """The biases against masks written out from the layout's own terms: query j of
    sequence i sees self key p of the same sequence iff p <= ctx_i + j; every cross
    key of its own sequence; encoder tokens every token of their own run."""
    seqs, _ = random_layout(random.Random(seed), 4)
    inputs = step_inputs(seqs, 4)
    md = xf.XFormersMetadataBuilder(4, CPU, KVCacheSpec(1, 2, 8)).build(inputs)
    t = sum(s.q_len for s in seqs)
    n_self, n_cross = sum(s.ctx + s.q_len for s in seqs), sum(s.enc_len for s in seqs)
    want_self = torch.zeros(t, n_self, dtype=torch.bool)
    want_cross = torch.zeros(t, n_cross, dtype=torch.bool)
    row = k_self = k_cross = 0
    for s in seqs:
        for j in range(s.q_len):
            want_self[row + j, k_self : k_self + s.ctx + j + 1] = True
            want_cross[row + j, k_cross : k_cross + s.enc_len] = True
        row, k_self, k_cross = row + s.q_len, k_self + s.ctx + s.q_len, k_cross + s.enc_len
    assert torch.equal(md.self_bias.materialize((t, n_self)) == 0, want_self)
    assert torch.equal(md.cross_bias.materialize((t, n_cross)) == 0, want_cross)
    runs = inputs.encoder_seq_lens
    if runs:
        e = sum(runs)
        want_enc = torch.block_diag(*[torch.ones(n, n, dtype=torch.bool) for n in runs])
        assert torch.equal(md.encoder_bias.materialize((e, e)) == 0, want_enc)
    else:
        assert md.encoder_bias is None
    # The packed slots are each sequence's positions through its own table.
    expect = [s.table[p // 4] * 4 + p % 4 for s in seqs for p in range(s.ctx + s.q_len)]
    assert md.self_slots.tolist() == expect


def test_cpu_is_refused_naming_the_device():
    reasons = XFormersBackend.unsupported_reasons(CPU, torch.float32, 64, ALL_KINDS, 16, torch.float32)
    assert reasons == ["device 'cpu' is not cuda"]
    with pytest.raises(BackendUnavailableError,
                       match=r"attention_backend='xformers' cannot serve this model: device 'cpu' is not cuda"):
        default_backend_registry().select("xformers", device=CPU, dtype=torch.float32, head_size=64,
                                          attn_types=ALL_KINDS, block_size=16)


def test_each_bad_value_is_named(monkeypatch):
    monkeypatch.setattr(xf.importlib.util, "find_spec", lambda name: None)
    reasons = XFormersBackend.unsupported_reasons(torch.device("cuda"), torch.float64, 12, ALL_KINDS, 0,
                                                  torch.float16)
    text = " | ".join(reasons)
    for needle in ("xformers package is not installed (pip install 'tandem-engine[xformers]')", "torch.float64",
                   "KV-cache dtype torch.float16", "head size 12 is not a multiple of 8", "block_size 0"):
        assert needle in text
    assert len(reasons) == 5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_size,block_size", [(8, 1), (64, 16), (256, 7)])
def test_cuda_configurations_it_serves_pass_the_check(dtype, head_size, block_size):
    cuda = torch.device("cuda")  # a device object only: nothing runs
    assert XFormersBackend.unsupported_reasons(cuda, dtype, head_size, ALL_KINDS, block_size, dtype) == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("heads", [(4, 8), (2, 64), (1, 128)])
@pytest.mark.parametrize("seed", range(2))
def test_cuda_kernels_match_float64(dtype, block_size, mix, heads, seed):
    check_backend(XFormersBackend, seed, block_size, heads[0], heads[1], mix, device="cuda", dtype=dtype)
