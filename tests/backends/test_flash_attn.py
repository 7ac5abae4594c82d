"""The flash_attn backend. FlashAttention has no CPU kernels, so on CPU each of its
three kernel sources (FA4's ``flash_attn.cute``, FA2's ``flash_attn``, torch's
``varlen_attn``) is replaced by a float64 reference with that library's own call
contract (argument names, int32 ``cu_seqlens``, where key lengths come from in
paged mode, the page-size rule, FA4's key tile and its "irregular head dim"
assert) and the conformance layouts run through it: the backend's lengths,
tables, gathers and argument mapping are what is checked. The calls bind to the
real signatures where those can be read on CPU: torch's ``varlen_attn`` always,
FA4's ``flash_attn_varlen_func`` from its wheel's source when one is at
``TANDEM_FA4_WHEEL`` (default ``.ci/cache/flash-attn-4/``), which also checks
tandem's copy of FA4's tile rule against FA4's own functions. The kernels run
under ``-m gpu``."""

from __future__ import annotations

import ast
import inspect
import os
import sys
import types
import zipfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Optional, Tuple

import pytest
import torch

from layouts import MIXES, check_backend, reference
from tandem.core.attention import AttentionType
from tandem.plugins import default_backend_registry
from tandem.registry import BackendUnavailableError
import tandem.backends.flash_attn as fa
import tandem.backends.flash_attn_kernels as fk
from tandem.backends.flash_attn import FlashAttnBackend

CPU = torch.device("cpu")
CUDA = torch.device("cuda")  # a device object only, for capability checks
ALL_KINDS = frozenset(AttentionType)
KERNEL = {k.name: k for k in fk.KERNELS}
ROOT = Path(__file__).resolve().parents[2]


# -- FA4's own source, when CI has fetched its wheel ---------------------------------


def _fa4_wheel() -> Path | None:
    where = Path(os.environ.get("TANDEM_FA4_WHEEL", ROOT / ".ci" / "cache" / "flash-attn-4"))
    if where.is_dir():
        wheels = sorted(where.glob("flash_attn_4-*.whl"))
        return wheels[-1] if wheels else None
    return where if where.is_file() else None


@lru_cache(maxsize=None)
def fa4_source(name: str) -> str | None:
    """``flash_attn/cute/<name>`` from the flash-attn-4 wheel, read, never installed:
    installing flash-attn-4 next to xformers breaks ``import xformers.ops``."""
    wheel = _fa4_wheel()
    if wheel is None:
        return None
    with zipfile.ZipFile(wheel) as z:
        return z.read(f"flash_attn/cute/{name}").decode()


NO_FA4 = ("no flash-attn-4 wheel at TANDEM_FA4_WHEEL or .ci/cache/flash-attn-4/ (.ci/run fetches one with "
          "pip download --no-deps)")


@lru_cache(maxsize=None)
def fa4_functions() -> dict:
    """FA4's own ``FwdConfig``, ``_tile_size_fwd_sm90`` and ``_validate_head_dims``,
    taken out of its interface.py (pure Python; the module itself needs CUDA to import)."""
    tree = ast.parse(fa4_source("interface.py"))
    wanted = {"FwdConfig", "_tile_size_fwd_sm90", "_validate_head_dims"}
    body = [n for n in tree.body if getattr(n, "name", None) in wanted]
    assert {n.name for n in body} == wanted, "FA4's interface.py no longer defines " + str(wanted)
    namespace = {"dataclass": dataclass, "lru_cache": lru_cache, "Optional": Optional, "Tuple": Tuple}
    exec(compile(ast.Module(body=body, type_ignores=[]), "fa4/interface.py", "exec"), namespace)
    return namespace


@lru_cache(maxsize=None)
def fa4_signature() -> inspect.Signature | None:
    source = fa4_source("interface.py")
    if source is None:
        return None
    return inspect.Signature(fk.parameters_from_source(source, "flash_attn_varlen_func"))


# FA4 4.0.0b36's sm90 key tile for equal head dims (interface.py, _tile_size_fwd_sm90),
# read by hand: the oracle when no wheel is here. (max head size, causal) -> tile.
SM90_TILES = {(64, True): 128, (64, False): 128, (96, True): 128, (96, False): 144, (128, True): 128,
              (128, False): 128, (192, True): 112, (192, False): 112, (256, True): 80, (256, False): 80}


