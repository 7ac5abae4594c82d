"""The flash_attn backend. FlashAttention has no CPU kernels, so on CPU each of its
three kernel sources (FA4's ``flash_attn.cute``, FA2's ``flash_attn``, torch's
``varlen_attn``) is replaced by a float64 reference with that library's own call
contract (argument names, int32 ``cu_seqlens``, where key lengths come from in
paged mode, the page-size rule) and the conformance layouts run through it: the
backend's lengths, tables, gathers and argument mapping are what is checked. The
kernels run under ``-m gpu``."""

from __future__ import annotations

import inspect
import sys
import types

import pytest
import torch

from layouts import MIXES, check_backend, reference
from tandem.core.attention import AttentionType
from tandem.plugins import default_backend_registry
from tandem.registry import BackendUnavailableError
import tandem.backends.flash_attn as fa
from tandem.backends.flash_attn import FlashAttnBackend

CPU = torch.device("cpu")
CUDA = torch.device("cuda")  # a device object only, for capability checks
ALL_KINDS = frozenset(AttentionType)
KERNEL = {k.name: k for k in fa.KERNELS}


def ref_varlen(q, k, v, cu_q, *, cu_k, seqused_k, table, scale, causal):
    """Per sequence, float64 attention over its keys: a packed run ``cu_k[i]:cu_k[i+1]``,
    or through ``table`` from the paged ``[num_pages, page, H_kv, D]`` cache, the
    first ``seqused_k[i]`` keys (or ``cu_k``'s length); causal is bottom-right."""
    for t in (cu_q, cu_k, seqused_k, table):
        assert t is None or t.dtype == torch.int32, "FlashAttention takes int32 lengths and tables"
    out = torch.empty_like(q)
    for i in range(cu_q.numel() - 1):
        qs, qe = int(cu_q[i]), int(cu_q[i + 1])
        n = int(seqused_k[i]) if seqused_k is not None else int(cu_k[i + 1] - cu_k[i])
        if table is not None:
            page = k.shape[1]
            pos = torch.arange(n)
            blocks = table[i].long()[pos // page]
            keys, vals = k[blocks, pos % page], v[blocks, pos % page]
        else:
            keys, vals = k[int(cu_k[i]) : int(cu_k[i]) + n], v[int(cu_k[i]) : int(cu_k[i]) + n]
        o = reference(q[qs:qe].double(), keys.double(), vals.double(), scale, n - (qe - qs) if causal else None)
        out[qs:qe] = o.to(q.dtype)
    return out


def fake_fa2_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                    deterministic=False, return_attn_probs=False, block_table=None):
    if block_table is not None:
        assert k.shape[1] % 256 == 0, "Paged KV cache block size must be divisible by 256"
    assert max_seqlen_q == int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    assert max_seqlen_k == int((cu_seqlens_k[1:] - cu_seqlens_k[:-1]).max())
    return ref_varlen(q, k, v, cu_seqlens_q, cu_k=cu_seqlens_k, seqused_k=None, table=block_table,
                      scale=softmax_scale, causal=causal)


def fake_fa4_varlen(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                    seqused_q=None, seqused_k=None, page_table=None, softmax_scale=None, causal=False, **rest):
    if page_table is not None:
        assert cu_seqlens_k is None and seqused_k is not None, "page_table takes seqused_k, not cu_seqlens_k"
    out = ref_varlen(q, k, v, cu_seqlens_q, cu_k=cu_seqlens_k, seqused_k=seqused_k, table=page_table,
                     scale=softmax_scale, causal=causal)
    return out, None  # (out, lse)


def fake_torch_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                      window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
    heads_k = key.shape[2] if block_table is not None else key.shape[1]
    assert enable_gqa == (query.shape[1] != heads_k), "torch's varlen_attn needs enable_gqa exactly for GQA"
    assert window_size in ((-1, -1), (-1, 0))
    if block_table is not None:
        assert seqused_k is not None and key.shape[1] % 256 == 0
    return ref_varlen(query, key, value, cu_seq_q, cu_k=cu_seq_k, seqused_k=seqused_k, table=block_table,
                      scale=scale, causal=window_size == (-1, 0))


@pytest.fixture
def kernel(request, monkeypatch):
    """Force one kernel source and replace its library call with the reference."""
    name = request.param
    if name == "fa2":
        monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_varlen_func=fake_fa2_varlen))
    elif name == "fa4":
        monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace())
        monkeypatch.setitem(sys.modules, "flash_attn.cute",
                            types.SimpleNamespace(flash_attn_varlen_func=fake_fa4_varlen))
    else:
        import torch.nn.attention.varlen as varlen

        # torch ships varlen_attn on CPU too (its kernel is CUDA-only): each call must
        # bind to the real signature, so a renamed or dropped argument fails here.
        real_sig = inspect.signature(varlen.varlen_attn)
        monkeypatch.setattr(varlen, "varlen_attn",
                            lambda *a, **kw: real_sig.bind(*a, **kw) and fake_torch_varlen(*a, **kw))
    monkeypatch.setattr(fa, "pick_kernel", lambda device: KERNEL[name])
    calls = []
    real = getattr(fa, KERNEL[name].call)
    monkeypatch.setattr(fa, KERNEL[name].call, lambda *a, **kw: calls.append(kw["block_table"] is not None)
                        or real(*a, **kw))
    return name, calls


