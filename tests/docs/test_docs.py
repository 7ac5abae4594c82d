"""Every fenced code block of README.md, docs/*.md and examples/*/README.md runs, or the
markdown says why it does not, so the documentation cannot drift from the code.

A block may be preceded (as the last non-blank line before its fence) by one marker:

    <!-- docs-check: skip: REASON -->      not run; REASON is required (a server, a GPU, pip, ...)
    <!-- docs-check: excerpt: PATH -->     code quoted from PATH (from the repository root): its
                                           lines, stripped, appear in PATH in the same order
                                           (lines that are only ``...`` stand for omitted code)
    <!-- docs-check: output: COMMAND -->   a sample of COMMAND's output: COMMAND runs and every
                                           line of the block (but a leading ``$ COMMAND`` and
                                           lines that are only ``...``) appears among its
                                           output lines
    <!-- docs-check: synopsis -->          a usage summary, not run: for each ``tandem CMD ...``
                                           line (``\\`` continuations joined), ``tandem CMD
                                           --help`` names every ``--option`` it shows

Unmarked blocks run:

- ``python``: executed in a module of its own; all Python blocks run in one child Python
  process (one import of torch and tandem, not one per block), each reporting its own error;
- shell (no language, ``bash``, ``sh``, ``console``): each line (``$ `` removed, ``\\``
  continuations joined) runs in bash; every command must be ``tandem``, ``python`` or
  ``pip install``, optionally after ``VAR=value`` assignments. ``pip install`` is never
  run (the suite runs in an installed environment): a local path it names must exist, and
  ``./examples/<plugin>`` is already visible as an installed plugin (see ``plugin_site``);
- any other language fails: mark it.

Everything runs from a scratch directory holding links to the repository's ``tests``,
``examples`` and ``benchmarks``, and the audio files the docs name (``talk.flac``,
``meeting.wav``, ``lecture.mp3``, 3 s of synthetic audio each). Placeholders in the text
are replaced before running (``PLACEHOLDERS``): BART paths and ``DIR`` by the shipped demo
model, ``path/to/whisper`` and ``path/to/opus-mt-checkpoint`` by tiny random checkpoints.
A Python block that uses ``samples`` without defining it gets one second of float32 audio
at 44.1 kHz under that name.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from helpers import TINY_DIMS, make_tokenizer, make_whisper, synth_audio
from tandem.entrypoints.cli import DEMO_MODEL

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "examples").glob("*/README.md"))]
BIN = Path(sys.executable).parent
TIMEOUT = 180

# placeholder -> the fixture whose path replaces it (longest first, so "path/to/bart" never
# eats the start of a longer one)
PLACEHOLDERS = {
    "path/to/hf-bart-checkpoint": "demo_model",
    "path/to/opus-mt-checkpoint": "marian_dir",
    "path/to/whisper": "whisper_dir",
    "path/to/bart": "demo_model",
}
WORD_PLACEHOLDERS = {"DIR": "demo_model"}  # replaced only as a whole word
SHELL_LANGS = {"", "bash", "sh", "console", "shell"}
MARKER = re.compile(r"^\s*<!--\s*docs-check:\s*(?P<kind>[a-z]+)\s*(?::\s*(?P<arg>.*?))?\s*-->\s*$")
FENCE = re.compile(r"^(?P<indent>\s*)```(?P<lang>[\w+-]*)\s*$")


# The blocks that run (shell, python, output: every documented command, many a whole engine
# or a benchmark) are slow: out of the default run, in CI's bfloat16 stage (pyproject's
# `slow`). Skips, excerpts and synopses are only read, and run in the default command.
FAST_MARKERS = ("skip", "excerpt", "synopsis")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    marker: str | None  # kind
    arg: str | None

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def collect(path: Path) -> list[Block]:
    return collect_text(path.read_text(), path)


def collect_text(text: str, path: Path = ROOT / "README.md") -> list[Block]:
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, start = len(m["indent"]), i
        j = i + 1
        while j < len(lines) and lines[j].strip() != "```":
            j += 1
        body = "\n".join(l[indent:] if l[:indent].strip() == "" else l for l in lines[i + 1 : j])
        k = start - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        mk = MARKER.match(lines[k]) if k >= 0 else None
        blocks.append(Block(path, start + 1, m["lang"], body + "\n", mk["kind"] if mk else None,
                            mk["arg"] if mk else None))
        i = j + 1
    return blocks


BLOCKS = [b for p in DOCS for b in collect(p)]


# ---- fixtures: the environment the docs run in ----

@pytest.fixture(scope="session")
def demo_model() -> Path:
    return DEMO_MODEL


@pytest.fixture(scope="session")
def whisper_dir(tmp_path_factory) -> Path:
    return make_whisper(tmp_path_factory.mktemp("docs_whisper") / "ckpt", timestamps=True)


@pytest.fixture(scope="session")
def marian_dir(tmp_path_factory) -> Path:
    """A tiny random OPUS-MT-shaped checkpoint, with a word-level tokenizer."""
    from transformers import MarianConfig, MarianMTModel

    path = tmp_path_factory.mktemp("docs_marian") / "ckpt"
    torch.manual_seed(0)
    config = MarianConfig(**{k: v for k, v in TINY_DIMS.items() if k != "forced_eos_token_id"}, vocab_size=96,
                          activation_function="swish", scale_embedding=True, pad_token_id=1,
                          decoder_start_token_id=1, eos_token_id=2, bos_token_id=2, forced_eos_token_id=None)
    model = MarianMTModel(config).eval()
    model.generation_config.bad_words_ids = [[1]]
    model.save_pretrained(path)
    make_tokenizer(96).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def plugin_site(tmp_path_factory) -> list[str]:
    """The example plugins as if pip-installed: a dist-info with their entry point each, on
    PYTHONPATH beside their source (importlib.metadata finds distributions on sys.path)."""
    site = tmp_path_factory.mktemp("docs_site")
    paths = [str(site)]
    for pyproject in sorted((ROOT / "examples").glob("*/pyproject.toml")):
        text = pyproject.read_text()
        name = re.search(r'^name = "(.+)"', text, re.M)[1]
        eps = re.search(r'\[project\.entry-points\."tandem\.plugins"\]\n((?:.+\n?)+)', text)[1]
        info = site / f"{name.replace('-', '_')}-0.0.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.0.0\n")
        (info / "entry_points.txt").write_text("[tandem.plugins]\n" + "".join(
            l.replace('"', "") + "\n" for l in eps.splitlines() if "=" in l and not l.startswith("#")))
        paths.append(str(pyproject.parent))
    return paths


@pytest.fixture(scope="session")
def workdir(tmp_path_factory) -> Path:
    import soundfile as sf

    work = tmp_path_factory.mktemp("docs_work")
    for name in ("tests", "examples", "benchmarks"):
        (work / name).symlink_to(ROOT / name)
    audio = synth_audio(3.0, seed=1)
    for name, fmt in (("talk.flac", "FLAC"), ("meeting.wav", "WAV"), ("lecture.mp3", "MP3")):
        sf.write(work / name, audio, 16000, format=fmt)
    return work


@pytest.fixture(scope="session")
def env(plugin_site) -> dict:
    e = dict(os.environ)
    e["PATH"] = f"{BIN}{os.pathsep}{e.get('PATH', '')}"
    e["PYTHONPATH"] = os.pathsep.join([*plugin_site, str(ROOT), *filter(None, [e.get("PYTHONPATH")])])
    e["HF_HUB_OFFLINE"] = "1"
    e.pop("TANDEM_PLUGINS", None)
    return e


def substitute(text: str, request) -> str:
    for ph in sorted(PLACEHOLDERS, key=len, reverse=True):
        if ph in text:
            text = text.replace(ph, str(request.getfixturevalue(PLACEHOLDERS[ph])))
    for word, fixture in WORD_PLACEHOLDERS.items():
        if re.search(rf"\b{word}\b", text):
            text = re.sub(rf"\b{word}\b", str(request.getfixturevalue(fixture)), text)
    return text


_runs: dict[str, subprocess.CompletedProcess] = {}


def run(cmd: list[str] | str, env: dict, cwd: Path) -> subprocess.CompletedProcess:
    """Runs ``cmd`` (a bash line or an argv), once per session for the same command."""
    key = " ".join(shlex.split(cmd, comments=True)) if isinstance(cmd, str) else "\0".join(cmd)
    if key not in _runs:
        argv = ["bash", "-c", cmd] if isinstance(cmd, str) else cmd
        _runs[key] = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT)
    return _runs[key]


def check(proc: subprocess.CompletedProcess, what: str) -> None:
    assert proc.returncode == 0, f"{what}\nexit status {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


# ---- the checks, one per kind ----

RUNNER = """
import json, sys, traceback, types
results = {}
for path in sys.argv[2:]:
    name = "docs_block_" + str(len(results))
    module = types.ModuleType(name)
    module.__file__ = path
    sys.modules[name] = module
    print("==== " + path, flush=True)
    try:
        exec(compile(open(path).read(), path, "exec"), module.__dict__)
        results[path] = None
    except BaseException:
        results[path] = traceback.format_exc()
    print(flush=True)
