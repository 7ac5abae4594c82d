"""tools/gpu_plan.sh, the GPU plan's one command, checked without a GPU: what its
dry run would run exists and collects, a failing stage does not stop the others
and sets the exit status, and the shapes tests/gpu covers are what it says."""

from __future__ import annotations

import importlib.util
import itertools
import os
import re
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import torch

from helpers import SUBPROCESS_TIMEOUT

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "gpu_plan.sh"
BENCH = ROOT / "benchmarks" / "attention_kernels.py"


def _plan(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, **(env or {})}, timeout=SUBPROCESS_TIMEOUT)


def _commands(stdout: str) -> list[list[str]]:
    return [shlex.split(line[2:]) for line in stdout.splitlines() if line.startswith("+ ")]


def test_the_script_parses_and_names_bad_arguments():
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
    assert SCRIPT.stat().st_mode & stat.S_IXUSR, "tools/gpu_plan.sh is not executable"
    for args, message in [(["--only", "gpu"], "--only 'gpu': must be env, tests or bench"),
                          (["--only"], "--only needs a stage"),
                          (["--fast"], "unknown option '--fast'"),
                          (["a", "b"], "one output directory, got 'a' and 'b'")]:
        done = _plan(*args)
        assert done.returncode == 2 and message in done.stderr, (args, done.stderr)