@pytest.mark.parametrize("kernel", ["fa4", "fa2", "torch"], indirect=True)
@pytest.mark.parametrize("heads", [(4, 8), (2, 8), (1, 64)], ids=["mha", "gqa", "mqa-d64"])
@pytest.mark.parametrize("block_size", [1, 4, 16, 256])
@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("seed", range(2))
def test_plumbing_matches_float64_through_each_kernel_contract(kernel, heads, block_size, mix, seed):
    name, paged_calls = kernel
    check_backend(FlashAttnBackend, seed, block_size, heads[0], heads[1], mix)
    # The paged cache is read in place where the kernel's page-size rule allows, else gathered.
    in_place = name == "fa4" or block_size % 256 == 0
    assert paged_calls and set(paged_calls) <= {in_place, False}  # the encoder never pages
    assert in_place in paged_calls


def test_kernel_order_and_page_rules():
    assert [k.name for k in fa.KERNELS] == ["fa4", "fa2", "torch"]
    assert fa.pages_in_place(KERNEL["fa4"], 16) and fa.pages_in_place(KERNEL["fa4"], 128)
    for name in ("fa2", "torch"):
        assert fa.pages_in_place(KERNEL[name], 256) and fa.pages_in_place(KERNEL[name], 512)
        assert not fa.pages_in_place(KERNEL[name], 16) and not fa.pages_in_place(KERNEL[name], 128)


def test_pick_kernel_takes_the_first_that_imports(monkeypatch):
    monkeypatch.setattr(fa, "_capability", lambda device: (9, 0))
    monkeypatch.setattr(fa, "_importable", lambda m: m in ("flash_attn", "torch.nn.attention.varlen"))
    assert fa.pick_kernel(CUDA).name == "fa2"
    monkeypatch.setattr(fa, "_importable", lambda m: True)
    assert fa.pick_kernel(CUDA).name == "fa4"
    monkeypatch.setattr(fa, "_capability", lambda device: (8, 0))  # Ampere: no FA4
    assert fa.pick_kernel(CUDA).name == "fa2"
    monkeypatch.setattr(fa, "_capability", lambda device: (7, 5))
    assert fa.pick_kernel(CUDA) is None


def test_cpu_and_float32_are_refused_naming_each_reason():
    reasons = FlashAttnBackend.unsupported_reasons(CPU, torch.float32, 64, ALL_KINDS, 16, torch.float32)
    assert reasons == ["device 'cpu' is not cuda", "dtype torch.float32 is not float16 or bfloat16"]
    with pytest.raises(BackendUnavailableError, match=r"attention_backend='flash_attn' cannot serve this model: "
                       r"device 'cpu' is not cuda; dtype torch.float32 is not float16 or bfloat16"):
        default_backend_registry().select("flash_attn", device=CPU, dtype=torch.float32, head_size=64,
                                          attn_types=ALL_KINDS, block_size=16)


def test_no_kernel_names_what_to_install(monkeypatch):
    monkeypatch.setattr(fa, "_importable", lambda m: False)
    reasons = FlashAttnBackend.unsupported_reasons(CUDA, torch.bfloat16, 64, ALL_KINDS, 16, torch.bfloat16)
    assert len(reasons) == 1 and reasons[0].startswith("no FlashAttention kernel is installed: ")
    for hint in ("fa4: pip install flash-attn-4", "fa2: pip install flash-attn", "torch: torch >= 2.10 with CUDA"):
        assert hint in reasons[0]


def test_other_bad_values_are_named(monkeypatch):
    monkeypatch.setattr(fa, "_capability", lambda device: (7, 0))
    reasons = FlashAttnBackend.unsupported_reasons(CUDA, torch.float16, 100, ALL_KINDS, 0, torch.bfloat16)
    text = " | ".join(reasons)
    for needle in ("compute capability 7.0 is below 8.0", "KV-cache dtype torch.bfloat16 differs",
                   "head size 100 is not a multiple of 8", "block_size 0"):
        assert needle in text
    assert len(reasons) == 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("heads", [(4, 64), (2, 64), (1, 128)])
@pytest.mark.parametrize("seed", range(2))
def test_cuda_kernels_match_float64(dtype, block_size, mix, heads, seed):
    reasons = FlashAttnBackend.unsupported_reasons(CUDA, dtype, heads[1], ALL_KINDS, block_size, dtype)
    if reasons:
        pytest.skip("; ".join(reasons))
    check_backend(FlashAttnBackend, seed, block_size, heads[0], heads[1], mix, device="cuda", dtype=dtype)