def fa4_tile(capability, head_size, causal) -> int:
    """FA4's key tile: its own function where the wheel is here, else the table."""
    if capability[0] != 9:
        return 128  # _get_fwd_config's FwdConfig(128, 128, ...) default off sm90 / sm80 / sm120
    if fa4_source("interface.py") is not None:
        return fa4_functions()["_tile_size_fwd_sm90"](head_size, head_size, causal, False).n_block_size
    return next(t for (top, c), t in sorted(SM90_TILES.items()) if head_size <= top and c == causal)


def fa4_refuses_head(capability, head_size) -> bool:
    if fa4_source("interface.py") is not None:
        try:
            fa4_functions()["_validate_head_dims"](head_size, head_size, capability[0], 8)
        except AssertionError:
            return True
        return False
    return capability[0] == 10 and not (8 <= head_size <= 128 or head_size == 256)


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


def make_fake_fa4(capability, calls):
    """FA4's ``flash_attn_varlen_func`` on the GPU ``capability`` (None: unknown): its
    input checks (``_flash_attn_fwd``), its head-size rule and the "irregular head dim"
    assert of a page size other than its key tile, then the reference. Records
    (kind, paged, TMA) per call."""

    def fake(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
             seqused_q=None, seqused_k=None, page_table=None, softmax_scale=None, causal=False, **rest):
        batch, head = cu_seqlens_q.shape[0] - 1, q.shape[-1]
        assert q.dtype == k.dtype == v.dtype, "q, k, v, and qv must have the same dtype"
        for t in (cu_seqlens_q, cu_seqlens_k, seqused_k):
            assert t is None or (t.dtype == torch.int32 and t.stride(0) == 1), "must be int32 / contiguous"
        assert seqused_k is None or seqused_k.shape == (batch,)
        assert max_seqlen_q is None or max_seqlen_q >= int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
        tma = None
        if page_table is not None:
            assert cu_seqlens_k is None, "page_table is not supported with cu_seqlens_k"
            assert page_table.dtype == torch.int32 and page_table.stride(-1) == 1
            assert page_table.shape[0] == batch and seqused_k is not None
            tma = capability is not None and k.shape[1] == fa4_tile(capability, head, causal)
            if capability is None:
                # A GPU tandem could not name: every tile is possible, so only multiples of 16 are safe.
                assert head % 16 == 0, "Paged KV does not support irregular head dim (on some tile)"
            else:
                assert tma or head % 16 == 0, "Paged KV does not support irregular head dim"
        else:
            assert cu_seqlens_k.shape == (batch + 1,) and k.shape[0] == v.shape[0]
        if capability is not None:
            assert not fa4_refuses_head(capability, head), f"head_dim {head} is not supported"
        encoder = cu_seqlens_k is cu_seqlens_q  # the adapter passes the encoder's one run twice
        calls.append(("encoder" if encoder else "self" if causal else "cross", page_table is not None, tma))
        out = ref_varlen(q, k, v, cu_seqlens_q, cu_k=cu_seqlens_k, seqused_k=seqused_k, table=page_table,
                         scale=softmax_scale, causal=causal)
        return out, None  # (out, lse)

    sig = fa4_signature()
    if sig is None:
        return fake

    def bound(*a, **kw):  # FA4's real parameters, from its source
        sig.bind(*a, **kw)
        return fake(*a, **kw)

    return bound


def fake_torch_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                      window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
    heads_k = key.shape[2] if block_table is not None else key.shape[1]
    assert enable_gqa == (query.shape[1] != heads_k), "torch's varlen_attn needs enable_gqa exactly for GQA"
    assert window_size in ((-1, -1), (-1, 0))
    if block_table is not None:
        assert seqused_k is not None and key.shape[1] % 256 == 0
    return ref_varlen(query, key, value, cu_seq_q, cu_k=cu_seq_k, seqused_k=seqused_k, table=block_table,
                      scale=scale, causal=window_size == (-1, 0))


