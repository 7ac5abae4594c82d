"""The xformers backend. xFormers has no CPU kernels, so on CPU its plumbing runs
with the kernel replaced by a float64 reference of the same contract, built on
the mask xFormers itself would apply (``attn_bias.materialize()``): every gather,
bias and GQA reshape the backend builds is checked against the conformance
layouts. The arguments tandem passes go through xFormers' own input validation
and its GPU operators' ``not_supported_reasons`` (on fake CUDA tensors); a broken
install (X1: a flash_attn package xFormers refuses) is simulated against
xFormers' own import check. The kernels run under ``-m gpu``."""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import os
import random
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from unittest import mock

import pytest
import torch

from layouts import MIXES, NUM_HEADS, check_backend, random_layout, step_inputs
from helpers import SUBPROCESS_TIMEOUT
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


# -- tandem's calls against xFormers' own input checks ------------------------------

CUDA = torch.device("cuda")
NO_OPERATOR = "No operator found for `memory_efficient_attention_forward`"
# What xFormers' operators say about this machine rather than about the inputs: its
# C++/CUDA extension is not built for this torch, and a CPU torch has no flash kernels.
MACHINE_REASONS = {"xFormers wasn't build with CUDA support",
                   "operator wasn't built - see `python -m xformers.info` for more info"}


def captured_calls(monkeypatch, num_kv_heads, head_size, mix):
    """tandem's kernel calls over a conformance layout, each put through xFormers' own
    front door on the way: ``Inputs.validate_inputs`` must accept it, and the real
    ``memory_efficient_attention`` must then fail only for want of a CPU operator
    (an input error is a ValueError raised before dispatch)."""
    import xformers.ops
    from xformers.ops.fmha.common import Inputs

    calls = []

    def validated(query, key, value, attn_bias, scale):
        Inputs(query=query, key=key, value=value, attn_bias=attn_bias, scale=scale).validate_inputs()
        with pytest.raises(NotImplementedError) as no_op:
            xformers.ops.memory_efficient_attention(query, key, value, attn_bias=attn_bias, scale=scale)
        assert str(no_op.value).startswith(NO_OPERATOR)
        calls.append((query, key, value, attn_bias, scale))
        return reference_fmha(query, key, value, attn_bias, scale)

    monkeypatch.setattr(xf, "_fmha", validated)
    check_backend(XFormersBackend, 0, 4, num_kv_heads, head_size, mix)
    return calls


def on_fake_cuda(call, dtype):
    """The same call's ``Inputs`` on fake CUDA tensors (same shapes and strides, the
    stride-0 KV broadcast included) in ``dtype``; the caller holds a FakeTensorMode."""
    from xformers.ops.fmha.common import Inputs

    query, key, value, bias, scale = call

    def fake(x, dt):
        return torch.empty_strided(x.shape, x.stride(), dtype=dt, device=CUDA)

    def seqinfo(info):
        return dataclasses.replace(info, seqstart=fake(info.seqstart, info.seqstart.dtype))

    bias = dataclasses.replace(bias, q_seqinfo=seqinfo(bias.q_seqinfo), k_seqinfo=seqinfo(bias.k_seqinfo))
    return Inputs(query=fake(query, dtype), key=fake(key, dtype), value=fake(value, dtype), attn_bias=bias,
                  scale=scale)


def input_reasons(op, inputs, capability):
    """``op.not_supported_reasons`` on a GPU of ``capability``, less the machine's own."""
    with mock.patch.object(torch.cuda, "get_device_capability", lambda *a, **kw: capability):
        return [r for r in op.not_supported_reasons(inputs) if r not in MACHINE_REASONS]


@pytest.mark.parametrize("heads", [(4, 8), (2, 8), (1, 64)], ids=["mha", "gqa", "mqa-d64"])
@pytest.mark.parametrize("mix", list(MIXES))
def test_every_call_passes_xformers_input_validation(heads, mix, monkeypatch):
    calls = captured_calls(monkeypatch, heads[0], heads[1], mix)
    kinds = {type(c[3]).__name__ for c in calls}
    assert {"BlockDiagonalCausalFromBottomRightMask", "BlockDiagonalMask"} <= kinds
    assert all(c[0].dim() == 5 and c[0].shape[0] == 1 for c in calls)
    if heads[0] < NUM_HEADS:  # GQA / MQA: the KV heads really are broadcast, not copied
        assert all(c[1].stride(3) == 0 and c[2].stride(3) == 0 for c in calls)


