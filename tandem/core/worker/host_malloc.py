"""Host allocator settings for CPU inference (``EngineConfig.cpu_malloc``).

PyTorch's CPU tensors come from the C library's ``malloc``. glibc serves every
block over its mmap threshold (at most 32 MiB) with a fresh ``mmap`` and hands
it back with ``munmap`` when freed, and trims freed memory at the top of its
heap back to the kernel. An engine step allocates the same large tensors every
time (bart-base, 256 sequences: 51 MiB of full-vocabulary logits per decode
step; a prefill's FFN activations run to hundreds of MiB), so each step the
kernel zero-fills those pages again on first touch: on a 2-core AVX2 EPYC a
fresh 51 MiB tensor took 29 ms to fill against 4.3 ms once freed memory was
kept, and on the translation workload of ``benchmarks/throughput.py`` tandem
went from 0.94x to 1.10x CTranslate2 fp32 and from 0.87x to 1.03x CT2 int8,
in the same runs (docs/performance.md).

:func:`keep_freed_memory` asks glibc (``mallopt``) to serve large blocks from
its heap and to keep freed memory mapped, as a caching allocator would:
``M_MMAP_MAX = 0`` and ``M_TRIM_THRESHOLD`` = 2 GiB. The process's resident
size then stays at its peak instead of shrinking between steps. It is a
process-wide setting, so it is skipped where someone has already chosen: a
jemalloc / tcmalloc / mimalloc in ``LD_PRELOAD``, or glibc's own
``MALLOC_MMAP_MAX_`` / ``MALLOC_TRIM_THRESHOLD_`` / ``GLIBC_TUNABLES``
environment settings; and it is a no-op off glibc (musl, macOS, Windows).
``cpu_malloc="system"`` leaves the allocator alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform

from tandem.core.config import check_choice

logger = logging.getLogger(__name__)

# <malloc.h>
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
# Trim threshold: hand freed heap memory back only past 2 GiB free at the top
# (mallopt takes an int, so this is its largest value).
_KEEP_BYTES = (1 << 31) - 1
_OTHER_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")
_ENV_SETTINGS = ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES")

_applied: str | None = None  # what an earlier call did: the setting is process-wide, made once


def _glibc():
    if platform.system() != "Linux":
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        version = libc.gnu_get_libc_version
    except (OSError, AttributeError):  # not glibc (musl has no gnu_get_libc_version)
        return None
    version.restype = ctypes.c_char_p
    libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    libc.mallopt.restype = ctypes.c_int
    return libc, version().decode()


def keep_freed_memory(mode: str = "auto", environ=os.environ) -> str:
    """Apply the setting for ``mode`` ("auto" or "system"); returns what was
    done, for the engine's start line."""
    global _applied
    if mode == "system":
        return "host malloc: system settings (cpu_malloc='system')"
    check_choice("cpu_malloc", mode)
    preload = environ.get("LD_PRELOAD", "")
    chosen = next((name for name in _OTHER_ALLOCATORS if name in preload), None)
    if chosen:
        return f"host malloc: {chosen} from LD_PRELOAD, left as it is"
    set_by_env = [name for name in _ENV_SETTINGS if environ.get(name)]
    if set_by_env:
        return f"host malloc: glibc as {', '.join(set_by_env)} set it"
    if _applied is not None:
        return _applied
    libc = _glibc()
    if libc is None:
        return "host malloc: system settings (not glibc)"
    lib, version = libc
    ok = lib.mallopt(_M_MMAP_MAX, 0) == 1 and lib.mallopt(_M_TRIM_THRESHOLD, _KEEP_BYTES) == 1
    if not ok:
        logger.warning("glibc %s refused mallopt(M_MMAP_MAX / M_TRIM_THRESHOLD); large tensors stay mmapped", version)
        _applied = f"host malloc: glibc {version} defaults (mallopt refused)"
    else:
        _applied = f"host malloc: glibc {version}, freed memory kept for reuse (cpu_malloc='auto')"
    return _applied