def force_kernel(monkeypatch, name, capability=None):
    """Force one kernel source on a GPU of ``capability`` and replace its library call
    with the reference. Returns the list the FA4 reference records its calls in."""
    calls = []
    if name == "fa2":
        monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_varlen_func=fake_fa2_varlen))
    elif name == "fa4":
        monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace())
        monkeypatch.setitem(sys.modules, "flash_attn.cute",
                            types.SimpleNamespace(flash_attn_varlen_func=make_fake_fa4(capability, calls)))
    else:
        import torch.nn.attention.varlen as varlen

        # torch ships varlen_attn on CPU too (its kernel is CUDA-only): each call must
        # bind to the real signature, so a renamed or dropped argument fails here.
        real_sig = inspect.signature(varlen.varlen_attn)
        monkeypatch.setattr(varlen, "varlen_attn",
                            lambda *a, **kw: real_sig.bind(*a, **kw) and fake_torch_varlen(*a, **kw))
    monkeypatch.setattr(fa, "pick_kernel", lambda device, head_size: KERNEL[name])
    monkeypatch.setattr(fa, "_capability", lambda device: capability)
    return calls


@pytest.fixture
def kernel(request, monkeypatch):
    name = request.param
    paged = []  # per call: whether the adapter got a block table
    force_kernel(monkeypatch, name)
    real = getattr(fk, KERNEL[name].call)
    monkeypatch.setattr(fk, KERNEL[name].call, lambda *a, **kw: paged.append(kw["block_table"] is not None)
                        or real(*a, **kw))
    return name, paged


@pytest.mark.parametrize("kernel", ["fa4", "fa2", "torch"], indirect=True)
@pytest.mark.parametrize("heads", [(4, 8), (2, 16), (1, 64)], ids=["mha-d8", "gqa-d16", "mqa-d64"])
@pytest.mark.parametrize("block_size", [1, 4, 16, 256])
@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("seed", range(2))
def test_plumbing_matches_float64_through_each_kernel_contract(kernel, heads, block_size, mix, seed):
    name, paged_calls = kernel
    check_backend(FlashAttnBackend, seed, block_size, heads[0], heads[1], mix)
    # The paged cache is read in place where the kernel's page-size rule allows, else gathered:
    # FA4 on an unknown GPU only at head sizes that are multiples of 16.
    in_place = heads[1] % 16 == 0 if name == "fa4" else block_size % 256 == 0
    assert paged_calls and set(paged_calls) <= {in_place, False}  # the encoder never pages
    assert in_place in paged_calls


# (capability, head size, block size): FA4's paged path at its key tile (TMA), off it
# (non-TMA, refused for head sizes not a multiple of 16), per kind.
FA4_CASES = [((9, 0), 72, 16), ((9, 0), 72, 128), ((9, 0), 72, 144), ((9, 0), 80, 144), ((9, 0), 136, 112),
             ((9, 0), 136, 128), ((9, 0), 200, 80), ((9, 0), 248, 128), ((9, 0), 64, 128), ((10, 0), 72, 128),
             ((10, 0), 72, 16), ((10, 0), 256, 16)]


@pytest.mark.parametrize("cap, head_size, block_size", FA4_CASES)
def test_fa4_pages_in_place_exactly_where_fa4_takes_the_page_size(monkeypatch, cap, head_size, block_size):
    calls = force_kernel(monkeypatch, "fa4", cap)
    check_backend(FlashAttnBackend, 0, block_size, 2, head_size, "mixed", dtype=torch.bfloat16)
    assert {(paged, tma) for kind, paged, tma in calls if kind == "encoder"} == {(False, None)}
    for kind, causal in (("self", True), ("cross", False)):
        tile = fa4_tile(cap, head_size, causal)
        ok = head_size % 16 == 0 or block_size == tile  # what FA4 takes in place
        seen = {(paged, tma) for k, paged, tma in calls if k == kind}
        assert seen == ({(True, block_size == tile)} if ok else {(False, None)}), (kind, tile, seen)


def test_fa4_key_tile_and_head_sizes_follow_fa4():
    """tandem's copy of FA4's rules against FA4's own functions (the wheel's source) or,
    without it, the table read from 4.0.0b36."""
    for cap in ((9, 0), (10, 0), (10, 3)):
        for head in range(8, 257, 8):
            assert (fk.fa4_head_size_problem(cap, head) is not None) == fa4_refuses_head(cap, head), (cap, head)
            for causal in (True, False):
                tile = fa4_tile(cap, head, causal)
                assert fk.fa4_key_tile(cap, head, causal) == tile, (cap, head, causal)
                for block in (16, 64, 80, 112, 128, 144, 256):
                    want = head % 16 == 0 or block == tile
                    assert fk.fa4_reads_pages_in_place(cap, head, block, causal) == want, (cap, head, block)
    assert fk.fa4_reads_pages_in_place(None, 64, 16, True) and not fk.fa4_reads_pages_in_place(None, 72, 128, True)


