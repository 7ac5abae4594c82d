"""HF's beam top-k (each beam's log-probs plus its running score, flattened over
``(beam, token)``, the best ``keep``) without the add and the top-k over every
``[g, beams * vocab]`` value.

Each beam row is cut into chunks of ``size`` tokens (strided: chunk ``c`` holds
tokens ``c, c + n, c + 2n, ...``, ``n = vocab / size``). A chunk's best accumulated
value is its best log-prob plus the beam's score (float rounding is monotonic, so
``max(x + r) == max(x) + r`` exactly); the best ``keep + 1`` values of a request lie
in its ``keep + 1`` chunks with the best maxima (a chunk holding one of them has at
most ``keep`` chunks with a strictly better maximum). So only those chunks' values
are added up (the same float32 adds) and ranked. Where neither the chunk ranking
nor the ``keep + 1`` values have a tie (nor a NaN) at a place that matters, there
is one right answer, and a full ``torch.topk`` returns it too, indices included;
for a request with a tie or a NaN there (and for vocabularies without a fitting
chunk size) the full top-k runs, so ties are broken as they always were.
``tests/core/test_beam_topk.py`` holds it to the full top-k.
"""

from __future__ import annotations

from functools import lru_cache

import torch

# Below this many values per request the full top-k is as cheap.
_MIN_VALUES = 4096
# Chunks are strided (a chunk of length L holds tokens c, c + n, c + 2n, ... of a beam
# row, n = vocab / L), so their maxima are one vectorised reduction over L rows of n;
# n of at least _MIN_CHUNKS keeps it vectorised.
_MAX_SIZE, _MIN_CHUNKS = 64, 64


@lru_cache(maxsize=64)
def chunk_size(vocab: int, num_beams: int, keep: int) -> int | None:
    """The chunk length for ``vocab`` (a divisor of it, balancing the chunk maxima's
    ranking against the candidates'), or None for the full top-k."""
    if num_beams * vocab < _MIN_VALUES:
        return None
    best, best_cost = None, None
    for size in range(2, _MAX_SIZE + 1):
        if vocab % size or vocab // size < _MIN_CHUNKS or num_beams * (vocab // size) < keep + 2:
            continue
        cost = num_beams * vocab // size + 2 * (keep + 1) * size
        if best_cost is None or cost < best_cost:
            best, best_cost = size, cost
    return best


def beam_topk(logp: torch.Tensor, running: torch.Tensor, keep: int, first: bool,
              size: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.topk((per_beam + running[:, :, None]).view(g, beams * vocab), keep)``:
    ``logp`` ``[g * beams, vocab]`` (``[g, vocab]`` when ``first``: one row stands for
    every beam of its request), ``running`` ``[g, beams]`` float32. Returns the values
    and the flat ``beam * vocab + token`` indices, ``[g, keep]`` each. ``size``:
    :func:`chunk_size`'s (None: the full top-k)."""
    if size is None or not logp.is_contiguous():
        return _full(logp, running, keep, first)
    values, flat, ok = _chunked(logp, running, keep, first, size)
    if not bool(ok.all()):  # requests with a tie or a NaN: their full top-k
        bad = (~ok).nonzero().view(-1)
        beams = running.shape[1]
        rows = bad if first else (bad[:, None] * beams + torch.arange(beams, device=bad.device)).view(-1)
        v, i = _full(logp.index_select(0, rows), running.index_select(0, bad), keep, first)
        values.index_copy_(0, bad, v)
        flat.index_copy_(0, bad, i)
    return values, flat


def _full(logp: torch.Tensor, running: torch.Tensor, keep: int, first: bool) -> tuple[torch.Tensor, torch.Tensor]:
    g, num_beams = running.shape
    vocab = logp.shape[1]
    per_beam = logp[:, None, :] if first else logp.view(g, num_beams, vocab)
    accumulated = (per_beam + running[:, :, None]).view(g, num_beams * vocab)
    return torch.topk(accumulated, k=keep)


def _chunked(logp: torch.Tensor, running: torch.Tensor, keep: int, first: bool,
             size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The chunked top-k (values, flat indices), and per request whether it can vouch
    for its answer (False on a tie or a NaN where it matters)."""
    g, num_beams = running.shape
    vocab = logp.shape[1]
    n, rows, m = vocab // size, 1 if first else num_beams, keep + 1
    # Chunk c of a row: its tokens c + i * n, i < size.
    best = (logp.view(g, rows, size, n).amax(dim=2) + running[:, :, None]).view(g, num_beams * n)
    chunk_best, chunk_ids = torch.topk(best, k=m + 1)  # [g, m + 1]
    chunk_ids = chunk_ids[:, :m]
    beam, chunk = chunk_ids // n, chunk_ids % n  # [g, m]
    row = torch.arange(g, device=logp.device)[:, None] * rows + (0 if first else beam)
    at = (row * vocab + chunk)[:, :, None] + torch.arange(0, size * n, n, device=logp.device)  # [g, m, size]
    values = (logp.take(at) + running.gather(1, beam)[:, :, None]).view(g, m * size)
    top, pos = torch.topk(values, k=m)  # [g, m]
    ok = (chunk_best[:, m - 1] > chunk_best[:, m]) & (top[:, :-1] > top[:, 1:]).all(dim=1)
    c = pos // size
    flat = beam.gather(1, c) * vocab + chunk.gather(1, c) + pos % size * n
    return top[:, :keep], flat[:, :keep], ok
