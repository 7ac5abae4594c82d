"""Each engine of a benchmark in its own long-lived process.

Engines sharing one process do not compare fairly: CTranslate2's Intel OpenMP
pool keeps the cores spinning after a call returns (KMP_BLOCKTIME, 200 ms by
default), and torch's and CTranslate2's thread pools contend, so an engine timed
right after CTranslate2 ran slower (tandem's latency p50 went from 22 to 31-32
ms per token once CTranslate2 had run). Here each engine is loaded once in a
child process of its own, started with its thread settings in the environment
(so they hold before any library is imported), and kept across rounds; the
parent only orchestrates: it asks one child at a time to run the workload and
waits, after each reply, until that child's CPU use has dropped to near zero
(its pool stopped spinning) before the next engine is timed.

``start(name, factory, *args)`` runs ``factory`` ("module:callable", importable
with the parent's ``sys.path``) in a new child and returns an ``EngineProcess``;
``call(method, *args)`` runs ``method`` on the object the factory returned and
returns its result (everything crosses the pipe pickled: the callee times its
own work, so the transfer stays off the clock). A child that fails to load,
raises, or dies raises ``EngineFailed`` naming the engine and the error.
``InProcess`` offers the same ``call`` on an object in this process (the old
behaviour, ``--in-process``).
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import time
import traceback
from multiprocessing.connection import Connection


class EngineFailed(RuntimeError):
    """An engine's process failed to load, raised from a call, or died."""


def thread_env(threads: int | None) -> dict[str, str]:
    """The environment that sizes the OpenMP / MKL pools of a child to ``threads``
    (set before the child imports torch or CTranslate2, which read it at load)."""
    if not threads:
        return {}
    return {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


class InProcess:
    """The engine object built here, in this process: ``call`` as EngineProcess's."""

    def __init__(self, name: str, factory: str, *args, **kwargs):
        self.name, self.pid = name, os.getpid()
        start = time.perf_counter()
        try:
            self.obj = _resolve(factory)(*args, **kwargs)
        except Exception as exc:
            raise EngineFailed(f"{name}: {type(exc).__name__}: {exc}") from exc
        self.load_seconds = time.perf_counter() - start

    def call(self, method: str, *args, **kwargs):
        try:
            return getattr(self.obj, method)(*args, **kwargs)
        except Exception as exc:
            raise EngineFailed(f"{self.name}: {type(exc).__name__}: {exc}") from exc

    def close(self) -> None:
        self.obj = None


class EngineProcess:
    """One child process holding one engine object; see the module docstring."""

    def __init__(self, name: str, factory: str, *args, env: dict[str, str] | None = None, **kwargs):
        self.name = name
        down_r, down_w = os.pipe()  # parent -> child
        up_r, up_w = os.pipe()  # child -> parent
        # The child's stdout/stderr are ours (its progress and warnings show); the
        # protocol has pipes of its own so that a library's print cannot corrupt it.
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), str(down_r), str(up_w)],
            env={**os.environ, **(env or {})}, pass_fds=(down_r, up_w))
        os.close(down_r)
        os.close(up_w)
        self.pid = self.proc.pid
        self._to = Connection(down_w, readable=False)
        self._from = Connection(up_r, writable=False)
        self._closed = False
        try:
            # The path first, alone: unpickling the arguments may import the modules it finds.
            self._send(list(sys.path))
            self._send((factory, args, kwargs))
            self.load_seconds = self._reply()
        except EngineFailed:
            self.close()
            raise

    def call(self, method: str, *args, **kwargs):
        self._send(("call", method, args, kwargs))
        result = self._reply()
        wait_quiet(self.pid)
        return result

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._to.send(("close",))
        except OSError:
            pass
        try:
            # Generous: freeing a large model's memory under load takes seconds, not minutes.
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._to.close()
        self._from.close()

    def _send(self, message) -> None:
        try:
            self._to.send(message)
        except OSError:
            raise EngineFailed(self._death()) from None

    def _reply(self):
        try:
            kind, value = self._from.recv()
        except (EOFError, OSError):
            raise EngineFailed(self._death()) from None
        if kind == "error":
            raise EngineFailed(f"{self.name}: {value}")
        return value

    def _death(self) -> str:
        try:
            code = self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            code = None
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        return f"{self.name}: process {self.pid} died ({how})"


def start(name: str, factory: str, *args, in_process: bool = False, env: dict[str, str] | None = None,
          **kwargs) -> EngineProcess | InProcess:
    """The engine built by ``factory(*args, **kwargs)`` in a child of its own (with
    ``env`` added to its environment), or here with ``in_process``."""
    if in_process:
        return InProcess(name, factory, *args, **kwargs)
    return EngineProcess(name, factory, *args, env=env, **kwargs)


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` (all its threads), None off Linux."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_quiet(pid: int, window: float = 0.05, limit: float = 2.0) -> float:
    """Wait until process ``pid`` uses under a fifth of a core over ``window``
    seconds (its thread pools stopped spinning), at most ``limit`` seconds;
    returns the seconds waited. Without /proc it waits 0.3 s, more than Intel
    OpenMP's default 200 ms spin."""
    start = time.perf_counter()
    before = cpu_seconds(pid)
    if before is None:
        time.sleep(0.3)
        return time.perf_counter() - start
    # The counters tick at SC_CLK_TCK (100 Hz): one tick in a window is noise.
    threshold = max(0.2 * window, 1.5 / os.sysconf("SC_CLK_TCK"))
    while time.perf_counter() - start < limit:
        time.sleep(window)
        now = cpu_seconds(pid)
        if now is None or now - before <= threshold:
            break
        before = now
    return time.perf_counter() - start


def _resolve(factory: str):
    module, _, attr = factory.partition(":")
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _error(exc: BaseException) -> str:
    traceback.print_exc()  # the whole trace on the child's stderr; the parent gets one line
    return f"{type(exc).__name__}: {exc}"


def _child(read_fd: int, write_fd: int) -> None:
    inbox = Connection(read_fd, writable=False)
    outbox = Connection(write_fd, readable=False)
    path = inbox.recv()
    sys.path[:] = path + [p for p in sys.path if p not in path]
    try:
        factory, args, kwargs = inbox.recv()
        start = time.perf_counter()
        obj = _resolve(factory)(*args, **kwargs)
        outbox.send(("ok", time.perf_counter() - start))
    except BaseException as exc:
        outbox.send(("error", _error(exc)))
        return
    while True:
        try:
            message = inbox.recv()
        except EOFError:  # the parent went away
            return
        if message[0] == "close":
            return
        _, method, args, kwargs = message
        try:
            reply = ("ok", getattr(obj, method)(*args, **kwargs))
        except Exception as exc:
            reply = ("error", _error(exc))
        try:
            outbox.send(reply)
        except OSError:  # the parent went away mid-call
            return


if __name__ == "__main__":
    _child(int(sys.argv[1]), int(sys.argv[2]))
