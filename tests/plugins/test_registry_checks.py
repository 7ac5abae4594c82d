"""Overrides are logged naming both sides; a backend's ``name`` must be its registered name;
selection goes by argument, then ``$TANDEM_ATTENTION_BACKEND``, then priority."""

import logging

import pytest
import torch

from tandem import AttentionType
from tandem.registry import AttentionBackendRegistry, ModelRegistry
from tandem.plugins import default_backend_registry, reset_registries
from test_plugin_manager import ep, run

BART = "tandem.model_zoo.bart:BartForConditionalGeneration"


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def registry_log():
    # A handler on the registry's own logger: caplog's sits on the root, and the CLI's logging
    # setup stops propagation at "tandem", which would hide the records from it.
    log, handler = logging.getLogger("tandem.registry"), _Collect()
    log.addHandler(handler)
    try:
        yield handler
    finally:
        log.removeHandler(handler)


def _warnings(handler) -> list[str]:
    return [r.getMessage() for r in handler.records if r.levelno == logging.WARNING]


def test_an_override_is_logged_naming_both_plugins_and_targets(registry_log):
    run([ep("first", "fake_plugins:fancy"), ep("second", "fake_plugins:fancy_override")])
    assert _warnings(registry_log) == [
        f"model architecture 'FancyModel': plugin 'second' overrides it with some_pkg.models:OtherFancy, "
        f"replacing {BART} registered by plugin 'first'"
    ]


def test_a_plain_registration_ignored_for_an_override_is_logged(registry_log):
    run([ep("a-override", "fake_plugins:fancy_override"), ep("z-plain", "fake_plugins:fancy")])
    assert _warnings(registry_log) == [
        f"model architecture 'FancyModel': plugin 'z-plain' registered {BART}, ignored: plugin 'a-override' "
        "overrides it with some_pkg.models:OtherFancy (override=True)"
    ]


def test_overriding_a_direct_registration_says_so(registry_log):
    models = ModelRegistry()
    models.register_model("X", "pkg.a:X")
    with models.owned_by("mine"):
        models.register_model("X", "pkg.b:X", override=True)
    assert _warnings(registry_log) == [
        "model architecture 'X': plugin 'mine' overrides it with pkg.b:X, replacing pkg.a:X registered by a direct call"
    ]


def test_no_warning_without_a_collision(registry_log):
    run([ep("a-override", "fake_plugins:fancy_override"), ep("b", "fake_plugins:backend")])
    assert _warnings(registry_log) == []


_SERVE_CPU = dict(
    device=torch.device("cpu"), dtype=torch.float32, head_size=8, attn_types=frozenset(AttentionType), block_size=16
)


@pytest.fixture
def no_env_choice(monkeypatch):
    # A backend named in the developer's environment would take precedence over priority.
    monkeypatch.delenv("TANDEM_ATTENTION_BACKEND", raising=False)


def test_backend_name_must_match_its_registration(no_env_choice):
    _, _, backends = run([ep("mine", "fake_plugins:misnamed_backend")])
    with pytest.raises(ValueError, match=r"attention backend 'my_backend' \(registered by plugin 'mine'\): "
                       r"fake_backends.MisnamedBackend.name is 'something_else', not 'my_backend'"):
        backends.load("my_backend")
    # Selection reports it too, asked for by name or not, rather than skipping the backend.
    for requested in ("my_backend", None):
        with pytest.raises(ValueError, match=r"MisnamedBackend.name is 'something_else'"):
            backends.select(requested, **_SERVE_CPU)


def test_a_subclass_must_set_its_own_name():
    _, _, backends = run([ep("mine", "fake_plugins:subclass_keeping_parent_name")])
    with pytest.raises(ValueError, match=r"InheritsItsName.name is 'torch_sdpa', not 'my_backend'"):
        backends.load("my_backend")


def test_a_backend_without_a_name_is_an_error():
    _, _, backends = run([ep("mine", "fake_plugins:nameless_backend")])
    with pytest.raises(ValueError,
                       match=r"'nameless' \(registered by plugin 'mine'\): .*NamelessBackend.name is not set"):
        backends.load("nameless")


def test_a_backend_must_be_an_attention_backend_subclass():
    _, _, backends = run([ep("mine", "fake_plugins:not_a_backend")])
    with pytest.raises(TypeError, match=r"attention backend 'not_a_backend' \(registered by plugin 'mine'\) "
                       r"resolves to <class 'fake_backends.NotABackend'>, not an AttentionBackend subclass"):
        backends.load("not_a_backend")
    registry = AttentionBackendRegistry()
    registry.register_backend("odd", "math:pi")
    with pytest.raises(TypeError, match=r"'odd' \(registered by a direct call\) resolves to 3.14"):
        registry.load("odd")


