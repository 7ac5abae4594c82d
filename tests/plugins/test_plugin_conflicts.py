"""A third-party plugin that registers a name tandem already has (without override=True) is the
broken one: tandem's own plugins run first and stay healthy, and the message tells the user to
pass override=True or uninstall *that* package."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tandem import hookimpl
from tandem.plugins import PluginError, plugin_report, reset_registries
from test_plugin_manager import ep, run

HERE = os.path.dirname(os.path.abspath(__file__))
BART = "tandem.model_zoo.bart:BartForConditionalGeneration"
TANDEM_MODELS = ep("tandem-models", "tandem.model_zoo.plugin")
TANDEM_SDPA = ep("tandem-torch-sdpa", "tandem.backends.plugin:torch_sdpa")


class _Registers:
    def __init__(self, models=(), backends=(), override=False) -> None:
        self.models, self.backends, self.override = models, backends, override

    @hookimpl
    def tandem_register_models(self, registry) -> None:
        for arch, target in self.models:
            registry.register_model(arch, target, override=self.override)

    @hookimpl
    def tandem_register_attention_backends(self, registry) -> None:
        for name, target in self.backends:
            registry.register_backend(name, target, override=self.override)


# Names that sort before "tandem-...": they ran first and won before the fix.
bart_again = _Registers(models=[("BartForConditionalGeneration", "evil_pkg.models:Bart")])
sdpa_again = _Registers(backends=[("torch_sdpa", "evil_pkg.backends:SDPA")])
# Registers a new name first, then collides: the new name must not stay behind.
new_then_bart = _Registers(models=[("EvilModel", "evil_pkg.models:Evil"),
                                   ("BartForConditionalGeneration", "evil_pkg.models:Bart")])
bart_override = _Registers(models=[("BartForConditionalGeneration", BART)], override=True)


@pytest.fixture(autouse=True)
def _fresh_registries():
    reset_registries()
    yield
    reset_registries()


def report(*eps):
    return {info.name: info for info in plugin_report(entry_point_list=list(eps))}


@pytest.mark.parametrize("obj, hook, kind, name, target", [
    ("bart_again", "tandem_register_models", "model architecture", "BartForConditionalGeneration",
     "evil_pkg.models:Bart"),
    ("sdpa_again", "tandem_register_attention_backends", "attention backend", "torch_sdpa",
     "evil_pkg.backends:SDPA"),
])
def test_the_plugin_that_registers_second_is_broken_and_tandems_stay_healthy(obj, hook, kind, name, target):
    infos = report(ep("aaa-evil", f"test_plugin_conflicts:{obj}"), TANDEM_MODELS, TANDEM_SDPA)
    assert infos["tandem-models"].error is None
    assert infos["tandem-models"].models == ["BartForConditionalGeneration", "BartModel", "M2M100ForConditionalGeneration",
                                             "MBartForConditionalGeneration", "MT5ForConditionalGeneration",
                                             "PegasusForConditionalGeneration", "T5ForConditionalGeneration",
                                             "WhisperForConditionalGeneration"]
    assert infos["tandem-torch-sdpa"].error is None and infos["tandem-torch-sdpa"].backends == ["torch_sdpa"]
    tandem_plugin = "tandem-models" if kind == "model architecture" else "tandem-torch-sdpa"
    tandem_target = BART if kind == "model architecture" else "tandem.backends.torch_sdpa:TorchSDPABackend"
    assert infos["aaa-evil"].error == (
        f"failed in {hook}: {kind} {name!r} is registered twice: by plugin {tandem_plugin!r} ({tandem_target}) "
        f"and by plugin 'aaa-evil' ({target}); plugin 'aaa-evil' must pass override=True to replace it, "
        "or remove it from the 'tandem.plugins' entry points"
    )
    assert infos["aaa-evil"].models == [] and infos["aaa-evil"].backends == []


def test_strict_loading_names_the_third_party_plugin_and_how_to_leave_it_out():
    with pytest.raises(PluginError) as info:
        run([ep("aaa-evil", "test_plugin_conflicts:bart_again"), TANDEM_MODELS, TANDEM_SDPA])
    message = str(info.value)
    assert message.startswith("plugin 'aaa-evil' (test_plugin_conflicts:bart_again) failed in tandem_register_models: "
                              "model architecture 'BartForConditionalGeneration' is registered twice: by plugin "
                              "'tandem-models'")
    assert "plugin 'aaa-evil' must pass override=True to replace it" in message
    assert "to run without it, set TANDEM_PLUGINS=tandem-models,tandem-torch-sdpa" in message


def test_a_failing_plugin_leaves_no_registration_behind():
    infos = report(ep("aaa-evil", "test_plugin_conflicts:new_then_bart"), TANDEM_MODELS)
    assert infos["aaa-evil"].error is not None and infos["aaa-evil"].models == []
    assert "EvilModel" not in infos["tandem-models"].models


def test_an_override_from_a_plugin_that_sorts_first_still_wins():
    manager, models, _ = run([ep("aaa-override", "test_plugin_conflicts:bart_override"), TANDEM_MODELS])
    assert models.owner("BartForConditionalGeneration") == "aaa-override"
    assert manager.plugins["tandem-models"].error is None
    assert "BartForConditionalGeneration" not in manager.plugins["tandem-models"].models


def test_between_two_third_party_plugins_the_later_in_name_order_is_blamed():
    infos = report(ep("a-first", "fake_plugins:fancy"), ep("b-second", "fake_plugins:fancy_again"))
    assert infos["a-first"].error is None and infos["a-first"].models == ["FancyModel"]
    assert "plugin 'b-second' must pass override=True" in infos["b-second"].error


# -- installed the way pip would, through `tandem plugins` ----------------------------------------

EVIL_PLUGIN = """
from tandem import hookimpl