def test_fa4_source_still_reads_as_tandem_encodes_it():
    """The facts the rule rests on, in FA4's own files: non-TMA paging is "page size is
    not the key tile", it asserts on a head dim not padded-equal to 16, and the default
    tile off sm90 is 128."""
    if fa4_source("interface.py") is None:
        pytest.skip(NO_FA4)
    interface = fa4_source("interface.py")
    assert interface.count("paged_kv_non_tma=page_size not in [None, tile_n]") == 2  # sm90, sm100
    assert "cfg = FwdConfig(128, 128, True, True)" in interface
    for name in ("flash_fwd_sm90.py", "flash_fwd_sm100.py"):
        assert "Paged KV does not support irregular head dim" in fa4_source(name)
    assert "hdim_multiple_of = 16" in fa4_source("flash_fwd.py")
    assert fk.call_problem(KERNEL["fa4"], list(fa4_signature().parameters.values())) is None


def test_kernel_order_and_page_rules():
    assert [k.name for k in fk.KERNELS] == ["fa4", "fa2", "torch"]
    for name in ("fa2", "torch"):
        for cap in (None, (9, 0)):
            assert fk.pages_in_place(KERNEL[name], 256, cap, 72, True) and fk.pages_in_place(KERNEL[name], 512, cap,
                                                                                               64, False)
            assert not fk.pages_in_place(KERNEL[name], 16, cap, 64, True)
            assert not fk.pages_in_place(KERNEL[name], 128, cap, 64, True)


@pytest.fixture
def installed(monkeypatch):
    """Say which kernel distributions are installed, with interfaces that take tandem's call."""

    def set_installed(*names):
        monkeypatch.setattr(fk, "_importable", lambda kernel: kernel.name in names)
        monkeypatch.setattr(fk, "interface_problem", lambda kernel: None)

    return set_installed


def test_pick_kernel_takes_the_first_that_can_serve(monkeypatch, installed):
    monkeypatch.setattr(fa, "_capability", lambda device: (9, 0))
    installed("fa2", "torch")
    assert fa.pick_kernel(CUDA, 64).name == "fa2"
    installed("fa4", "fa2", "torch")
    assert fa.pick_kernel(CUDA, 64).name == "fa4"
    assert fa.pick_kernel(CUDA, 200).name == "fa4"  # sm90 takes 8..256
    monkeypatch.setattr(fa, "_capability", lambda device: (10, 0))
    assert fa.pick_kernel(CUDA, 256).name == "fa4"
    assert fa.pick_kernel(CUDA, 200).name == "fa2"  # FA4 on sm100: 8..128 and 256
    monkeypatch.setattr(fa, "_capability", lambda device: (12, 0))  # FA4 has no paged path on sm120
    assert fa.pick_kernel(CUDA, 64).name == "fa2"
    monkeypatch.setattr(fa, "_capability", lambda device: (8, 0))  # Ampere: no FA4
    assert fa.pick_kernel(CUDA, 64).name == "fa2"
    monkeypatch.setattr(fa, "_capability", lambda device: (7, 5))
    assert fa.pick_kernel(CUDA, 64) is None


def test_sm100_head_size_fa4_refuses_is_a_reason_when_nothing_else_serves(monkeypatch, installed):
    monkeypatch.setattr(fa, "_capability", lambda device: (10, 0))
    installed("fa4")
    assert FlashAttnBackend.unsupported_reasons(CUDA, torch.bfloat16, 128, ALL_KINDS, 16, torch.bfloat16) == []
    reasons = FlashAttnBackend.unsupported_reasons(CUDA, torch.bfloat16, 200, ALL_KINDS, 16, torch.bfloat16)
    assert len(reasons) == 1
    assert reasons[0].startswith("no FlashAttention kernel can serve head size 200 here: fa4: FA4 on sm100 takes "
                                 "head sizes 8..128 and 256, not 200; fa2: not installed")


