"""The ``tandem`` command line."""

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.entrypoints.cli import DEMO_MODEL


def tandem(*args, stdin=None, env=None):
    return subprocess.run(
        [sys.executable, "-m", "tandem.entrypoints.cli", *args], input=stdin, capture_output=True, text=True, env=env
    )


# One engine's path is in every other generate test here; two replicas run it too.
@pytest.mark.parametrize("replicas", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_generate_json_reads_stdin_and_matches_the_library(bart_dir, replicas):
    # dtype and device as the reference's: "auto" is bfloat16 on a bf16 CPU, cuda where there is one.
    res = tandem("generate", "--model", str(bart_dir), "--dtype", "float32", "--device", "cpu", "--json", "--max-tokens",
                 "6", "--data-parallel-size", str(replicas), "the rain in spain", "-", stdin="red sun\n\nold king\n")
    assert res.returncode == 0, res.stderr
    records = [json.loads(line) for line in res.stdout.splitlines()]
    assert [r["prompt"] for r in records] == ["the rain in spain", "red sun", "old king"]
    ref = LLM(model=str(bart_dir), dtype="float32", device="cpu").generate(
        [r["prompt"] for r in records], SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False
    )
    for r, o in zip(records, ref):
        assert r["token_ids"] == o.outputs[0].token_ids and r["text"] == o.outputs[0].text
        assert r["error"] is None


@pytest.mark.slow
def test_generate_caps_max_tokens_at_the_positions_left_and_says_so_once(bart_dir):
    # 128 decoder positions, decoder prompt [2, 0]: 126 new tokens fit.
    res = tandem("generate", "--model", str(bart_dir), "--dtype", "float32", "--device", "cpu", "--json", "--max-tokens",
                 "500", "the rain", "red sun")
    assert res.returncode == 0, res.stderr
    assert res.stderr.count("capped to 126") == 1 and "128 decoder positions" in res.stderr
    records = [json.loads(line) for line in res.stdout.splitlines()]
    ref = LLM(model=str(bart_dir), dtype="float32", device="cpu").generate(
        ["the rain", "red sun"], SamplingParams(temperature=0.0, max_tokens=126), use_tqdm=False
    )
    assert [r["token_ids"] for r in records] == [o.outputs[0].token_ids for o in ref]


@pytest.mark.slow
def test_generate_reports_a_bad_prompt_and_a_bad_backend(bart_dir):
    res = tandem("generate", "--model", str(bart_dir), "--dtype", "float32", "--json", "the rain", "zzz-not-a-word " * 200)
    assert res.returncode == 1
    good, bad = [json.loads(line) for line in res.stdout.splitlines()]
    assert good["error"] is None and "encoder prompt has 202 tokens" in bad["error"]
    res = tandem("generate", "--model", str(bart_dir), "--backend", "nope", "the rain")
    assert res.returncode == 2 and "attention_backend='nope'" in res.stderr
    assert "Traceback" not in res.stderr


def test_generate_on_the_demo_model_works_with_no_flags():
    res = tandem("generate", "--model", str(DEMO_MODEL), "the cat sat on the mat")
    assert res.returncode == 0, res.stderr
    assert res.stdout == "the cat sat on the mat\tmat the on sat cat the\n"
    # On CPU cpu_paged where its op builds, else torch_sdpa; no flags means cuda where there is one.
    chosen = r"\w+" if torch.cuda.is_available() else "(cpu_paged|torch_sdpa)"
    # The CLI logs at INFO: two start-up lines (loading, ready), not the ten-line block.
    engine = [line for line in res.stderr.splitlines() if line.startswith("INFO tandem.core.engine:")]
    assert len(engine) == 2, res.stderr
    assert re.fullmatch(rf"INFO tandem.core.engine: loading BartForConditionalGeneration from {DEMO_MODEL} "
                        rf"\(\w+ on \w+, attention {chosen}\)", engine[0]), engine
    assert re.fullmatch(rf"INFO tandem.core.engine: engine ready in [\d.]+ s: BartForConditionalGeneration, \w+ on "
                        rf"\w+, attention {chosen}, KV pool \d+ blocks \([\d.]+ MiB\)"
                        r"(; with structured-output jump-forward)?", engine[1]), engine
    assert "  dtype and device" not in res.stderr
    # At DEBUG the details: a short head and one fact per indented line (the backends passed
    # over each on a "|" line of their own).
    res = tandem("generate", "--model", str(DEMO_MODEL), "the cat sat on the mat",
                 env={**os.environ, "TANDEM_LOGGING_LEVEL": "DEBUG"})
    assert res.returncode == 0, res.stderr
    start = res.stderr.index("DEBUG tandem.core.engine: engine details")
    record = res.stderr[start:].splitlines()
    record = record[:next(i for i, line in enumerate(record) if line.startswith("  swap space")) + 1]
    assert record[0] == "DEBUG tandem.core.engine: engine details: BartForConditionalGeneration for " \
                        "BartForConditionalGeneration"
    assert max(map(len, record)) < 200, record
    facts = [line for line in record[1:] if not line.startswith("      | ")]
    patterns = [r"  dtype and device: \w+ \(.+\) on \w+", r"  linear layers: .+", r"  host malloc: .+",
                rf"  attention backend {chosen} \(the highest priority .+", r"  KV pool \d+ blocks x 16 tokens = .+ MiB",
                r"  swap space \d+ blocks = .+ GiB, committed as used"]
    assert len(facts) == len(patterns) and all(re.fullmatch(p, f) for p, f in zip(patterns, facts)), record


def test_version_help_defaults_and_bad_flags():
    from tandem import __version__

    res = tandem("--version")
    assert res.returncode == 0 and res.stdout.strip() == f"tandem-engine {__version__}"
    res = tandem("generate", "--help")
    assert res.returncode == 0 and res.stdout.count("(default: auto)") >= 2  # --dtype and --device


def test_help_and_version_do_not_import_torch():
    # `tandem --help` used to import torch (seconds) through the engine flags before parsing;
    # what is imported is the measure here, not the time, which a loaded machine would skew.
    code = ("import sys\nfrom tandem.entrypoints.cli import main\n"
            "try:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            "print('torch imported:', 'torch' in sys.modules)")
    for args in (["--help"], ["--version"], []):
        res = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True)
        assert res.stdout.rstrip().endswith("torch imported: False"), (args, res.stdout, res.stderr)
    assert "generate,transcribe,serve,plugins,demo" in res.stderr  # no command: the usage error
    # A command's own help still lists the engine flags.
    res = subprocess.run([sys.executable, "-c", code, "serve", "--help"], capture_output=True, text=True)
    assert "engine options:" in res.stdout and "--dtype" in res.stdout


def test_demo_path_does_not_import_torch():
    """`tandem demo --path` took 6-10 s to print a directory: it imported torch for the
    engine flags. Now it prints the path and nothing else is loaded."""
    from tandem.entrypoints.cli import DEMO_MODEL, DEMO_WHISPER

    code = ("import sys\nfrom tandem.entrypoints.cli import main\nmain(sys.argv[1:])\n"
            "print('torch imported:', 'torch' in sys.modules)")
    for args, path in ((["demo", "--path"], DEMO_MODEL), (["demo", "--whisper", "--path"], DEMO_WHISPER),
                       (["demo", "--path", "--whisper"], DEMO_WHISPER)):
        res = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True)
        assert res.stdout.splitlines() == [str(path), "torch imported: False"], (args, res.stdout, res.stderr)
    # With an engine flag the line is parsed in full (and the flag checked) as before.
    res = subprocess.run([sys.executable, "-c", code, "demo", "--path", "--dtype", "float8"], capture_output=True,
                         text=True)
    assert "argument --dtype: invalid choice: 'float8'" in res.stderr