def test_well_named_backends_load():
    _, _, backends = run([ep("mine", "fake_plugins:backend")])
    assert backends.load("my_backend").name == "my_backend"
    reset_registries()
    try:
        assert default_backend_registry().load("torch_sdpa").name == "torch_sdpa"
    finally:
        reset_registries()


def test_a_model_must_be_an_encoder_decoder_model():
    _, models, _ = run([ep("mine", "fake_plugins:fancy")])
    models.register_model("Pi", "math:pi")
    with pytest.raises(TypeError, match=r"model architecture 'Pi' \(registered by a direct call\) resolves to 3.14"):
        models.resolve(["Pi"])


def _registry(*classes):
    reg = AttentionBackendRegistry()
    for cls in classes:
        reg.register_backend(cls.name, cls)
    return reg


def test_the_highest_priority_backend_that_can_serve_is_chosen_and_says_why(no_env_choice):
    from fake_backends import CudaOnlyFast, MyBackend, Unprioritised

    sel = _registry(Unprioritised, MyBackend, CudaOnlyFast).select(None, **_SERVE_CPU)
    assert sel.backend is MyBackend  # priority 10, over 0; the priority-100 one cannot serve cpu
    assert sel.reason.startswith("the highest priority (10) of those that can serve cpu/float32")
    assert "passed over: cuda_only_fast (priority 100): device 'cpu' is not cuda" in sel.reason
    assert _registry(Unprioritised).select(None, **_SERVE_CPU).backend is Unprioritised
    sel = _registry(CudaOnlyFast, MyBackend).select("my_backend", **_SERVE_CPU)
    assert (sel.backend, sel.reason) == (MyBackend, "asked for by attention_backend")


def test_priority_ties_break_by_name(no_env_choice):
    from fake_backends import MyBackend, TiedWithMine

    assert _registry(TiedWithMine, MyBackend).select(None, **_SERVE_CPU).backend is TiedWithMine  # "a..." < "my..."


def test_block_size_and_kv_cache_dtype_reach_the_capability_check(no_env_choice):
    from fake_backends import CudaOnlyFast

    reg = _registry(CudaOnlyFast)
    cuda = dict(_SERVE_CPU, device=torch.device("cuda"))
    assert reg.select(None, **cuda).backend is CudaOnlyFast
    with pytest.raises(ValueError, match=r"cuda_only_fast \(priority 100\): block_size 8 is not a multiple of 16"):
        reg.select(None, **dict(cuda, block_size=8))
    with pytest.raises(ValueError, match=r"attention_backend='cuda_only_fast' cannot serve this model: "
                       r"KV-cache dtype torch.float8_e4m3fn is not float16 or bfloat16"):
        reg.select("cuda_only_fast", **dict(cuda, kv_cache_dtype=torch.float8_e4m3fn))


def test_the_environment_variable_chooses_over_priority_and_is_named(monkeypatch):
    from fake_backends import CudaOnlyFast, MyBackend, Unprioritised

    reg = _registry(Unprioritised, MyBackend, CudaOnlyFast)
    monkeypatch.setenv("TANDEM_ATTENTION_BACKEND", "unprioritised")
    sel = reg.select(None, **_SERVE_CPU)
    assert (sel.backend, sel.reason) == (Unprioritised, "asked for by $TANDEM_ATTENTION_BACKEND")
    assert reg.select("my_backend", **_SERVE_CPU).backend is MyBackend  # the argument comes first
    monkeypatch.setenv("TANDEM_ATTENTION_BACKEND", "cuda_only_fast")  # no fallback to one that can serve
    with pytest.raises(ValueError, match=r"TANDEM_ATTENTION_BACKEND='cuda_only_fast' cannot serve this model: "
                       r"device 'cpu' is not cuda"):
        reg.select(None, **_SERVE_CPU)
    monkeypatch.setenv("TANDEM_ATTENTION_BACKEND", "nope")
    with pytest.raises(ValueError, match=r"TANDEM_ATTENTION_BACKEND='nope' is not a registered attention backend; "
                       r"registered: cuda_only_fast, my_backend, unprioritised"):
        reg.select(None, **_SERVE_CPU)