def test_no_kernel_names_what_to_install(monkeypatch):
    monkeypatch.setattr(fk, "_importable", lambda kernel: False)
    reasons = FlashAttnBackend.unsupported_reasons(CUDA, torch.bfloat16, 64, ALL_KINDS, 16, torch.bfloat16)
    assert len(reasons) == 1 and reasons[0].startswith("no FlashAttention kernel can serve head size 64 here: ")
    for hint in ("fa4: not installed (pip install 'flash-attn-4>=4.0.0b11')",
                 "fa2: not installed (pip install --no-build-isolation 'flash-attn>=2.6' (a source build)",
                 "torch: not installed (torch >= 2.10 with CUDA)"):
        assert hint in reasons[0]


def test_cpu_and_float32_are_refused_naming_each_reason():
    reasons = FlashAttnBackend.unsupported_reasons(CPU, torch.float32, 64, ALL_KINDS, 16, torch.float32)
    assert reasons == ["device 'cpu' is not cuda", "dtype torch.float32 is not float16 or bfloat16"]
    with pytest.raises(BackendUnavailableError, match=r"attention_backend='flash_attn' cannot serve this model: "
                       r"device 'cpu' is not cuda; dtype torch.float32 is not float16 or bfloat16"):
        default_backend_registry().select("flash_attn", device=CPU, dtype=torch.float32, head_size=64,
                                          attn_types=ALL_KINDS, block_size=16)


def test_other_bad_values_are_named(monkeypatch):
    monkeypatch.setattr(fa, "_capability", lambda device: (7, 0))
    reasons = FlashAttnBackend.unsupported_reasons(CUDA, torch.float16, 100, ALL_KINDS, 0, torch.bfloat16)
    text = " | ".join(reasons)
    for needle in ("compute capability 7.0 is below 8.0", "KV-cache dtype torch.bfloat16 differs",
                   "head size 100 is not a multiple of 8", "block_size 0"):
        assert needle in text
    assert len(reasons) == 4


# -- the installed interfaces, read without importing them --------------------------

# flash-attn 2.8.3.post2's own flash_attn/cute/interface.py (its sdist installs it over
# FA4's): the signature as it is there, no max_seqlen_q / max_seqlen_k.
FA2_SDIST_CUTE = """
def flash_attn_varlen_func(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None,
                           page_table=None, softmax_scale=None, causal=False, window_size=(None, None),
                           learnable_sink=None, softcap=0.0, pack_gqa=None):
    pass
"""


@pytest.fixture
def fake_site(tmp_path, monkeypatch):
    """A ``flash_attn`` package directory the kernels module finds instead of the real one,
    and the distribution versions it reports."""
    versions = {}
    monkeypatch.setattr(fk, "_package_dirs", lambda package: [tmp_path / "flash_attn"])
    monkeypatch.setattr(fk, "_version", lambda dist: versions.get(dist))
    monkeypatch.setattr(fk, "_owner_note", lambda kernel, path: "")
    fk.interface_problem.cache_clear()
    yield tmp_path / "flash_attn", versions
    fk.interface_problem.cache_clear()


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_fa2_sdist_cute_over_fa4_is_not_available_and_says_why(fake_site, monkeypatch):
    pkg, versions = fake_site
    versions.update({"flash-attn-4": "4.0.0b36", "flash-attn": "2.8.3.post2"})
    write(pkg / "cute" / "interface.py", FA2_SDIST_CUTE)
    monkeypatch.setattr(fa, "_capability", lambda device: (9, 0))
    problem = fa.kernel_problems(CUDA, 64)["fa4"]
    assert "has no max_seqlen_k, max_seqlen_q" in problem and "flash-attn 2.8.3.post2 is installed too" in problem
    assert problem.endswith("reinstall flash-attn-4 after flash-attn "
                            "(pip install --force-reinstall --no-deps 'flash-attn-4>=4.0.0b11')")
    assert fa.pick_kernel(CUDA, 64).name == "torch"  # fa2: its flash_attn_interface.py is not there either
    write(pkg / "flash_attn_interface.py", "def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, "
          "max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None, causal=False, block_table=None): pass")
    fk.interface_problem.cache_clear()
    assert fa.pick_kernel(CUDA, 64).name == "fa2"