@hookimpl
def tandem_register_models(registry):
    registry.register_model("BartForConditionalGeneration", "evil_models:Bart")
"""

EVIL_BACKEND = """
from tandem import hookimpl


@hookimpl
def tandem_register_attention_backends(registry):
    registry.register_backend("torch_sdpa", "evil_backends:SDPA")
"""


@pytest.fixture
def conflicting_install(tmp_path):
    for dist, entry, module, code in (
        ("evilmodels", "aaa-bart = evil_model_plugin", "evil_model_plugin", EVIL_PLUGIN),
        ("evilbackends", "aaa-sdpa = evil_backend_plugin", "evil_backend_plugin", EVIL_BACKEND),
    ):
        info = tmp_path / f"{dist}-0.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.0\n")
        (info / "entry_points.txt").write_text(f"[tandem.plugins]\n{entry}\n")
        (tmp_path / f"{module}.py").write_text(textwrap.dedent(code))
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), HERE])}


def _tandem(*args, env):
    return subprocess.run([sys.executable, "-m", "tandem.entrypoints.cli", *args],
                          capture_output=True, text=True, env=env)


def test_cli_blames_the_conflicting_packages_not_tandem(conflicting_install):
    res = _tandem("plugins", env=conflicting_install)
    assert res.returncode == 1, res.stderr
    out = res.stdout
    assert ("tandem-models  (tandem.model_zoo.plugin, from tandem-engine)\n"
            "    models:   BartForConditionalGeneration, BartModel, M2M100ForConditionalGeneration, "
            "MBartForConditionalGeneration, MT5ForConditionalGeneration, PegasusForConditionalGeneration, "
            "T5ForConditionalGeneration, WhisperForConditionalGeneration") in out
    assert "tandem-torch-sdpa  (tandem.backends.plugin:torch_sdpa, from tandem-engine)\n    backends: torch_sdpa" in out
    assert ("aaa-bart  (evil_model_plugin, from evilmodels)  BROKEN: failed in tandem_register_models: model "
            "architecture 'BartForConditionalGeneration' is registered twice: by plugin 'tandem-models' "
            f"({BART}) and by plugin 'aaa-bart' (evil_models:Bart); plugin 'aaa-bart' must pass "
            "override=True to replace it, or uninstall it (`pip uninstall evilmodels`)") in out
    assert ("aaa-sdpa  (evil_backend_plugin, from evilbackends)  BROKEN: failed in "
            "tandem_register_attention_backends: attention backend 'torch_sdpa' is registered twice") in out
    assert "tandem-engine" not in res.stderr and "Traceback" not in res.stderr
    assert "tandem plugins: broken: aaa-bart, aaa-sdpa; to run without them, set TANDEM_PLUGINS=" in res.stderr
    assert "`pip uninstall evilbackends evilmodels`" in res.stderr

    records = {r["name"]: r for r in json.loads(_tandem("plugins", "--json", env=conflicting_install).stdout)}
    assert all(records[n]["error"] is None for n in records if n.startswith("tandem-"))
    assert records["aaa-bart"]["error"] and records["aaa-sdpa"]["error"]


def test_engine_refuses_naming_the_conflicting_plugin(conflicting_install, bart_dir):
    res = _tandem("generate", "--model", str(bart_dir), "the rain", env=conflicting_install)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    error = res.stderr.strip().splitlines()[-1]
    assert error.startswith("tandem generate: error: plugin 'aaa-bart' (evil_model_plugin) failed in "
                            "tandem_register_models: model architecture 'BartForConditionalGeneration' is "
                            "registered twice: by plugin 'tandem-models'")
    assert "pip uninstall evilmodels" in error and "pip uninstall tandem-engine" not in error
