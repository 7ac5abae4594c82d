"""Builds and loads ``torch.ops.tandem_cpu_flash.bf16_encoder_attention``
(encoder_attention.cpp), a flash-attention kernel for bfloat16 encoder runs on
the avx512_bf16 dot-product instruction.

Built on first use with torch's C++-extension builder (a C++ compiler and ninja
are needed) and cached under ``$TORCH_EXTENSIONS_DIR`` (keyed by source, flags and torch
version, under a lock a killed build cannot leave held) as cpu_paged's op is. There
is one variant, compiled with ``-mavx512bf16``: it is built and loaded only where
the CPU reports ``avx512_bf16`` (``/proc/cpuinfo``) and torch runs its AVX-512
kernels (``ATEN_CPU_CAPABILITY=avx2`` turns it off with them).

:func:`load` returns the op, or raises :class:`CPUOpUnavailable` with the reason;
the outcome is remembered for the process.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import torch

from tandem.backends import cpp_build

logger = logging.getLogger("tandem.backends.cpu_flash")

SOURCE = Path(__file__).with_name("encoder_attention.cpp")
NAME = "tandem_cpu_flash_avx512bf16"
FLAGS = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mavx2", "-mfma"]

__all__ = ["CPUOpUnavailable", "load", "available", "unsupported_cpu"]


class CPUOpUnavailable(RuntimeError):
    """The op cannot be built or loaded here; the message says why. (Its own class, as
    cpu_paged's: importing that package imports torch_sdpa, which imports this one.)"""


def cpu_capability() -> str:
    return cpp_build.cpu_capability()


# The outcome of the first load, as cpp_build.load_once remembers it.
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


def _build():
    cpp_build.build(NAME, SOURCE, FLAGS, logger, "the bf16 encoder-attention op")
    return torch.ops.tandem_cpu_flash.bf16_encoder_attention


def load():
    """The compiled op; builds it on first use. Raises :class:`CPUOpUnavailable`."""
    return cpp_build.load_once(sys.modules[__name__], _build, CPUOpUnavailable, logger, reason=unsupported_cpu)


def available() -> bool:
    """Whether :func:`load` succeeds here (building the op if need be)."""
    try:
        load()
    except CPUOpUnavailable:
        return False
    return True
