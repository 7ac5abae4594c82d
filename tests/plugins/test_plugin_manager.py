"""Plugin discovery, the allow-list, failures and duplicates."""

import json
import os
import subprocess
import sys
from importlib.metadata import EntryPoint

import pytest
import torch

from tandem.plugins import PluginError, PluginManager
from tandem.registry import AttentionBackendRegistry, ModelRegistry
from tandem.plugins import default_backend_registry, default_model_registry, plugin_manager, reset_registries

G = "tandem.plugins"


def ep(name: str, value: str) -> EntryPoint:
    return EntryPoint(name=name, value=value, group=G)


def run(eps, allow=None):
    manager = PluginManager(allow=allow, entry_point_list=eps)
    manager.load()
    models, backends = ModelRegistry(), AttentionBackendRegistry()
    manager.register_all(models, backends)
    return manager, models, backends


@pytest.fixture(autouse=True)
def _fresh_registries():
    reset_registries()
    yield
    reset_registries()


def test_builtins_come_through_the_entry_point_group():
    infos = plugin_manager().plugins
    assert infos["tandem-models"].models == ["BartForConditionalGeneration", "BartModel", "M2M100ForConditionalGeneration",
                                             "MBartForConditionalGeneration", "MT5ForConditionalGeneration",
                                             "PegasusForConditionalGeneration", "T5ForConditionalGeneration",
                                             "WhisperForConditionalGeneration"]
    assert infos["tandem-torch-sdpa"].backends == ["torch_sdpa"]
    assert infos["tandem-models"].distribution == "tandem-engine"
    # What they registered is what the engine resolves with.
    cls, arch = default_model_registry().resolve(["BartForConditionalGeneration"])
    assert cls.__name__ == "BartForConditionalGeneration"
    assert default_backend_registry().owner("torch_sdpa") == "tandem-torch-sdpa"


def test_each_plugin_records_what_it_registered():
    manager, models, backends = run(
        [ep("a", "fake_plugins:fancy"), ep("b", "fake_plugins:backend")]
    )
    assert manager.plugins["a"].models == ["FancyModel"] and manager.plugins["a"].backends == []
    assert manager.plugins["b"].backends == ["my_backend"]
    assert models.load("FancyModel").__name__ == "BartForConditionalGeneration"


def test_allow_list_restricts_what_loads(monkeypatch):
    manager, models, backends = run(
        [ep("a", "fake_plugins:fancy"), ep("b", "fake_plugins:backend"), ep("broken", "broken_plugin")],
        allow={"b"},
    )
    assert list(manager.plugins) == ["b"]  # the broken one is never imported
    assert models.names() == [] and backends.names() == ["my_backend"]

    monkeypatch.setenv("TANDEM_PLUGINS", "tandem-torch-sdpa")
    assert list(plugin_manager().plugins) == ["tandem-torch-sdpa"]
    with pytest.raises(ValueError, match="no model is registered.*TANDEM_PLUGINS"):
        default_model_registry().resolve(["BartForConditionalGeneration"])


def test_allow_list_naming_an_unknown_plugin_is_an_error():
    with pytest.raises(PluginError, match=r"unknown plugins \['nope'\]; installed: \['a'\]"):
        run([ep("a", "fake_plugins:fancy")], allow={"a", "nope"})


def test_plugin_that_fails_to_import_is_named_with_its_error():
    with pytest.raises(PluginError, match=r"plugin 'broken' \(broken_plugin\) failed to import: "
                       r"ModuleNotFoundError: No module named 'not_a_real_module_anywhere'; "
                       r"to run without it, set TANDEM_PLUGINS=a,c \(the plugins that load\)") as info:
        run([ep("a", "fake_plugins:fancy"), ep("broken", "broken_plugin"), ep("c", "fake_plugins:backend")])
    assert isinstance(info.value.__cause__, ModuleNotFoundError)


