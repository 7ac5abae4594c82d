"""A broken plugin is reported by name, with its cause and how to run without it; ``tandem
plugins`` still lists the others."""

import json
import os
import subprocess
import sys

import pytest

import tandem.plugins.defaults
from tandem.plugins import PluginError, PluginManager
from tandem.plugins import plugin_report, reset_registries
from test_plugin_manager import ep, run

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(autouse=True)
def _fresh_registries():
    reset_registries()
    yield
    reset_registries()


def test_the_suggested_allow_list_leaves_out_every_broken_plugin():
    eps = [ep("a", "fake_plugins:fancy"), ep("b1", "broken_plugin"), ep("b2", "exiting_plugin"),
           ep("c", "fake_plugins:backend")]
    with pytest.raises(PluginError, match=r"plugin 'b1' \(broken_plugin\) failed to import: ModuleNotFoundError: "
                       r".* \(also broken: 'b2'\); to run without them, set TANDEM_PLUGINS=a,c "):
        run(eps)
    manager, models, backends = run(eps, allow={"a", "c"})  # what the message suggests works
    assert list(manager.plugins) == ["a", "c"] and models.names() == ["FancyModel"]


def test_a_lone_broken_plugin_says_the_allow_list_cannot_help():
    with pytest.raises(PluginError, match=r"no other plugin loads, so TANDEM_PLUGINS cannot leave it out"):
        run([ep("broken", "broken_plugin")])


def test_sys_exit_on_import_is_an_import_failure_and_the_process_survives():
    with pytest.raises(PluginError, match=r"plugin 'quits' \(exiting_plugin\) failed to import: SystemExit: "
                       r"exiting_plugin: refusing to load; to run without it, set TANDEM_PLUGINS=a ") as info:
        run([ep("a", "fake_plugins:fancy"), ep("quits", "exiting_plugin")])
    assert isinstance(info.value.__cause__, SystemExit)


def test_sys_exit_in_a_hook_is_a_hook_failure():
    with pytest.raises(PluginError, match=r"plugin 'quits' \(fake_plugins:exiting\) failed in "
                       r"tandem_register_attention_backends: SystemExit: 3; to run without it, set TANDEM_PLUGINS=a "):
        run([ep("a", "fake_plugins:fancy"), ep("quits", "fake_plugins:exiting")])


def test_ctrl_c_is_not_swallowed():
    with pytest.raises(KeyboardInterrupt):
        run([ep("a", "fake_plugins:interrupted")])


def test_report_keeps_the_healthy_plugins_and_marks_the_broken():
    eps = [
        ep("a", "fake_plugins:fancy"), ep("broken", "broken_plugin"), ep("c", "fake_plugins:backend"),
        ep("quits", "fake_plugins:exiting"), ep("typo", "fake_plugins:misspelled"),
        ep("z-dup", "fake_plugins:fancy_again"),
    ]
    report = {info.name: info for info in plugin_report(entry_point_list=eps)}
    assert list(report) == ["a", "broken", "c", "quits", "typo", "z-dup"]
    assert report["a"].error is None and report["a"].models == ["FancyModel"]
    assert report["c"].error is None and report["c"].backends == ["my_backend"]
    assert report["broken"].error == (
        "failed to import: ModuleNotFoundError: No module named 'not_a_real_module_anywhere'"
    )
    assert report["quits"].error == "failed in tandem_register_attention_backends: SystemExit: 3"
    assert report["typo"].error.startswith("is invalid:") and "tandem_register_model" in report["typo"].error
    assert "'FancyModel' is registered twice: by plugin 'a'" in report["z-dup"].error
    assert report["z-dup"].models == []
    # The process-wide registries are neither filled nor changed by a report.
    assert tandem.plugins.defaults._model_registry is None and tandem.plugins.defaults._plugin_manager is None


def test_a_failed_plugins_hooks_are_not_called_again_for_later_plugins():
    report = plugin_report(entry_point_list=[ep("a-quits", "fake_plugins:exiting"), ep("b", "fake_plugins:backend")])
    assert [(i.name, i.error is None, i.backends) for i in report] == [
        ("a-quits", False, []), ("b", True, ["my_backend"])
    ]