def test_fa4_older_than_its_rules_is_not_available(fake_site, monkeypatch):
    _, versions = fake_site
    versions["flash-attn-4"] = "4.0.0b5"
    monkeypatch.setattr(fa, "_capability", lambda device: (9, 0))
    assert fa.kernel_problems(CUDA, 64)["fa4"] == (
        "flash-attn-4 4.0.0b5 is older than 4.0.0b11, the first whose tile and head-size rules tandem "
        "follows: pip install -U 'flash-attn-4>=4.0.0b11'")


def test_fa4_interface_that_takes_the_call_is_available(fake_site):
    pkg, versions = fake_site
    versions["flash-attn-4"] = "4.0.0b36"
    source = fa4_source("interface.py")
    if source is None:  # the parameters tandem relies on, in FA4's order (4.0.0b36)
        source = ("def flash_attn_varlen_func(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, "
                  "max_seqlen_q=None, max_seqlen_k=None, min_seqlen_k=None, seqused_q=None, seqused_k=None, "
                  "gather_kv_indices=None, page_table=None, softmax_scale=None, causal=False): pass")
    write(pkg / "cute" / "interface.py", source)
    assert fk.interface_problem(KERNEL["fa4"]) is None


def test_call_problem_names_what_does_not_bind():
    P = fk.parameters_from_source
    fa4 = KERNEL["fa4"]
    assert fk.call_problem(fa4, P("def f(q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, "
                                  "seqused_k, page_table, softmax_scale, causal, extra): pass", "f")) == \
        "requires extra, which tandem does not pass"
    assert fk.call_problem(fa4, P("def f(query, k, v, **kw): pass", "f")) == \
        "takes (query, k, v) first where tandem passes (q, k, v)"
    assert fk.call_problem(fa4, P("def f(q, k, v, **kw): pass", "f")) is None
    assert P("def g(): pass", "f") is None


def test_torch_varlen_attn_takes_tandems_call(monkeypatch, tmp_path):
    """The real torch function (it exists on CPU builds): no stand-in. Its signature is
    read from the module's source (importing it would import torch._dynamo)."""
    import importlib.machinery
    import inspect

    import torch.nn.attention.varlen as varlen

    fk.interface_problem.cache_clear()
    assert fk.interface_problem(KERNEL["torch"]) is None
    real = inspect.signature(varlen.varlen_attn).parameters
    read = fk.parameters_from_source(Path(varlen.__file__).read_text(), "varlen_attn")
    assert [(p.name, p.kind) for p in read] == [(p.name, p.kind) for p in real.values()]

    old = tmp_path / "varlen.py"  # a torch without paging
    old.write_text("def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *,\n"
                   "                scale=None, window_size=(-1, -1), enable_gqa=False):\n    pass\n")
    real_find = fk.importlib.util.find_spec
    monkeypatch.setattr(fk.importlib.util, "find_spec", lambda name, *a: importlib.machinery.ModuleSpec(
        name, None, origin=str(old)) if name == "torch.nn.attention.varlen" else real_find(name, *a))
    fk.interface_problem.cache_clear()
    assert fk.interface_problem(KERNEL["torch"]) == \
        "torch.nn.attention.varlen.varlen_attn has no block_table, seqused_k"
    fk.interface_problem.cache_clear()


# -- the extras ------------------------------------------------------------------------


def test_extras_are_requirements_pip_resolves():
    tomllib = pytest.importorskip("tomllib")
    from packaging.requirements import Requirement

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    reqs = {name: [Requirement(r) for r in rs] for name, rs in extras.items()}  # raises on a malformed one
    fa4 = [r for rs in reqs.values() for r in rs if r.name == "flash-attn-4"]
    assert fa4, "no extra installs flash-attn-4"
    for r in fa4:
        # PyPI has only 4.0.0b* pre-releases (and a yanked 0.0.1): pip takes them only when
        # the specifier names one.
        assert r.specifier.prereleases, f"{r} names no pre-release, so pip finds nothing to install"
        assert r.specifier.contains("4.0.0b36") and not r.specifier.contains("0.0.1")
    assert [str(r) for r in reqs["flash-attn-4"]] == [fk.FA4_REQUIREMENT]
    assert [str(r) for r in reqs["flash-attn"]] == [fk.FA2_REQUIREMENT]
    assert KERNEL["fa4"].install == f"pip install '{fk.FA4_REQUIREMENT}'"
    assert f"'{fk.FA2_REQUIREMENT}'" in KERNEL["fa2"].install


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