@pytest.mark.parametrize("args, command, names", [
    (["generate", "--model", "m", "--bogus-flag", "x"], "generate", "unrecognized arguments: --bogus-flag"),
    (["demo", "--dtype", "float8"], "demo", "argument --dtype: invalid choice: 'float8'"),
    (["serve", "m", "--port", "eighty"], "serve", "argument --port: invalid int value: 'eighty'"),
    (["serve", "m", "--allowed-local-media-path", "/no/such/dir"], "serve",
     "argument --allowed-local-media-path: must be a directory, got '/no/such/dir'"),
    (["transcribe", "m"], "transcribe", "the following arguments are required: files"),
    (["generate", "the rain"], "generate", "the following arguments are required: --model"),
    (["nonsense"], None, "invalid choice: 'nonsense'"),
], ids=["unknown-flag", "bad-choice", "bad-int", "not-a-directory", "missing-positional", "missing-option",
        "unknown-command"])
def test_a_usage_error_is_one_line_naming_the_value_and_pointing_at_help(args, command, names):
    res = tandem(*args)
    prog = f"tandem {command}" if command else "tandem"
    assert res.returncode == 2
    assert res.stderr.count("\n") == 1 and "usage:" not in res.stderr, res.stderr
    assert res.stderr.startswith(f"{prog}: error: ") and names in res.stderr
    assert res.stderr.rstrip().endswith(f"(see '{prog} --help')")