def test_two_entry_points_with_one_name_are_reported_not_loaded():
    report = plugin_report(entry_point_list=[ep("x", "fake_plugins:fancy"), ep("x", "fake_plugins:backend")])
    assert [i.name for i in report] == ["x"] and report[0].models == []
    assert report[0].error == "is named twice: two plugins are named 'x': fake_plugins:fancy and fake_plugins:backend"
    with pytest.raises(PluginError, match=r"two plugins are named 'x': fake_plugins:fancy and fake_plugins:backend"):
        run([ep("x", "fake_plugins:fancy"), ep("x", "fake_plugins:backend")])


def test_non_strict_load_skips_only_the_broken_plugin():
    manager = PluginManager(entry_point_list=[ep("a", "fake_plugins:fancy"), ep("broken", "broken_plugin")])
    manager.load(strict=False)
    assert manager.broken() == ["broken"]
    assert manager.pm.has_plugin("a") and not manager.pm.has_plugin("broken")


def _tandem(*args, env):
    return subprocess.run([sys.executable, "-m", "tandem.entrypoints.cli", *args],
                          capture_output=True, text=True, env=env)


@pytest.fixture
def broken_install(tmp_path):
    """A broken and a sys.exit()-ing plugin installed the way pip would: dist-infos on the path."""
    for dist, entry in (("brokenpkg", "broken-one = not_a_real_module_anywhere"),
                        ("quitterpkg", "quitter = exiting_plugin")):
        info = tmp_path / f"{dist}-0.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.0\n")
        (info / "entry_points.txt").write_text(f"[tandem.plugins]\n{entry}\n")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), HERE])}


def healthy_plugins() -> str:
    """The hint's allow-list: every plugin installed here that loads (tandem's own, and any
    other, e.g. ``pip install ./examples/tandem-marian``), sorted, as the CLI computes it.
    Read from this environment rather than written out, so the suite passes beside plugins."""
    names = sorted(info.name for info in plugin_report() if info.error is None)
    assert "tandem-models" in names and "tandem-torch-sdpa" in names  # the oracle is not empty
    return ",".join(names)


def test_cli_lists_healthy_plugins_marks_broken_ones_and_exits_1(broken_install):
    res = _tandem("plugins", env=broken_install)
    assert res.returncode == 1, res.stderr
    out = res.stdout
    assert "tandem-models  (tandem.model_zoo.plugin, from tandem-engine)\n    models:   BartForConditionalGeneration" in out
    assert "tandem-torch-sdpa  (tandem.backends.plugin:torch_sdpa, from tandem-engine)" in out
    assert ("broken-one  (not_a_real_module_anywhere, from brokenpkg)  BROKEN: failed to import: "
            "ModuleNotFoundError: No module named 'not_a_real_module_anywhere'") in out
    assert ("quitter  (exiting_plugin, from quitterpkg)  BROKEN: failed to import: "
            "SystemExit: exiting_plugin: refusing to load") in out
    assert "Traceback" not in res.stderr
    assert ("broken: broken-one, quitter; to run without them, set TANDEM_PLUGINS=" + healthy_plugins() + " "
            "(the plugins that load), or `pip uninstall brokenpkg quitterpkg`") in res.stderr

    res = _tandem("plugins", "--json", env=broken_install)
    assert res.returncode == 1
    records = {r["name"]: r for r in json.loads(res.stdout)}
    assert records["tandem-models"]["error"] is None
    assert records["broken-one"]["error"].startswith("failed to import: ModuleNotFoundError")


def test_cli_with_the_suggested_allow_list_is_clean(broken_install):
    env = {**broken_install, "TANDEM_PLUGINS": "tandem-models,tandem-torch-sdpa"}
    res = _tandem("plugins", env=env)
    assert res.returncode == 0 and "BROKEN" not in res.stdout and "broken-one" not in res.stdout


def test_engine_refuses_to_run_without_an_installed_plugin(broken_install, bart_dir):
    res = _tandem("generate", "--model", str(bart_dir), "the rain", env=broken_install)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    error = res.stderr.strip().splitlines()[-1]
    assert error.startswith("tandem generate: error: plugin 'broken-one' (not_a_real_module_anywhere) failed to import")
    assert "TANDEM_PLUGINS=" + healthy_plugins() + " " in error


def test_the_same_entry_point_seen_twice_loads_once():
    # A stale *.egg-info left in a source tree beside an install repeats every entry point.
    report = plugin_report(entry_point_list=[ep("x", "fake_plugins:fancy"), ep("x", "fake_plugins:fancy")])
    assert [(i.name, i.error, i.models) for i in report] == [("x", None, ["FancyModel"])]