def test_the_dry_run_names_paths_that_exist_and_tests_that_collect(tmp_path):
    out = tmp_path / "out"
    done = _plan("--dry-run", str(out))
    assert done.returncode == 0, done.stderr
    assert not out.exists(), "a dry run created its output directory"
    commands = _commands(done.stdout)
    assert commands[0] == ["nvidia-smi"]

    [pytest_cmd] = [c for c in commands if c[1:3] == ["-m", "pytest"]]
    args = pytest_cmd[3:]
    assert args[args.index("-m") + 1] == "gpu"
    paths = [a for i, a in enumerate(args) if not a.startswith("-") and args[i - 1] != "-m"]
    assert "tests/gpu" in paths
    for p in paths:
        assert (ROOT / p).exists(), p

    bench = [c for c in commands if len(c) > 1 and c[1] == "benchmarks/attention_kernels.py"]
    assert {(c[c.index("--dtype") + 1], c[c.index("--block-size") + 1]) for c in bench} == {
        ("bfloat16", "16"), ("bfloat16", "128"), ("float16", "16"), ("float16", "128")}
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # Collection and the benchmark's own argument parser, side by side.
    collect = subprocess.Popen([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:hypothesispytest",
                                "--collect-only", "-q", "-m", "gpu", *paths], cwd=ROOT, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    usage = subprocess.run([sys.executable, str(BENCH), "--help"], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=SUBPROCESS_TIMEOUT)
    listing, _ = collect.communicate(timeout=SUBPROCESS_TIMEOUT)
    assert usage.returncode == 0, usage.stderr
    for c in bench:
        for flag in (a for a in c[2:] if a.startswith("--")):
            assert flag in usage.stdout, f"{flag} is not an option of {BENCH.name}"
        assert isinstance(getattr(torch, c[c.index("--dtype") + 1]), torch.dtype)
    assert collect.returncode == 0, listing[-3000:]
    counted = re.search(r"(\d+)(?:/\d+)? tests? collected", listing)
    assert counted and int(counted.group(1)) > 0, listing[-3000:]
    for p in paths:  # every path contributes GPU tests
        assert any(line.startswith(p) for line in listing.splitlines()), p


def _stubs(tmp_path: Path, pytest_status: int, failing_bench_dtype: str | None) -> dict:
    """A stand-in interpreter that records its arguments, prints a pytest summary
    exiting ``pytest_status``, and prints a benchmark table in the benchmark's own
    header (failing for ``failing_bench_dtype``); and a stand-in nvidia-smi."""
    header = re.search(r'print\(f"(\| backend \| block \|[^"]*)"\)', BENCH.read_text()).group(1)
    assert header == ("| backend | block | decode us | floor / decode | prefill ms | prefill TFLOP/s | "
                      "encoder ms | encoder TFLOP/s |"), "the benchmark's columns changed: update gpu_plan.sh's awk"
    table = "\n".join(["# device stub", "", header, "|---|---|---|---|---|---|---|---|---|",
                       "| triton | 16 | 81.5 | 98% | 1.25 | 13.74 | 2.50 | 13.74 |",
                       "| xformers | - | skipped: the xformers package is not installed | | | | | |"])
    calls = tmp_path / "calls"
    fail = f"*--dtype\\ {failing_bench_dtype}*) exit 1 ;;" if failing_bench_dtype else ""
    python = tmp_path / "bin" / "python-stub"
    python.parent.mkdir()
    python.write_text(f"""#!/usr/bin/env bash
printf '%s\\n' "$*" >> {shlex.quote(str(calls))}
case "$*" in
    *pytest*) echo "2 failed, 40 passed"; exit {pytest_status} ;;
esac
case "$*" in
    *attention_kernels.py*) printf '%s\\n' {shlex.quote(table)} ;;
esac
case "$*" in
    {fail}
esac
""")
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.write_text("#!/usr/bin/env bash\necho 'NVIDIA H100 80GB HBM3 (stub)'\n")
    for f in (python, smi):
        f.chmod(0o755)
    return {"PYTHON": str(python), "PATH": f"{python.parent}:{os.environ['PATH']}"}


def test_failing_tests_do_not_stop_the_benchmarks_and_set_the_exit_status(tmp_path):
    out = tmp_path / "out"
    done = _plan(str(out), env=_stubs(tmp_path, 3, None))
    assert done.returncode == 3, done.stdout + done.stderr
    calls = (tmp_path / "calls").read_text().splitlines()
    assert "pytest" in calls[1] and all("attention_kernels.py" in c for c in calls[2:]) and len(calls) == 6
    assert "2 failed, 40 passed" in (out / "pytest.log").read_text()
    assert "H100 80GB HBM3 (stub)" in (out / "nvidia-smi.txt").read_text()
    assert "tests: exit 3" in (out / "summary.txt").read_text()
    rows = (out / "kernel-table.md").read_text().splitlines()
    assert rows[0] == "| backend | dtype | block | decode us | floor / decode | prefill ms | encoder ms |"
    # One triton row and one skipped xformers row per dtype and block size.
    assert rows.count("| triton | bfloat16 | 16 | 81.5 | 98% | 1.25 | 2.50 |") == 2
    assert rows.count("| triton | float16 | 16 | 81.5 | 98% | 1.25 | 2.50 |") == 2
    assert rows.count("| xformers | float16 | - | skipped: the xformers package is not installed | | | |") == 2
    assert len(rows) == 2 + 8


def test_a_failing_benchmark_fails_the_plan_after_passing_tests(tmp_path):
    out = tmp_path / "out"
    done = _plan("--only", "bench", str(out), env=_stubs(tmp_path, 0, "float16"))
    assert done.returncode == 1, done.stdout + done.stderr
    assert len((tmp_path / "calls").read_text().splitlines()) == 4  # bench only: all four runs
    assert "a run failed" in (out / "summary.txt").read_text()
    assert not (out / "pytest.log").exists()


def _gpu_cases():
    spec = importlib.util.spec_from_file_location("gpu_cases", ROOT / "tests" / "gpu" / "gpu_cases.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_gpu_grid_covers_every_pair_of_values():
    cases = _gpu_cases()
    for dtypes in [(torch.float16, torch.bfloat16), (torch.float32, torch.float16, torch.bfloat16)]:
        rows = cases.grid(dtypes)
        assert len(rows) == len(cases.RATIOS) * len(cases.HEAD_SIZES)
        factors = [dtypes, cases.RATIOS, cases.HEAD_SIZES, cases.BLOCK_SIZES]
        for i, j in itertools.combinations(range(4), 2):
            seen = {(r[i], r[j]) for r in rows}
            missing = set(itertools.product(factors[i], factors[j])) - seen
            assert not missing, (dtypes, i, j, missing)