def _options(parser):
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, p in sub.choices.items():
        for action in p._actions:
            flag = isinstance(action, (argparse._HelpAction, argparse._StoreTrueAction))
            if action.option_strings and not flag and not action.required:
                yield name, p, action


def test_every_option_shows_its_default_in_help():
    from tandem.core.config import EngineConfig
    from tandem.entrypoints.cli import _build_parser

    parser, _ = _build_parser()
    seen = set()
    for command, p, action in _options(parser):
        text = p._get_formatter()._expand_help(action) if action.help else ""
        assert "(default: " in text, f"tandem {command} {action.option_strings[0]}: help shows no default: {text!r}"
        if action.default is not None:  # the value argparse would use is the one shown
            assert f"(default: {action.default})" in text, (command, action.option_strings, text)
        seen.add((command, action.option_strings[0]))
    assert {("serve", "--host"), ("serve", "--kv-cache-memory"), ("transcribe", "--task"), ("generate", "--seed")} <= seen
    # serve's engine flags show what the engine itself defaults to.
    engine = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    serve = {a.option_strings[0]: a for command, _, a in _options(parser) if command == "serve"}
    for flag in ("--max-num-seqs", "--max-num-batched-tokens", "--block-size", "--seed",
                 "--max-consecutive-step-failures"):
        action = serve[flag]
        assert action.default == engine[action.dest], flag


def test_a_backend_whose_module_cannot_be_imported_is_a_one_line_error(bart_dir, tmp_path):
    # A plugin installed the way pip would (a dist-info with an entry point) that registers
    # a backend whose module does not exist.
    dist = tmp_path / "ghost_backend-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: ghost-backend\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[tandem.plugins]\nghost-backend = ghost_backend_plugin\n")
    (tmp_path / "ghost_backend_plugin.py").write_text(
        "from tandem import hookimpl\n\n"
        "@hookimpl\n"
        "def tandem_register_attention_backends(registry):\n"
        "    registry.register_backend('ghost', 'no_such_module_anywhere:GhostBackend')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    res = tandem("generate", "--model", str(bart_dir), "--backend", "ghost", "the rain", env=env)
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr
    error = res.stderr.strip().splitlines()[-1]
    assert error.startswith("tandem generate: error:") and "no_such_module_anywhere" in error and "'ghost'" in error


def test_bad_logging_level_is_a_clear_error(bart_dir):
    res = tandem("generate", "--model", str(bart_dir), "the rain", env={**os.environ, "TANDEM_LOGGING_LEVEL": "LOUD"})
    assert res.returncode == 2 and "TANDEM_LOGGING_LEVEL='LOUD'" in res.stderr


def test_demo_reverses_words():
    res = tandem("demo")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "5/5 right" in res.stdout
    assert "output: mat the on sat cat the" in res.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU's auto dtype")
def test_plugins_reports_the_dtype_auto_resolves_to_here(monkeypatch):
    from tandem.plugins import plugin_report

    res = tandem("plugins", env={**os.environ, "TANDEM_AUTO_DTYPE": "bfloat16"})
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("here: cpu/bfloat16, what --device auto and --dtype auto resolve to on this "
                                 "machine (TANDEM_AUTO_DTYPE=bfloat16 overrides auto)")
    sdpa = res.stdout[res.stdout.index("      torch_sdpa:"):]
    assert "        here:         can serve cpu/bfloat16, head size 64, block size 16" in sdpa
    # No override: a CPU with avx512_bf16 is listed in bfloat16, one without in float32.
    monkeypatch.delenv("TANDEM_AUTO_DTYPE", raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    for native, name in ((True, "bfloat16"), (False, "float32")):
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: native)
        infos = {i.name: i for i in plugin_report()}
        here = infos["tandem-torch-sdpa"].backend_capabilities["torch_sdpa"]["here"]
        assert here.startswith(f"can serve cpu/{name},"), here
