"""Builds and loads ``torch.ops.tandem_cpu_sampling`` (row_argmax.cpp): ``argmax_rows``, the
greedy rows' argmax over the vocabulary; ``ban_repeated_ngrams`` and
``ban_repeated_ngrams_rows``, the ``no_repeat_ngram_size`` bans of a step's rows (from a
gathered history, or read in place from the worker's token histories); ``ban_tokens``, a
token list banned in every row.

Built on first use (a C++ compiler and ninja are needed) and cached under
``$TORCH_EXTENSIONS_DIR``, keyed by source, flags and torch version, for the CPU's
vector ISA as torch reports it (``cpp_build.isa``), as cpu_paged's op is. The sampler
loads it when its worker starts on a CPU (never in the middle of a step);
:func:`load` returns the op or raises :class:`CPUOpUnavailable` with the reason, and
the outcome is remembered for the process, so a failed build is not retried (the
sampler then takes torch's ops: ``tandem.core.worker.reductions``).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import torch

from tandem.backends import cpp_build

logger = logging.getLogger("tandem.backends.cpu_sampling")

SOURCE = Path(__file__).with_name("row_argmax.cpp")


class CPUOpUnavailable(RuntimeError):
    """The op cannot be built or loaded here; the message says why."""


# The outcome of the first load, as cpp_build.load_once remembers it.
_op = None
_error: str | None = None


def library_name(capability: str | None = None) -> str:
    """The extension's name for this CPU's variant (``tandem_cpu_sampling_avx512``, ...)."""
    return f"tandem_cpu_sampling_{cpp_build.isa(capability)}"


def _build():
    capability = cpp_build.cpu_capability()
    cpp_build.build(library_name(capability), SOURCE, cpp_build.ISA_FLAGS.get(capability, []), logger,
                    f"the sampler's C++ argmax op for {cpp_build.isa(capability)}")
    return torch.ops.tandem_cpu_sampling.argmax_rows


def load():
    """The compiled op; builds it on first use. Raises :class:`CPUOpUnavailable`."""
    return cpp_build.load_once(sys.modules[__name__], _build, CPUOpUnavailable, logger,
                               consequence="the sampler takes torch's ops")


def install() -> bool:
    """Load the ops (building them on first use) and make the sampler's ``argmax_rows`` and
    the processors' no-repeat n-gram and every-row token bans take them in this process;
    False where they cannot be built here (torch's ops serve)."""
    from tandem.core.worker.logits_processors import install_ngram_op, install_token_ban_op
    from tandem.core.worker.reductions import install_cpu_op

    try:
        install_cpu_op(load())
    except CPUOpUnavailable:
        return False
    ops = torch.ops.tandem_cpu_sampling
    install_ngram_op(ops.ban_repeated_ngrams, ops.ban_repeated_ngrams_rows)
    install_token_ban_op(ops.ban_tokens)
    return True