def test_plugin_whose_hook_raises_is_named_with_its_error():
    with pytest.raises(PluginError, match=r"plugin 'bad' \(fake_plugins:raising\) failed in tandem_register_models: KeyError: .*hidden"):
        run([ep("bad", "fake_plugins:raising")])


def test_duplicate_registration_names_both_plugins():
    with pytest.raises(PluginError, match=r"'FancyModel' is registered twice: by plugin 'first' .* by plugin 'second'"):
        run([ep("first", "fake_plugins:fancy"), ep("second", "fake_plugins:fancy_again")])
    manager, models, _ = run([ep("first", "fake_plugins:fancy"), ep("second", "fake_plugins:fancy_override")])
    assert models.owner("FancyModel") == "second"
    assert manager.plugins["second"].models == ["FancyModel"] and manager.plugins["first"].models == []


def test_registry_errors_list_what_exists():
    models = ModelRegistry()
    models.register_model("X", "pkg.mod:X")
    with pytest.raises(ValueError, match=r"not 'package.module:Class'"):
        models.register_model("Y", "pkg.mod.Y")
    with pytest.raises(KeyError, match=r"unknown model architecture 'Z'; registered: X"):
        models.load("Z")
    with pytest.raises(ValueError, match=r"\['Z'\] are not supported; supported: X"):
        models.resolve(["Z"])


def test_cli_lists_plugins():
    out = subprocess.run(
        [sys.executable, "-m", "tandem.entrypoints.cli", "plugins"], capture_output=True, text=True, check=True
    ).stdout
    assert "tandem-models  (tandem.model_zoo.plugin, from tandem-engine)" in out
    assert "BartForConditionalGeneration" in out
    assert "tandem-torch-sdpa" in out and "torch_sdpa" in out and "BROKEN" not in out
    # Each backend's capabilities, and whether it can serve here.
    sdpa = out[out.index("      torch_sdpa:"):]
    assert "        devices:      cpu, cuda\n        dtypes:       float32, float16, bfloat16\n" in sdpa
    assert "        attention:    decoder, encoder, encoder_decoder\n" in sdpa
    assert "        here:         can serve" in sdpa and "(auto priority 10)" in sdpa
    triton = out[out.index("      triton:"):]
    assert "        requires:     triton\n" in triton


def test_cli_plugins_json_carries_capabilities():
    out = subprocess.run(
        [sys.executable, "-m", "tandem.entrypoints.cli", "plugins", "--json"],
        capture_output=True, text=True, check=True, env={**os.environ, "TRITON_INTERPRET": "0"},
    ).stdout
    records = {r["name"]: r for r in json.loads(out)}
    caps = records["tandem-triton"]["backend_capabilities"]["triton"]
    assert caps["block sizes"].startswith("any >= 1")
    if not torch.cuda.is_available():
        assert caps["here"].startswith("cannot serve cpu/") and "TRITON_INTERPRET=1" in caps["here"]


def test_override_wins_whichever_plugin_runs_first():
    # "a-override" sorts before "z-plain": the override runs first and must still win.
    eps = [ep("a-override", "fake_plugins:fancy_override"), ep("z-plain", "fake_plugins:fancy")]
    manager, models, _ = run(eps)
    assert models.owner("FancyModel") == "a-override"
    assert manager.plugins["a-override"].models == ["FancyModel"]


def test_misspelled_hook_is_an_error_naming_the_plugin():
    with pytest.raises(PluginError, match=r"plugin 'typo' \(fake_plugins:misspelled\) is invalid:.*tandem_register_model"):
        run([ep("typo", "fake_plugins:misspelled")])


def test_lazy_target_that_cannot_import_names_its_plugin():
    _, models, _ = run([ep("ghost", "fake_plugins:missing_target")])
    with pytest.raises(ImportError, match=r"'GhostModel' \(registered by plugin 'ghost'\): cannot import"):
        models.resolve(["GhostModel"])
