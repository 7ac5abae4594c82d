"""Building tandem's C++ CPU ops (cpu_paged's decode attention, cpu_flash's bf16
encoder attention, cpu_sampling's argmax) with torch's C++-extension builder: the
tools it needs, the OpenMP flags, where a build lives, the lock around it, its log
lines, and the load once per process (:func:`load_once`), shared by the ``ops``
modules. Each op module keeps its own variant choice, its own error class and its
remembered outcome (its ``_op`` and ``_error``, which tests reset).

Where: one directory per build key, ``<root>/<name>_<key>/``, in torch's extensions
root (``$TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions/py<XY>_cpu``).
The key hashes what the library depends on: the source text, the compiler flags, the
compiler's name, torch's version and Python's. Two checkouts or venvs with the same
source share one build; a changed source or another torch gets its own directory, so
they never rebuild each other's op. The source is copied into that directory and
compiled from there (the build never names a checkout's path). A ``built`` stamp,
written after a build succeeds, marks the library complete; a later process loads it
without calling the builder at all.

Lock: an OS file lock (``fcntl.flock``) on ``<dir>/tandem.lock``, which the kernel
releases when its holder dies, however it dies. torch's own marker file (``lock``,
which a killed process leaves behind and which every later ``load()`` then waits on
forever) is removed under that lock before torch is called. A process waiting for
another's build says so at INFO every few seconds, naming the lock and its holder,
and gives up after ``$TANDEM_OP_BUILD_LOCK_TIMEOUT`` seconds (default 1800) with an
error naming the lock; the op is then unavailable for that process (the backend
falls back) instead of the start hanging.

Why at first use and not at ``pip install``: the library is specific to torch's exact
version (its C++ ABI) and to the CPU's vector ISA, which a wheel or an isolated build
environment cannot know; building it at install would need torch as a build
dependency (a second ~800 MB download into the isolated build env, of a version that
need not match the one installed) and would still rebuild when either changes. The
keyed directory plus the kernel-released lock make the first-use build safe to share
between processes, checkouts and venvs; ``tandem build-ops`` runs it ahead of time
(a Dockerfile step, a CI cache warm-up)."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import torch

LOCK_TIMEOUT_ENV = "TANDEM_OP_BUILD_LOCK_TIMEOUT"
DEFAULT_LOCK_TIMEOUT_S = 1800.0
WAIT_LOG_INTERVAL_S = 5.0
LOCK_FILE = "tandem.lock"
STAMP_FILE = "built"


# Vector-ISA flags per torch CPU capability. Only ISAs every CPU reporting that
# capability has: torch reports AVX512 for AVX512F+BW+VL+DQ, AVX2 for AVX2+FMA.
ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma"],
    "AVX2": ["-mavx2", "-mfma"],
}


def isa(capability: str | None = None) -> str:
    """The build variant for a torch CPU capability (this process's by default):
    ``avx512``, ``avx2`` or ``generic``. ``ATEN_CPU_CAPABILITY=avx2`` lowers torch's
    capability, and with it this variant, on an AVX-512 CPU."""
    capability = cpu_capability() if capability is None else capability
    return (capability if capability in ISA_FLAGS else "generic").lower()


class BuildLockTimeout(RuntimeError):
    """Another process held the build lock past the timeout; the message names the lock."""


def cpu_capability() -> str:
    """torch's CPU capability (AVX512, AVX2, DEFAULT, ...), which ``ATEN_CPU_CAPABILITY`` lowers."""
    try:
        return torch.backends.cpu.get_cpu_capability()
    except Exception:  # older or unusual builds
        return "DEFAULT"


def missing_tools() -> list[str]:
    """What the builder lacks here: a C++ compiler, ninja (empty: nothing)."""
    from torch.utils import cpp_extension

    missing = []
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        missing.append(f"no C++ compiler ({cxx!r} is not on PATH; install g++ or set $CXX)")
    if not cpp_extension.is_ninja_available():
        missing.append("ninja is not installed (pip install ninja)")
    return missing


def _flags(isa_flags: list[str]) -> tuple[list[str], list[str]]:
    cflags = ["-O3", *isa_flags]
    ldflags = []
    if torch.backends.openmp.is_available():
        # at::parallel_for is inlined into the op; with OpenMP it needs -fopenmp to run in
        # parallel. libgomp resolves to the copy torch already loaded (same soname).
        cflags.append("-fopenmp")
        ldflags.append("-fopenmp")
    return cflags, ldflags


def build_key(source_text: bytes, cflags: list[str], ldflags: list[str]) -> str:
    """12 hex digits naming one build: the source, the flags (the ISA among them), the
    compiler's name, torch's version (and commit) and Python's."""
    h = hashlib.sha256()
    for part in (source_text, repr(cflags).encode(), repr(ldflags).encode(), os.environ.get("CXX", "c++").encode(),
                 torch.__version__.encode(), str(getattr(torch.version, "git_version", "")).encode(),
                 f"{sys.version_info[0]}.{sys.version_info[1]}".encode()):
        h.update(len(part).to_bytes(8, "little") + part)
    return h.hexdigest()[:12]


def extensions_root() -> Path:
    """Where the builds live, as torch lays out its own: ``$TORCH_EXTENSIONS_DIR`` itself
    where it is set, else ``~/.cache/torch_extensions/py<XY>_cpu``."""
    from torch.utils import cpp_extension

    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        return Path(root)
    return Path(cpp_extension.get_default_build_root()) / f"py{sys.version_info[0]}{sys.version_info[1]}_cpu"


def build_directory(name: str, source: Path, isa_flags: list[str]) -> tuple[str, Path]:
    """``(library name, its directory)`` for ``source`` built with ``isa_flags``."""
    cflags, ldflags = _flags(isa_flags)
    library = f"{name}_{build_key(Path(source).read_bytes(), cflags, ldflags)}"
    return library, extensions_root() / library


def _lock_timeout() -> float:
    raw = os.environ.get(LOCK_TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_LOCK_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{LOCK_TIMEOUT_ENV}={raw!r}: must be a positive number of seconds")
    return value


def _holder(path: Path) -> str:
    try:
        text = path.read_text().strip()
    except OSError:
        text = ""
    return text or "unknown process"


@contextmanager
def build_lock(path: Path, logger: logging.Logger, tag: str):
    """Holds an exclusive ``flock`` on ``path`` (created if need be); the kernel drops it
    when this process dies. Waits for another holder with a line every few seconds,
    then raises :class:`BuildLockTimeout` naming ``path``. Yields whether it holds the
    lock (False where the OS or file system has no such locks)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no cross-process lock; torch's own marker file remains
        yield False
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        started = time.monotonic()
        timeout = _lock_timeout()
        next_line = started
        locked = True
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                pass
            except OSError as e:  # a file system without locks (some NFS): build unguarded, as torch alone would
                logger.warning("%s: cannot lock %s (%s); building without the lock", tag, path, e)
                locked = False
                break
            now = time.monotonic()
            if now - started >= timeout:
                message = (f"waited {now - started:.0f} s for the build lock {path}, held by {_holder(path)}; "
                           f"raise ${LOCK_TIMEOUT_ENV} (now {timeout:g} s) to wait longer, or stop that process "
                           f"(the lock is released when it exits)")
                logger.warning("%s: %s; going on without the op", tag, message)
                raise BuildLockTimeout(message)
            if now >= next_line:
                logger.info("%s: waiting for another process's build (lock %s, held by %s; %.0f s so far)",
                            tag, path, _holder(path), now - started)
                next_line = now + WAIT_LOG_INTERVAL_S
            time.sleep(0.2)
        if locked:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()}".encode(), 0)
        yield locked
    finally:
        os.close(fd)  # releases the flock


def _complete(directory: Path, library: str) -> bool:
    return (directory / STAMP_FILE).exists() and (directory / f"{library}.so").exists()


def build(name: str, source: Path, isa_flags: list[str], logger: logging.Logger, what: str) -> None:
    """Load the built ``source`` as library ``name`` (compiling it first where no complete
    build exists for its key), registering its ops."""
    from torch.utils import cpp_extension

    tag = logger.name.rsplit(".", 1)[-1]
    cflags, ldflags = _flags(isa_flags)
    library, directory = build_directory(name, source, isa_flags)
    so = directory / f"{library}.so"
    started = time.perf_counter()
    if not _complete(directory, library):
        with build_lock(directory / LOCK_FILE, logger, tag) as locked:
            if not _complete(directory, library):  # else another process built it while this one waited
                if locked:
                    # Nobody else builds here while this process holds the lock: a marker file of
                    # torch's is a leftover of a killed build, on which torch would wait forever.
                    (directory / "lock").unlink(missing_ok=True)
                copy = directory / Path(source).name
                shutil.copyfile(source, copy)
                logger.info("%s: building %s in %s (once per machine and source, ~10-60 s)", tag, what, directory)
                cpp_extension.load(name=library, sources=[str(copy)], extra_cflags=cflags, extra_ldflags=ldflags,
                                   build_directory=str(directory), is_python_module=False, verbose=False)
                (directory / STAMP_FILE).write_text(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} pid {os.getpid()}\n")
                logger.info("%s: built %s (CPU capability %s) in %.1f s", tag, library, cpu_capability(),
                            time.perf_counter() - started)
                return
    torch.ops.load_library(str(so))
    logger.debug("%s: loaded %s (CPU capability %s) in %.1f s", tag, so, cpu_capability(),
                 time.perf_counter() - started)


def attempt(build_op, reason: str | None = None, logger: logging.Logger | None = None,
            consequence: str = "backends that need it are passed over"):
    """``(op, None)`` from ``build_op()``, or ``(None, why)``: ``reason`` where the caller
    already knows the op cannot run here, the missing tools, or the build's failure in
    one line (compiler errors arrive as long RuntimeErrors). Where this machine could run
    the op but cannot build it, ``logger`` says so once at INFO (the start's details,
    which name the backends passed over, are at DEBUG)."""
    if reason:
        return None, reason
    missing = missing_tools()
    if missing:
        why = "; ".join(missing)
    else:
        try:
            return build_op(), None
        except BuildLockTimeout as e:
            why = str(e)
        except Exception as e:  # noqa: BLE001 - RuntimeError / CalledProcessError from the compiler, or any other
            text = str(e).strip().splitlines()
            why = f"building the C++ op failed: {text[-1] if text else type(e).__name__}"
    if logger is not None:
        logger.info("%s: C++ op unavailable, %s: %s", logger.name.rsplit(".", 1)[-1], consequence, why)
    return None, why


_load_locks: dict[str, threading.Lock] = {}  # op module name -> the lock around its first load
_load_locks_guard = threading.Lock()


def load_once(module, build_op, error: type[Exception], logger: logging.Logger,
              reason=None, consequence: str = "backends that need it are passed over"):
    """The op ``build_op()`` returns, built or loaded once per process (:func:`attempt`,
    ``reason`` and ``consequence`` as there; ``reason`` a callable, asked on the first
    attempt only). ``module`` (the op's ``ops`` module) remembers the outcome in its
    ``_op`` and ``_error`` globals, under a lock of its own: a failed build is not
    retried, and a test may reset either. Raises ``error(why)`` where the op is
    unavailable."""
    with _load_locks_guard:
        lock = _load_locks.setdefault(module.__name__, threading.Lock())
    with lock:
        if module._op is None and module._error is None:
            module._op, module._error = attempt(build_op, reason() if reason is not None else None, logger,
                                                consequence)
        if module._op is None:
            raise error(module._error)
        return module._op