def test_validation_has_teeth_keys_not_broadcast_are_refused(monkeypatch):
    """The check above can fail: keys handed over un-broadcast ([1, N, G, 1, D]) are an
    input error in xFormers, not an operator-availability one."""
    from xformers.ops.fmha.common import Inputs

    query, key, value, bias, scale = captured_calls(monkeypatch, 2, 8, "mixed")[0]
    with pytest.raises(ValueError, match="Incompatible shapes"):
        Inputs(query=query, key=key[:, :, :, :1], value=value[:, :, :, :1], attn_bias=bias,
               scale=scale).validate_inputs()


@pytest.mark.parametrize("heads", [(4, 8), (2, 64), (1, 72), (2, 80), (1, 128), (4, 256)],
                         ids=["mha-d8", "gqa-d64", "mqa-d72", "gqa-d80", "mqa-d128", "mha-d256"])
@pytest.mark.parametrize("mix", list(MIXES))
def test_xformers_gpu_operators_take_tandems_inputs(heads, mix, monkeypatch):
    """flash.FwOp (xFormers' first choice for 16-bit on CUDA) and cutlass.FwOp (its
    fallback, and float32's only operator) judge tandem's inputs, shapes, strides and
    masks as tandem builds them, on fake CUDA tensors of an sm80 and an sm90 GPU:
    nothing about the inputs is refused."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from xformers.ops.fmha import cutlass, flash

    calls = captured_calls(monkeypatch, heads[0], heads[1], mix)
    with FakeTensorMode():
        for call in calls:
            for dtype in (torch.float16, torch.bfloat16, torch.float32):
                inputs = on_fake_cuda(call, dtype)
                for cap in ((8, 0), (9, 0)):
                    assert input_reasons(cutlass.FwOp, inputs, cap) == []
                    flash_says = input_reasons(flash.FwOp, inputs, cap)
                    if dtype is torch.float32:  # the checks run: flash refuses float32, and only that
                        # (the set's printed order varies between runs)
                        assert len(flash_says) == 1 and flash_says[0] in (
                            f"dtype=torch.float32 (supported: {{{a}, {b}}})"
                            for a, b in itertools.permutations(("torch.bfloat16", "torch.float16")))
                    else:
                        assert flash_says == []


def test_the_head_size_rule_admits_only_sizes_an_operator_takes():
    """Every head size tandem's capability check accepts, in every dtype, is taken by
    flash or CUTLASS on sm80 and sm90; up to 256 (flash's limit) tandem's multiple-of-8
    rule is exactly theirs for 16-bit. Beyond it tandem refuses what CUTLASS would take,
    and CUTLASS takes more float32 sizes than tandem offers: stricter, never looser."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from xformers.ops.fmha import attn_bias, cutlass, flash

    impl = xf.XFormersImpl(8, 64, 1.0, 2)  # 8 query heads over 2 KV heads: the GQA form
    bias = attn_bias.BlockDiagonalCausalFromBottomRightMask.from_seqlens([1, 3], [5, 3])
    for head_size in range(4, 272, 4):
        serves = XFormersBackend.capabilities.unsupported_reasons(CUDA, torch.float16, head_size, ALL_KINDS, 16,
                                                                  torch.float16) == []
        q, kv = impl._grouped(torch.zeros(4, 8, head_size), 8), impl._grouped(torch.zeros(8, 2, head_size), 2)
        with FakeTensorMode():
            for dtype in (torch.float16, torch.bfloat16, torch.float32):
                inputs = on_fake_cuda((q, kv, kv, bias, 1.0), dtype)
                for cap in ((8, 0), (9, 0)):
                    taken = [op for op in (flash.FwOp, cutlass.FwOp) if not input_reasons(op, inputs, cap)]
                    assert taken or not serves, (head_size, dtype, cap)
                    if dtype is not torch.float32 and head_size <= xf.MAX_HEAD_SIZE:
                        assert bool(taken) == serves, (head_size, dtype, cap)


# -- X1: an install xFormers cannot import -------------------------------------------


def install_fake_flash_attn(root: Path, fa2: str | None, fa4: str | None) -> None:
    """What pip leaves in site-packages, less the CUDA extension: flash-attn 2 is
    ``flash_attn/__init__.py`` (its ``__version__``) and ``flash_attn_interface.py``;
    flash-attn-4 only ``flash_attn/cute`` (no ``flash_attn/__init__.py``); each with
    its dist-info."""
    pkg = root / "flash_attn"
    pkg.mkdir(parents=True, exist_ok=True)
    for dist, version in (("flash_attn", fa2), ("flash_attn_4", fa4)):
        if version:
            info = root / f"{dist}-{version}.dist-info"
            info.mkdir()
            info.joinpath("METADATA").write_text(
                f"Metadata-Version: 2.1\nName: {dist.replace('_', '-')}\nVersion: {version}\n")
    if fa2:
        (pkg / "__init__.py").write_text(f'__version__ = "{fa2}"\n')
        (pkg / "flash_attn_interface.py").write_text("flash_attn_cuda = None  # the CUDA extension, absent\n")
    if fa4:
        (pkg / "cute").mkdir()
        (pkg / "cute" / "__init__.py").write_text("")


def _forget_flash_attn():
    for name in [m for m in sys.modules if m == "flash_attn" or m.startswith("flash_attn.")]:
        del sys.modules[name]


@pytest.fixture
def flash_attn_install(tmp_path, monkeypatch):
    """Puts a fake flash-attn 2 and/or flash-attn-4 on ``sys.path``; the per-process
    import result is forgotten before and after."""
    assert "flash_attn" not in sys.modules  # a real one would be shadowed, not removed

    def install(fa2=None, fa4=None):
        install_fake_flash_attn(tmp_path, fa2, fa4)
        monkeypatch.syspath_prepend(str(tmp_path))

    xf._import_ops.cache_clear()
    yield install
    _forget_flash_attn()
    xf._import_ops.cache_clear()


def xformers_flash_check() -> dict:
    """xFormers' own flash-attn check: the top of ``xformers/ops/fmha/flash.py`` up to
    where it registers its operators (which cannot happen twice in a process), run as
    that module. Returns its namespace, or raises what ``import xformers.ops`` would."""
    import xformers.ops.fmha.flash as real

    source = Path(real.__file__).read_text()
    ns = {"__name__": real.__name__, "__package__": real.__package__, "__file__": real.__file__}
    try:
        exec(compile(source[: source.index('\nif FLASH_VERSION != "0.0.0":')], real.__file__, "exec"), ns)
    finally:
        _forget_flash_attn()
    return ns


@pytest.mark.parametrize("fa2,fa4", [
    (None, None), ("2.6.3", None), ("2.7.0", None), ("2.7.1", None), ("2.8.3", None), ("2.8.4", None),
    ("2.8.5", None), ("2.9.0", None), (None, "4.0.0b36"), ("2.8.3", "4.0.0b36"), ("2.6.3", "4.0.0b36"),
])
def test_the_prediction_agrees_with_xformers_own_check(fa2, fa4, flash_attn_install):
    flash_attn_install(fa2, fa4)
    predicted = xf.predicted_import_error()
    try:
        ns = xformers_flash_check()
    except ImportError as refused:
        assert predicted is not None and predicted.startswith("import xformers.ops fails")
        assert f"installed: flash-attn {fa2 or '(none)'}, flash-attn-4 {fa4 or '(none)'}" in predicted
        if fa2:  # the range xFormers names is the one tandem quotes
            lo, hi = re.search(r">=(\S+),<=(\S+) ", str(refused)).groups()
            assert f"flash_attn {fa2} is installed and xFormers requires {lo} to {hi}" in predicted
        else:
            assert "flash_attn_interface" in str(refused) and "without flash_attn_interface" in predicted
    else:
        assert predicted is None
        if fa2:
            assert xf.flash_attn_range() == (str(ns["FLASH_VER_MIN"]), str(ns["FLASH_VER_LAST"]))


@pytest.mark.parametrize("fa2,fa4,cause", [
    ("2.6.3", None, "flash_attn 2.6.3 is installed and xFormers requires 2.7.1 to 2.8.4"),
    (None, "4.0.0b36", "a flash_attn package without flash_attn_interface (flash-attn-4 without flash-attn 2?)"),
], ids=["flash-attn-2.6.3", "flash-attn-4-only"])
def test_an_install_xformers_cannot_import_is_refused_at_selection(fa2, fa4, cause, flash_attn_install):
    flash_attn_install(fa2, fa4)
    reasons = XFormersBackend.unsupported_reasons(CUDA, torch.float16, 64, ALL_KINDS, 16, torch.float16)
    assert len(reasons) == 1 and cause in reasons[0]
    assert f"installed: flash-attn {fa2 or '(none)'}, flash-attn-4 {fa4 or '(none)'}" in reasons[0]
    with pytest.raises(BackendUnavailableError, match=r"attention_backend='xformers' cannot serve this model: "
                                                      r"import xformers.ops fails: " + re.escape(cause)):
        default_backend_registry().select("xformers", device=CUDA, dtype=torch.float16, head_size=64,
                                          attn_types=ALL_KINDS, block_size=16)
    # A builder made anyway (past the selection) fails on construction, not in build().
    with pytest.raises(ImportError, match="the xformers attention backend cannot run: .*" + re.escape(cause)):
        xf.XFormersMetadataBuilder(16, CUDA, KVCacheSpec(1, 2, 64))
    # The other reasons still come with it where a declared one stands first.
    assert XFormersBackend.unsupported_reasons(CPU, torch.float16, 64, ALL_KINDS, 16, torch.float16) == [
        "device 'cpu' is not cuda", reasons[0]]


@pytest.fixture
def fresh_import():
    xf._import_ops.cache_clear()
    yield
    xf._import_ops.cache_clear()


def test_an_import_failing_for_any_other_cause_is_quoted(monkeypatch, fresh_import):
    """Causes the prediction cannot see (a CUDA extension built for another torch, a
    torch whose flash schema xFormers rejects) surface from the import itself."""
    monkeypatch.setitem(sys.modules, "xformers.ops", None)  # `import xformers.ops` now raises ImportError
    # On CPU the declared reason stands and nothing is imported.
    assert XFormersBackend.unsupported_reasons(CPU, torch.float16, 64, ALL_KINDS, 16, torch.float16) == [
        "device 'cpu' is not cuda"]
    assert xf._import_ops.cache_info().currsize == 0
    # Nor when asked about a GPU this machine does not have.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert XFormersBackend.unsupported_reasons(CUDA, torch.float16, 64, ALL_KINDS, 16, torch.float16) == []
    assert xf._import_ops.cache_info().currsize == 0
    monkeypatch.setattr(xf, "_device_present", lambda device: True)  # as on a GPU machine
    reasons = XFormersBackend.unsupported_reasons(CUDA, torch.float16, 64, ALL_KINDS, 16, torch.float16)
    assert len(reasons) == 1
    assert reasons[0].startswith("import xformers.ops fails (ModuleNotFoundError: import of xformers.ops halted; "
                                 "None in sys.modules); installed: flash-attn (none), flash-attn-4 (none); xformers ")
    with pytest.raises(BackendUnavailableError, match=re.escape(reasons[0])):
        default_backend_registry().select("xformers", device=CUDA, dtype=torch.float16, head_size=64,
                                          attn_types=ALL_KINDS, block_size=16)
    with pytest.raises(ImportError, match=re.escape(reasons[0])):
        xf.XFormersMetadataBuilder(16, CUDA, KVCacheSpec(1, 2, 64))
    assert xf._import_ops.cache_info().misses == 1  # imported once per process, the failure kept


def test_x1_in_a_fresh_interpreter(tmp_path):
    """The review's X1 end to end: with flash-attn 2.6.3 installed (tandem's own
    flash-attn extra allows it), ``import xformers.ops`` itself raises, and tandem's
    selection by name names that cause."""
    install_fake_flash_attn(tmp_path, "2.6.3", None)
    script = textwrap.dedent("""
        import torch
        from tandem.core.attention import AttentionType
        from tandem.plugins import default_backend_registry
        try:
            import xformers.ops
        except ImportError as e:
            print("xformers:", e)
        try:
            default_backend_registry().select("xformers", device=torch.device("cuda"), dtype=torch.float16,
                                              head_size=64, attn_types=frozenset(AttentionType), block_size=16)
        except Exception as e:
            print("tandem:", type(e).__name__, e)
    """)
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}:{root}"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT)
    lines = dict(line.split(": ", 1) for line in out.stdout.splitlines() if line.startswith(("xformers:", "tandem:")))
    assert lines.get("xformers") == "Requires Flash-Attention version >=2.7.1,<=2.8.4 but got 2.6.3.", out
    assert lines.get("tandem", "").startswith(
        "BackendUnavailableError attention_backend='xformers' cannot serve this model: import xformers.ops fails: "
        "flash_attn 2.6.3 is installed and xFormers requires 2.7.1 to 2.8.4"), out


def test_float32_on_a_gpu_newer_than_cutlass_builds_for_is_refused_with_the_reason():
    # xFormers' CUTLASS operator (its only float32 one) declares the highest compute
    # capability it is built for; tandem reads it rather than keeping its own copy.
    from xformers.ops.fmha import cutlass

    from tandem.backends import xformers as xf

    highest = cutlass.FwOp.CUDA_MAXIMUM_COMPUTE_CAPABILITY
    assert xf.float32_operator_reasons(highest) == []
    assert xf.float32_operator_reasons(None) == []
    newer = (highest[0] + 1, 0)
    (reason,) = xf.float32_operator_reasons(newer)
    assert "torch.float32" in reason and f"{newer[0]}.0" in reason and f"{highest[0]}.{highest[1]}" in reason
