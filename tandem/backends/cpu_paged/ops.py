"""Builds and loads ``torch.ops.tandem_cpu.paged_decode_attention`` and its KV write,
``torch.ops.tandem_cpu.write_slots`` (both in paged_decode.cpp).

The op is compiled on first use with torch's C++-extension builder (a C++
compiler and ninja are needed) and cached under ``$TORCH_EXTENSIONS_DIR``
(default ``~/.cache/torch_extensions``), one directory per source, flags and
torch version (``tandem.backends.cpp_build``, which also holds the build lock);
later processes load the cached library in milliseconds. The build targets the
CPU's vector ISA as torch reports it (``torch.backends.cpu.get_cpu_capability()``),
and that ISA is part of the library's name, so a cache shared by different
machines never hands an AVX-512 build to an AVX2 CPU.

:func:`load` returns the op, or raises :class:`CPUOpUnavailable` with the
reason; the outcome is remembered for the process, so a failed build is not
retried on every backend selection.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import torch

from tandem.backends import cpp_build

logger = logging.getLogger("tandem.backends.cpu_paged")

SOURCE = Path(__file__).with_name("paged_decode.cpp")

_ISA_FLAGS = cpp_build.ISA_FLAGS


class CPUOpUnavailable(RuntimeError):
    """The C++ op cannot be built or loaded here; the message says why."""


# The outcome of the first load, as cpp_build.load_once remembers it.
_op = None
_error: str | None = None


def cpu_capability() -> str:
    return cpp_build.cpu_capability()


def isa(capability: str | None = None) -> str:
    """The build variant for a torch CPU capability, this process's by default (``cpp_build.isa``)."""
    return cpp_build.isa(cpu_capability() if capability is None else capability)


def library_name(capability: str | None = None) -> str:
    """The extension's name for that variant; its cache directory and ``.so`` add the
    build key (``tandem_cpu_paged_avx2_<12 hex digits>``)."""
    return f"tandem_cpu_paged_{isa(capability)}"


def _build():
    capability = cpu_capability()
    cpp_build.build(library_name(capability), SOURCE, _ISA_FLAGS.get(capability, []), logger,
                    f"the C++ paged-attention op for {isa(capability)}")
    return torch.ops.tandem_cpu.paged_decode_attention


def load():
    """The compiled op; builds it on first use. Raises :class:`CPUOpUnavailable`."""
    return cpp_build.load_once(sys.modules[__name__], _build, CPUOpUnavailable, logger)


def available() -> bool:
    """Whether :func:`load` succeeds here (building the op if need be): a compiler and
    ninja are present *and* the build for this CPU's variant works."""
    try:
        load()
    except CPUOpUnavailable:
        return False
    return True
