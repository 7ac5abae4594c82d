"""Builds and loads ``torch.ops.tandem_cpu_flash.bf16_encoder_attention``
(encoder_attention.cpp), a flash-attention kernel for bfloat16 encoder runs on
the avx512_bf16 dot-product instruction.

Built on first use with torch's C++-extension builder (a C++ compiler and ninja
are needed) and cached under ``$TORCH_EXTENSIONS_DIR`` as cpu_paged's op is. There
is one variant, compiled with ``-mavx512bf16``: it is built and loaded only where
the CPU reports ``avx512_bf16`` (``/proc/cpuinfo``) and torch runs its AVX-512
kernels (``ATEN_CPU_CAPABILITY=avx2`` turns it off with them).

:func:`load` returns the op, or raises :class:`CPUOpUnavailable` with the reason;
the outcome is remembered for the process.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from pathlib import Path

import torch

logger = logging.getLogger("tandem.backends.cpu_flash")

SOURCE = Path(__file__).with_name("encoder_attention.cpp")
NAME = "tandem_cpu_flash_avx512bf16"
FLAGS = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mavx2", "-mfma"]

__all__ = ["CPUOpUnavailable", "load", "available", "unsupported_cpu"]



class CPUOpUnavailable(RuntimeError):
    """The op cannot be built or loaded here; the message says why. (Its own class, as
    cpu_paged's: importing that package imports torch_sdpa, which imports this one.)"""


def cpu_capability() -> str:
    try:
        return torch.backends.cpu.get_cpu_capability()
    except Exception:  # older or unusual builds
        return "DEFAULT"


_lock = threading.Lock()
_op = None
_error: str | None = None


def cpu_flags(path: str = "/proc/cpuinfo") -> set[str]:
    """The first processor's flags in ``path`` (empty where it cannot be read)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.partition(":")[2].split())
    except OSError:
        pass
    return set()


def unsupported_cpu(flags: set[str] | None = None, capability: str | None = None) -> str | None:
    """Why this CPU cannot run the op, or None where it can."""
    flags = cpu_flags() if flags is None else flags
    capability = cpu_capability() if capability is None else capability
    if "avx512_bf16" not in flags:
        return "the CPU lacks avx512_bf16 (no bf16 dot-product instruction)"
    if capability != "AVX512":
        return f"torch runs {capability} kernels here, not AVX512 (ATEN_CPU_CAPABILITY?)"
    return None


def _missing_tools() -> list[str]:
    from torch.utils import cpp_extension

    missing = []
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        missing.append(f"no C++ compiler ({cxx!r} is not on PATH; install g++ or set $CXX)")
    if not cpp_extension.is_ninja_available():
        missing.append("ninja is not installed (pip install ninja)")
    return missing


def _build():
    from torch.utils import cpp_extension

    cflags = ["-O3", *FLAGS]
    ldflags = []
    if torch.backends.openmp.is_available():  # at::parallel_for is inlined: see cpu_paged/ops.py
        cflags.append("-fopenmp")
        ldflags.append("-fopenmp")
    try:
        cached = (Path(cpp_extension._get_build_directory(NAME, verbose=False)) / f"{NAME}.so").exists()
    except Exception:
        cached = False
    if not cached:
        logger.info("cpu_flash: building the bf16 encoder-attention op (once per machine, ~10-60 s)")
    started = time.perf_counter()
    cpp_extension.load(name=NAME, sources=[str(SOURCE)], extra_cflags=cflags, extra_ldflags=ldflags,
                       is_python_module=False, verbose=False)
    logger.log(logging.DEBUG if cached else logging.INFO, "cpu_flash: loaded %s in %.1f s", NAME,
               time.perf_counter() - started)
    return torch.ops.tandem_cpu_flash.bf16_encoder_attention


def load():
    """The compiled op; builds it on first use. Raises :class:`CPUOpUnavailable`."""
    global _op, _error
    with _lock:
        if _op is None and _error is None:
            reason = unsupported_cpu()
            missing = [] if reason else _missing_tools()
            if reason or missing:
                _error = reason or "; ".join(missing)
            else:
                try:
                    _op = _build()
                except Exception as e:  # compiler errors arrive as RuntimeError/CalledProcessError
                    text = str(e).strip().splitlines()
                    _error = f"building the C++ op failed: {text[-1] if text else type(e).__name__}"
        if _op is None:
            raise CPUOpUnavailable(_error)
        return _op


def available() -> bool:
    """Whether :func:`load` succeeds here (building the op if need be)."""
    try:
        load()
    except CPUOpUnavailable:
        return False
    return True
