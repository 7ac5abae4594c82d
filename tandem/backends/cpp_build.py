"""Building tandem's C++ CPU ops (cpu_paged's decode attention, cpu_flash's bf16
encoder attention) with torch's C++-extension builder: the tools it needs, the
OpenMP flags, the cache check and the start-up log lines, shared by both ``ops``
modules. Each op module keeps its own variant choice, its own error class and
its remembered outcome."""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path

import torch


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


def build(name: str, source: Path, isa_flags: list[str], logger: logging.Logger, what: str) -> None:
    """Compile (or load the cached) ``source`` as library ``name``, registering its ops."""
    from torch.utils import cpp_extension

    cflags = ["-O3", *isa_flags]
    ldflags = []
    if torch.backends.openmp.is_available():
        # at::parallel_for is inlined into the op; with OpenMP it needs -fopenmp to run in
        # parallel. libgomp resolves to the copy torch already loaded (same soname).
        cflags.append("-fopenmp")
        ldflags.append("-fopenmp")
    try:
        cached = (Path(cpp_extension._get_build_directory(name, verbose=False)) / f"{name}.so").exists()
    except Exception:
        cached = False
    if not cached:
        logger.info("%s: building %s (once per machine, ~10-60 s)", logger.name.rsplit(".", 1)[-1], what)
    started = time.perf_counter()
    cpp_extension.load(name=name, sources=[str(source)], extra_cflags=cflags, extra_ldflags=ldflags,
                       is_python_module=False, verbose=False)
    logger.log(logging.DEBUG if cached else logging.INFO, "%s: loaded %s (CPU capability %s) in %.1f s",
               logger.name.rsplit(".", 1)[-1], name, cpu_capability(), time.perf_counter() - started)


def attempt(build_op, reason: str | None = None):
    """``(op, None)`` from ``build_op()``, or ``(None, why)``: ``reason`` where the caller
    already knows the op cannot run here, the missing tools, or the build's failure in
    one line (compiler errors arrive as long RuntimeErrors)."""
    if reason:
        return None, reason
    missing = missing_tools()
    if missing:
        return None, "; ".join(missing)
    try:
        return build_op(), None
    except Exception as e:  # noqa: BLE001 - RuntimeError / CalledProcessError from the compiler, or any other
        text = str(e).strip().splitlines()
        return None, f"building the C++ op failed: {text[-1] if text else type(e).__name__}"