json.dump(results, open(sys.argv[1], "w"))
"""


def python_script(block: Block, request, cwd: Path) -> Path:
    code = substitute(block.text, request)
    if re.search(r"\bsamples\b", code) and not re.search(r"^\s*samples\s*=", code, re.M):
        code = ("import numpy as _np\nsamples = _np.sin(_np.arange(44100) * 0.05).astype(_np.float32)\n"
                + code)
    script = cwd / f"block_{block.path.stem}_{block.line}.py"
    script.write_text(code)
    return script


@pytest.fixture(scope="session")
def python_results(request, env, workdir) -> tuple[dict, subprocess.CompletedProcess]:
    """Every unmarked Python block, run in one child process: script path -> traceback or None."""
    scripts = [str(python_script(b, request, workdir)) for b in BLOCKS if b.marker is None and b.lang == "python"]
    out = workdir / "python_results.json"
    proc = subprocess.run([sys.executable, "-c", RUNNER, str(out), *scripts], env=env, cwd=workdir,
                          capture_output=True, text=True, timeout=TIMEOUT * 2)
    import json

    return (json.loads(out.read_text()) if out.exists() else {}), proc


def run_python(block: Block, request, cwd) -> None:
    results, proc = request.getfixturevalue("python_results")
    script = str(python_script(block, request, cwd))
    assert script in results, f"{block.id}: the block runner died\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    if results[script] is not None:
        pytest.fail(f"{block.id}: python block failed\n{results[script]}")


def shell_lines(text: str) -> list[str]:
    lines, cur = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("$ "):
            line = line[2:]
        cur += line
        if cur.endswith("\\"):
            cur = cur[:-1] + " "
            continue
        if cur.strip():
            lines.append(cur.strip())
        cur = ""
    return lines


def command_word(segment: str) -> tuple[str, list[str]]:
    words = shlex.split(segment, comments=True)
    while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
        words = words[1:]
    return (words[0] if words else ""), words[1:]


def check_pip(args: list[str], where: str) -> None:
    assert args[:1] == ["install"], f"{where}: only `pip install` is understood, not pip {args}"
    for a in args[1:]:
        if a.startswith((".", "/")):
            local = (ROOT / a.split("[")[0]).resolve()
            assert local.exists(), f"{where}: pip installs {a}, which does not exist"


def run_shell(block: Block, request, env, cwd) -> None:
    for line in shell_lines(substitute(block.text, request)):
        where = f"{block.id}: `{line}`"
        kept = []
        for segment in line.split("&&"):
            word, args = command_word(segment)
            if word == "pip":
                check_pip(args, where)
                continue
            assert word in ("tandem", "python"), (
                f"{where}: the docs check runs only tandem, python and pip install commands, not {word!r}; "
                "mark the block <!-- docs-check: skip: REASON --> if it cannot run here")
            assert not (word == "python" and args[:2] == ["-m", "pytest"]), (
                f"{where}: test-suite commands are not run by the docs check; mark the block skip")
            kept.append(segment.strip())
        if kept:
            check(run(" && ".join(kept), env, cwd), f"{where} failed")


def check_excerpt(block: Block) -> None:
    source = ROOT / block.arg
    assert source.is_file(), f"{block.id}: excerpt of {block.arg}, which does not exist"
    have = [l.strip() for l in source.read_text().splitlines()]
    pos = 0
    for line in block.text.splitlines():
        want = line.strip()
        if not want or want == "...":
            continue
        try:
            pos = have.index(want, pos) + 1
        except ValueError:
            pytest.fail(f"{block.id}: excerpt of {block.arg}: this line is not in it (after line {pos}):\n{want}")


def check_output(block: Block, env, cwd) -> None:
    proc = run(block.arg, env, cwd)
    got = {l.rstrip() for l in (proc.stdout + proc.stderr).splitlines()}
    lines = block.text.rstrip("\n").splitlines()
    if lines and lines[0].startswith("$ "):
        lines = lines[1:]
    missing = [l for l in lines if l.strip() not in ("", "...") and l.rstrip() not in got]
    assert not missing, (f"{block.id}: lines not in the output of `{block.arg}`:\n" + "\n".join(missing)
                         + f"\n--- output:\n{proc.stdout}{proc.stderr}")


def check_synopsis(block: Block, env, cwd) -> None:
    for line in shell_lines(block.text):
        words = line.split()
        if len(words) < 2 or words[0] != "tandem" or not re.match(r"^[a-z]+$", words[1]):
            continue
        usage = cli_help(words[1])
        code = line.split(" # ")[0]  # a trailing comment may mention other things
        for opt in sorted(set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", code))):
            assert opt in usage, f"{block.id}: `tandem {words[1]} --help` has no {opt}"


def cli_help(command: str) -> str:
    """``tandem COMMAND --help``, in this process (parsing only: nothing is loaded)."""
    import contextlib
    import io

    from tandem.entrypoints.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0, f"tandem {command} --help: exit status {exit_info.value.code}"
    return buf.getvalue()


@pytest.mark.parametrize("block", [pytest.param(b, id=b.id, marks=() if b.marker in FAST_MARKERS else pytest.mark.slow)
                                   for b in BLOCKS])
def test_doc_block(block: Block, request) -> None:
    kind = block.marker
    if kind == "skip":
        assert block.arg, f"{block.id}: docs-check: skip needs a reason (skip: REASON)"
        pytest.skip(f"{block.id}: {block.arg}")
    if kind == "excerpt":
        return check_excerpt(block)
    env, cwd = request.getfixturevalue("env"), request.getfixturevalue("workdir")
    if kind == "output":
        return check_output(block, env, cwd)
    if kind == "synopsis":
        return check_synopsis(block, env, cwd)
    assert kind is None, f"{block.id}: unknown marker docs-check: {kind} (skip, excerpt, output, synopsis)"
    if block.lang == "python":
        return run_python(block, request, cwd)
    if block.lang in SHELL_LANGS:
        return run_shell(block, request, env, cwd)
    pytest.fail(f"{block.id}: a ```{block.lang} block the docs check cannot run: mark it "
                "<!-- docs-check: excerpt: PATH --> or <!-- docs-check: skip: REASON -->")


def test_every_marker_precedes_a_block() -> None:
    for path in DOCS:
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if "docs-check" not in line:
                continue
            assert MARKER.match(line), f"{path.relative_to(ROOT)}:{i + 1}: malformed marker {line!r}"
            nxt = next((l for l in lines[i + 1 :] if l.strip()), "")
            assert FENCE.match(nxt), f"{path.relative_to(ROOT)}:{i + 1}: marker not followed by a code block"


def test_all_docs_are_collected() -> None:
    assert len(BLOCKS) > 30 and {b.path.name for b in BLOCKS} >= {"README.md", "plugins.md"}


@pytest.mark.parametrize("lang, text, error", [
    ("toml", "[project]\n", pytest.fail.Exception),          # no way to run it: must be marked
    ("", "curl http://127.0.0.1:8000/health\n", AssertionError),  # not a command the check runs
    ("", "python -m pytest -q\n", AssertionError),           # the suite itself: must be marked skip
])
def test_an_unmarked_block_that_cannot_run_fails(lang, text, error, request) -> None:
    with pytest.raises(error):
        test_doc_block(Block(ROOT / "README.md", 0, lang, text, None, None), request)


def test_a_skip_needs_a_reason(request) -> None:
    (block,) = collect_text("<!-- docs-check: skip -->\n```\ntandem serve x\n```\n")
    assert block.marker == "skip" and block.arg is None
    with pytest.raises(AssertionError, match="needs a reason"):
        test_doc_block(block, request)
