"""The declarative capability check (``BackendCapabilities`` read by the default
``AttentionBackend.unsupported_reasons``) and the common metadata fields every
backend's metadata carries."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from layouts import random_layout, step_inputs
from tandem import AttentionBackend, AttentionMetadata, AttentionType, BackendCapabilities, SizeRule
from tandem.backends.torch_sdpa import TorchSDPABackend
from tandem.core.attention import KVCacheSpec
from tandem.plugins import default_backend_registry
from tandem.registry import AttentionBackendRegistry, BackendUnavailableError

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
ALL = frozenset(AttentionType)
F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32


class Narrow(TorchSDPABackend):
    """Declares narrow capabilities and nothing else: the default check decides."""

    name = "narrow"
    capabilities = BackendCapabilities(
        devices=("cuda",),
        dtypes=(F16, BF16),
        attn_types=frozenset({AttentionType.DECODER, AttentionType.ENCODER}),
        block_sizes=SizeRule(multiple_of=16, max=128),
        head_sizes=(64, 128),
        kv_cache_dtypes=(F16, BF16, torch.float8_e4m3fn),
        attn_features=frozenset({"relative_position_bias"}),
    )


class WithExtra(Narrow):
    name = "with_extra"

    @classmethod
    def extra_unsupported_reasons(cls, device, dtype, head_size, attn_types, block_size, kv_cache_dtype):
        return ["the kernels' library is not installed"] if head_size == 128 else []


class OwnCheck(TorchSDPABackend):
    """A backend written before the declarative check: it overrides the check itself."""

    name = "own_check"

    @classmethod
    def unsupported_reasons(cls, device, dtype, head_size, attn_types, block_size, kv_cache_dtype):
        return [f"head size {head_size} is not 80"] if head_size != 80 else []


class Undeclared(AttentionBackend):
    name = "undeclared"


def test_a_configuration_inside_every_declared_set_passes():
    for head, block, kv in [(64, 16, F16), (128, 128, torch.float8_e4m3fn), (64, 48, BF16)]:
        assert Narrow.unsupported_reasons(CUDA, BF16, head, frozenset({AttentionType.DECODER}), block, kv) == []


def test_each_value_outside_is_one_reason_naming_it_and_what_is_supported():
    reasons = Narrow.unsupported_reasons(CPU, F32, 80, ALL, 24, torch.float64)
    assert reasons == [
        "device 'cpu' is not cuda",
        "dtype torch.float32 is not float16 or bfloat16",
        "KV-cache dtype torch.float64 is not float16, bfloat16 or float8_e4m3fn",
        "head size 80 is not one of 64, 128",
        "block_size 24 is not a multiple of 16 in 16..128",
        "attention kind encoder_decoder is not served (it serves decoder, encoder)",
    ]
    assert Narrow.unsupported_reasons(CUDA, F16, 64, ALL - {AttentionType.ENCODER_DECODER}, 256, F16) == [
        "block_size 256 is not a multiple of 16 in 16..128"
    ]


def test_the_kv_dtype_defaults_to_the_model_dtype():
    check = TorchSDPABackend.unsupported_reasons
    assert check(CPU, F32, 64, ALL, 16, BF16) == ["KV-cache dtype torch.bfloat16 differs from the model dtype torch.float32"]
    assert check(CPU, F32, 64, ALL, 16, torch.int8) == ["KV-cache dtype torch.int8 is not float32, float16 or bfloat16"]
    # An unsupported model dtype is one reason, not repeated for the KV cache that follows it.
    assert check(CPU, torch.float64, 64, ALL, 16, torch.float64) == [
        "dtype torch.float64 is not float32, float16 or bfloat16"
    ]
    assert check(torch.device("mps"), F32, 64, ALL, 0, F32) == [
        "device 'mps' is not cpu or cuda", "block_size 0 is not >= 1"
    ]


def test_attention_features_are_checked_against_the_declared_ones():
    caps = Narrow.capabilities
    assert caps.unsupported_reasons(CUDA, F16, 64, ALL - {AttentionType.ENCODER_DECODER}, 16, F16,
                                    frozenset({"relative_position_bias"})) == []
    assert TorchSDPABackend.capabilities.attn_features == frozenset(
        {"relative_position_bias", "cross_kv_compress", "cross_kv_compress_per_head"})
    # cpu_paged declares it too (the conformance bias cases skip a backend that does not)
    assert default_backend_registry().load("cpu_paged").feature_reasons(frozenset({"relative_position_bias"})) == []
    plain = dataclasses.replace(TorchSDPABackend.capabilities, attn_features=frozenset())
    assert plain.unsupported_reasons(CPU, F32, 64, ALL, 16, F32, frozenset({"relative_position_bias", "alibi"})) == [
        "attention features alibi, relative_position_bias are not served (it serves none)"
    ]


def test_extra_reasons_are_added_to_the_declared_ones():
    assert WithExtra.unsupported_reasons(CUDA, F16, 128, frozenset({AttentionType.DECODER}), 16, F16) == [
        "the kernels' library is not installed"
    ]
    assert WithExtra.unsupported_reasons(CPU, F16, 128, frozenset({AttentionType.DECODER}), 16, F16) == [
        "device 'cpu' is not cuda", "the kernels' library is not installed"
    ]


def test_selection_reports_declared_reasons_and_still_honours_an_overriding_check():
    reg = AttentionBackendRegistry()
    for cls in (Narrow, OwnCheck, Undeclared):
        reg.register_backend(cls.name, cls)
    serve = dict(device=CPU, dtype=F32, head_size=64, attn_types=ALL, block_size=16)
    with pytest.raises(BackendUnavailableError, match=r"attention_backend='narrow' cannot serve this model: "
                       r"device 'cpu' is not cuda; dtype torch.float32 is not float16 or bfloat16"):
        reg.select("narrow", **serve)
    with pytest.raises(BackendUnavailableError, match=r"'own_check' cannot serve this model: head size 64 is not 80$"):
        reg.select("own_check", **serve)
    assert reg.select("own_check", **dict(serve, head_size=80)).backend is OwnCheck
    with pytest.raises(BackendUnavailableError, match=r"'undeclared' cannot serve this model: Undeclared declares "
                       r"no capabilities"):
        reg.select("undeclared", **serve)


class Fast(TorchSDPABackend):
    """Ranks above torch_sdpa and declares no attention feature."""

    name = "fast"
    priority = 50
    capabilities = dataclasses.replace(TorchSDPABackend.capabilities, attn_features=frozenset())


def test_a_model_needing_a_feature_passes_over_backends_without_it_and_refuses_them_by_name():
    reg = AttentionBackendRegistry()
    for cls in (Fast, TorchSDPABackend, OwnCheck):
        reg.register_backend(cls.name, cls)
    serve = dict(device=CPU, dtype=F32, head_size=64, attn_types=ALL, block_size=16)
    assert reg.select(None, **serve).backend is Fast  # no feature asked for: the fastest
    bias = dict(serve, attn_features=frozenset({"relative_position_bias"}))
    sel = reg.select(None, **bias)
    assert sel.backend is TorchSDPABackend
    assert ("passed over: fast (priority 50): attention feature relative_position_bias is not served "
            "(it serves none)") in sel.reason
    with pytest.raises(BackendUnavailableError, match=r"^attention_backend='fast' cannot serve this model: "
                       r"attention feature relative_position_bias is not served \(it serves none\)$"):
        reg.select("fast", **bias)
    # A backend that overrides unsupported_reasons (the old signature) is asked about features apart.
    assert reg.select("own_check", **dict(bias, head_size=80)).backend is OwnCheck
    assert Fast.feature_reasons(frozenset()) == [] and Undeclared.feature_reasons(frozenset({"x"})) == [
        "attention feature x is not served (it serves none)"]


def test_size_rules_state_what_they_allow():
    rule = SizeRule(multiple_of=8, max=256)
    assert [n for n in range(0, 300) if n in rule] == list(range(8, 257, 8))
    assert (rule.rule(), rule.describe()) == ("a multiple of 8 in 8..256", "multiples of 8 up to 256")
    assert (SizeRule(max=256).rule(), SizeRule(max=256).describe()) == ("in 1..256", "any up to 256")
    noted = SizeRule(note="gathered per step")
    assert (0 in noted, 1 in noted, noted.describe()) == (False, True, "any >= 1 (gathered per step)")
    assert BackendCapabilities(devices=("cpu",), dtypes=(F32,), head_sizes=[128, 64]).head_sizes == SizeRule(
        values=frozenset({64, 128}))
    # A string is a description (how capabilities were written before the check read them): never checked.
    described = BackendCapabilities(devices=("cpu",), dtypes=(F32,), head_sizes="whatever the kernel takes")
    assert described.unsupported_reasons(CPU, F32, 3, ALL, 16, F32) == []
    assert described.describe()["head sizes"] == "whatever the kernel takes"


@pytest.mark.parametrize("name", default_backend_registry().names())
def test_each_backends_metadata_carries_the_common_fields_as_built_and_adds_only_its_own(name):
    backend = default_backend_registry().load(name)
    cls = backend.get_metadata_builder_cls()
    try:
        builder = cls(4, CPU, KVCacheSpec(1, 2, 8))
    except RuntimeError as e:  # flash_attn without a kernel: the builder refuses to exist
        pytest.skip(str(e))
    seqs, _ = random_layout(random.Random(0), 4)
    inputs = step_inputs(seqs, 4)
    if name == "xformers":
        pytest.importorskip("xformers")
    md = builder.build(inputs)
    base = {f.name for f in dataclasses.fields(AttentionMetadata)}
    for klass in type(md).__mro__:
        if klass is AttentionMetadata:
            break
        redeclared = base & set(vars(klass).get("__annotations__", {}))
        assert not redeclared, f"{klass.__qualname__} redeclares {sorted(redeclared)}"
    for field in base - {"num_decoder_tokens", "num_encoder_tokens"}:
        value = getattr(inputs, field)
        if isinstance(value, int):
            assert getattr(md, field) == value, field
        else:  # the runner's tensors and lists themselves, not copies
            assert getattr(md, field) is value, field
    assert md.num_decoder_tokens == sum(s.q_len for s in seqs) == inputs.input_ids.shape[0]
    assert md.num_encoder_tokens == inputs.encoder_positions.shape[0]
    assert md.max_query_len == max(s.q_len for s in seqs)
    assert md.max_seq_len == max(s.ctx + s.q_len for s in seqs)
    assert md.max_cross_seq_len == max(s.enc_len for s in seqs)
    assert md.max_encoder_seq_len == max([s.enc_len for s in seqs if s.run_encoder], default=0)
