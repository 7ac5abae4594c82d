"""Building the C++ CPU ops: a build killed midway never hangs a later start, two
checkouts share one build, and a start that waits on another's build says so and gives
up naming the lock. Each test builds a one-line op into its own ``$TORCH_EXTENSIONS_DIR``
in subprocesses, as separate engine starts would."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tandem.backends import cpp_build

pytestmark = pytest.mark.skipif(bool(cpp_build.missing_tools()), reason="no C++ compiler or ninja here")

NAME = "tandem_build_test"
SOURCE = """#include <ATen/core/Tensor.h>
#include <torch/library.h>
at::Tensor twice(const at::Tensor& x) { return x.add(x); }
TORCH_LIBRARY(tandem_build_test, m) { m.def("twice(Tensor x) -> Tensor", &twice); }
"""
# One engine start's build step: build (or load) the op from the source in argv[1], then call it.
BUILD = f"""
import logging, sys
from pathlib import Path
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
import torch
from tandem.backends import cpp_build
cpp_build.build({NAME!r}, Path(sys.argv[1]), [], logging.getLogger("tandem.backends.test"), "the test op")
print(torch.ops.tandem_build_test.twice(torch.tensor([1.0, 2.0])).tolist())
"""
# Generous: a loaded 2-core machine compiles the op in 10-60 s; the old code never returned.
START_TIMEOUT_S = 240


def _source(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "twice.cpp"
    path.write_text(SOURCE)
    return path


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"), "OMP_NUM_THREADS": "1", **extra}


def _start(source: Path, env: dict[str, str], timeout: float = START_TIMEOUT_S) -> subprocess.CompletedProcess:
    try:
        return subprocess.run([sys.executable, "-c", BUILD, str(source)], env=env, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired as e:
        left = sorted(str(p) for p in Path(env["TORCH_EXTENSIONS_DIR"]).rglob("*lock*"))
        pytest.fail(f"the start did not finish in {timeout} s (lock files: {left}); stderr: {e.stderr}")


def _libraries(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "ext").rglob(f"{NAME}*.so"))


def test_a_build_killed_midway_never_hangs_the_next_start(tmp_path):
    """A start killed while compiling (SIGKILL to it, ninja and the compiler, as a test
    runner's timeout does) used to leave torch's lock file behind, and every later start
    waited on it forever. Now the next start builds the op and runs it."""
    source = _source(tmp_path / "checkout")
    env = _env(tmp_path)
    first = subprocess.Popen([sys.executable, "-c", BUILD, str(source)], env=env, start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        # build.ninja is written just before ninja starts the compiler.
        while not [p for p in (tmp_path / "ext").rglob("build.ninja") if p.parent.name.startswith(NAME)]:
            assert first.poll() is None, f"the build ended before it could be killed: {first.stderr.read()}"
            assert time.monotonic() < deadline, "the build never started"
            time.sleep(0.05)
        time.sleep(0.5)
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
        first.stderr.close()
    assert _libraries(tmp_path) == [], "killed too late: the library was already linked"

    res = _start(source, env)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[2.0, 4.0]"
    assert "building the test op in " in res.stderr and "built tandem_build_test_" in res.stderr


def test_two_checkouts_share_one_build_and_never_rebuild_each_other_s(tmp_path):
    """Two checkouts (or a clone and a venv) hold the same source at different paths: the
    second start loads the first's library instead of rebuilding it, and so does the first
    again. (Before, the build named the checkout's path, so each rebuilt the other's op.)"""
    a, b = _source(tmp_path / "clone"), _source(tmp_path / "venv" / "site-packages")
    env = _env(tmp_path)
    res = _start(a, env)
    assert res.returncode == 0, res.stderr
    [library] = _libraries(tmp_path)
    built = library.stat().st_mtime_ns
    for source in (b, a):
        res = _start(source, env)
        assert res.returncode == 0 and res.stdout.strip() == "[2.0, 4.0]", res.stderr
        assert "building" not in res.stderr, res.stderr
        assert _libraries(tmp_path) == [library] and library.stat().st_mtime_ns == built


def test_two_starts_at_once_build_once(tmp_path):
    """Two processes starting together: one builds under the lock, the other waits for it
    (saying so) and loads what it built."""
    source = _source(tmp_path / "checkout")
    env = _env(tmp_path)
    procs = [subprocess.Popen([sys.executable, "-c", BUILD, str(source)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=START_TIMEOUT_S) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert [o[0].strip() for o in outs] == ["[2.0, 4.0]"] * 2
    assert sum("building the test op" in err for _, err in outs) == 1, outs
    assert len(_libraries(tmp_path)) == 1


def test_a_start_waiting_on_a_live_build_says_so_and_gives_up_naming_the_lock(tmp_path, monkeypatch):
    """A live process holding the lock past $TANDEM_OP_BUILD_LOCK_TIMEOUT: the waiting start
    logs a line naming the lock and its holder, then fails with an error naming the lock
    (the ops modules turn that into 'op unavailable' and the backend falls back)."""
    import fcntl

    source = _source(tmp_path / "checkout")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    _, directory = cpp_build.build_directory(NAME, source, [])
    lock = directory / cpp_build.LOCK_FILE
    directory.mkdir(parents=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, b"pid 4242")
        started = time.monotonic()
        res = _start(source, _env(tmp_path, TANDEM_OP_BUILD_LOCK_TIMEOUT="2"), timeout=120)
        waited = time.monotonic() - started
    finally:
        os.close(fd)
    assert res.returncode != 0
    assert f"waiting for another process's build (lock {lock}, held by pid 4242" in res.stderr, res.stderr
    assert f"BuildLockTimeout: waited 2 s for the build lock {lock}, held by pid 4242" in res.stderr, res.stderr
    assert waited < 60 and _libraries(tmp_path) == []


def test_the_build_directory_is_keyed_by_source_and_flags_not_by_path(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    a, b = _source(tmp_path / "a"), _source(tmp_path / "b")
    changed = tmp_path / "c" / "twice.cpp"
    changed.parent.mkdir()
    changed.write_text(SOURCE.replace("x.add(x)", "x.mul(2)"))
    base = cpp_build.build_directory(NAME, a, [])
    assert base == cpp_build.build_directory(NAME, b, [])
    assert base[1] == tmp_path / "ext" / base[0]  # as torch: $TORCH_EXTENSIONS_DIR holds the builds
    assert base[0].startswith(f"{NAME}_")
    others = {cpp_build.build_directory(NAME, changed, [])[0], cpp_build.build_directory(NAME, a, ["-mavx2"])[0]}
    monkeypatch.setattr(cpp_build.torch, "__version__", "0.0.1")
    others.add(cpp_build.build_directory(NAME, a, [])[0])
    assert len(others) == 3 and base[0] not in others


def test_a_lock_timeout_is_the_op_s_reason_and_a_bad_timeout_names_the_variable(monkeypatch, caplog):
    def blocked():
        raise cpp_build.BuildLockTimeout("waited 2 s for the build lock /x/tandem.lock, held by pid 1")

    monkeypatch.setattr(cpp_build, "missing_tools", lambda: [])
    with caplog.at_level(logging.INFO, logger="tandem"):
        assert cpp_build.attempt(blocked, logger=logging.getLogger("tandem.backends.cpu_paged")) == \
            (None, "waited 2 s for the build lock /x/tandem.lock, held by pid 1")
        assert cpp_build.attempt(blocked, "the CPU lacks avx512_bf16") == (None, "the CPU lacks avx512_bf16")
    assert [r.getMessage() for r in caplog.records] == [
        "cpu_paged: C++ op unavailable, backends that need it are passed over: "
        "waited 2 s for the build lock /x/tandem.lock, held by pid 1"]
    monkeypatch.setenv(cpp_build.LOCK_TIMEOUT_ENV, "soon")
    with pytest.raises(ValueError, match="TANDEM_OP_BUILD_LOCK_TIMEOUT='soon': must be a positive number"):
        cpp_build._lock_timeout()


def test_load_once_remembers_the_op_or_the_error_in_the_op_s_module(monkeypatch, caplog):
    """What the three ops modules share: the first load builds (or fails) once, the
    outcome lives in the module's ``_op`` / ``_error`` (a test resets them there), a
    reason known beforehand is asked once and skips the build, each failure logs once."""
    import types

    class Unavailable(RuntimeError):
        pass

    monkeypatch.setattr(cpp_build, "missing_tools", lambda: [])
    module = types.ModuleType("tandem.backends.fake_ops")
    module._op, module._error = None, None
    calls = []

    def broken():
        calls.append("build")
        raise RuntimeError("long compiler output\nfatal error: x.h: No such file")

    logger = logging.getLogger("tandem.backends.fake_ops")
    with caplog.at_level(logging.INFO, logger="tandem"):
        for _ in range(2):
            with pytest.raises(Unavailable, match="building the C.. op failed: fatal error: x.h: No such file"):
                cpp_build.load_once(module, broken, Unavailable, logger)
    assert calls == ["build"] and module._error.startswith("building the C++ op failed")
    assert len(caplog.records) == 1 and caplog.records[0].getMessage().startswith("fake_ops: C++ op unavailable")

    module._error = None  # as a test resets it: the next load tries again
    op = object()
    assert cpp_build.load_once(module, lambda: op, Unavailable, logger) is op is module._op
    assert cpp_build.load_once(module, broken, Unavailable, logger) is op and calls == ["build"]

    module._op = None
    reasons = []
    for _ in range(2):
        with pytest.raises(Unavailable, match="^the CPU lacks it$"):
            cpp_build.load_once(module, broken, Unavailable, logger, reason=lambda: reasons.append(1) or "the CPU lacks it")
    assert reasons == [1] and calls == ["build"]


def test_the_build_lock_waits_with_a_line_every_few_seconds(tmp_path, monkeypatch, caplog):
    import fcntl

    monkeypatch.setattr(cpp_build, "WAIT_LOG_INTERVAL_S", 0.3)
    monkeypatch.setenv(cpp_build.LOCK_TIMEOUT_ENV, "1.2")
    lock = tmp_path / "tandem.lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    # flock locks belong to the open file description: a second open() in this process contends like another process.
    try:
        with caplog.at_level(logging.INFO, logger="tandem"):
            with pytest.raises(cpp_build.BuildLockTimeout, match=str(lock)):
                with cpp_build.build_lock(lock, logging.getLogger("tandem.backends.test"), "test"):
                    pass
    finally:
        os.close(fd)
    waits = [r.getMessage() for r in caplog.records if "waiting for another process's build" in r.getMessage()]
    assert len(waits) >= 3 and all(str(lock) in w for w in waits)
    with cpp_build.build_lock(lock, logging.getLogger("tandem.backends.test"), "test"):  # released: taken at once
        assert lock.read_text() == f"pid {os.getpid()}"
