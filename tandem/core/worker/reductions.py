"""Row reductions over the vocabulary that the sampler runs every step.

:func:`argmax_rows` is ``x.argmax(dim=-1)`` for a ``[rows, vocab]`` tensor, with
the same answer bit for bit: the first index of each row's maximum, and the
first NaN where a row has one (torch's argmax counts NaN as the maximum).

Why not ``torch.argmax``: on CPU its reduction keeps an (index, value) pair per
lane and runs 4-5x slower than ``amax`` over the same data. Over bart-base's
vocabulary at 256 rows that was 8-15 ms a decode step on a 2-core AVX2 EPYC,
2-3% of a translation run. Here the row is cut into chunks; ``amax`` (which
vectorizes) finds each chunk's maximum, a tiny argmax over the chunk maxima
picks the first chunk that holds the row's maximum, and a plain argmax runs
over that one chunk only. Ties and NaN follow: an earlier chunk holding the
maximum (or a NaN) wins over a later one, and inside the chunk argmax's own
first-index rule decides.

On a CPU with a C++ compiler tandem's own op takes over
(``tandem/backends/cpu_sampling``: two vector passes a row, the maximum then its
first position, about the cost of ``amax`` alone: 256 rows x vocab 2,000 in 53 us
where the chunks take 345), installed (:func:`install_cpu_op`) by the cpu_paged
backend when it loads its decode op; every :func:`argmax_rows` call on a float32 CPU
tensor with contiguous rows then takes it, with the same answers
(``tests/core/test_reductions.py``).
"""

from __future__ import annotations

import torch

_cpu_op = None  # torch.ops.tandem_cpu_sampling.argmax_rows, once install_cpu_op() gave it


def install_cpu_op(op) -> None:
    """Make this process's :func:`argmax_rows` take ``op`` (``torch.ops.tandem_cpu_sampling.argmax_rows``)
    for float32 CPU rows. tandem's cpu_paged backend installs it when it loads its own
    op (``tandem/backends/cpu_sampling/ops.py``: the core imports no backend)."""
    global _cpu_op
    _cpu_op = op


# Columns per chunk: small enough that the final per-chunk argmax is cheap, large
# enough that the chunk-maxima tensor stays tiny (~100 chunks at vocab 50K).
ARGMAX_CHUNK = 512
# Smaller vocabularies get at least this many chunks, each of at least 64 columns: at
# vocab 2,000 and 256 rows, chunks of 125 took 0.34 ms where torch's argmax took 0.90.
MIN_CHUNKS = 16


def argmax_rows(x: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
    """``x.argmax(dim=-1)`` for 2-D ``x`` (int64 ``[rows]``), chunked on CPU."""
    if x.dim() != 2:
        raise ValueError(f"argmax_rows: x must be 2-D [rows, vocab], got shape {tuple(x.shape)}")
    rows, vocab = x.shape
    if (_cpu_op is not None and chunk is None and vocab and x.dtype == torch.float32 and x.device.type == "cpu"
            and x.stride(1) == 1):
        return _cpu_op(x)
    if chunk is None:
        chunk = max(64, min(ARGMAX_CHUNK, vocab // MIN_CHUNKS))
    n = vocab // chunk
    if x.device.type != "cpu" or n < 4 or rows == 0 or x.stride(1) != 1:
        return x.argmax(dim=-1)
    maxima = x[:, : n * chunk].view(rows, n, chunk).amax(dim=-1)
    if n * chunk < vocab:  # the tail, shorter than a chunk, is one more chunk
        maxima = torch.cat([maxima, x[:, n * chunk :].amax(dim=-1, keepdim=True)], dim=1)
    start = maxima.argmax(dim=-1) * chunk
    # Columns of the chosen chunk; past the row's end (tail chunk) they repeat the
    # last column, which sits after every real column, so the first index still wins.
    cols = (start[:, None] + torch.arange(chunk, device=x.device)).clamp_max_(vocab - 1)
    return start + x.gather(1, cols).argmax(dim=-1)
