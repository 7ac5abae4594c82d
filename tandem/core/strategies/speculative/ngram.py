"""Prompt lookup: draft tokens copied from where the decoder's last tokens occurred before.

For a sequence whose decoder tokens end in ``t[-n:]`` (``n`` from
``prompt_lookup_max`` down to ``prompt_lookup_min``), the first place the same
``n`` tokens occur in the encoder input, else the latest earlier place they
occur in the decoder tokens themselves, gives the proposal: the up-to-``k``
tokens that followed there. Copy-heavy tasks (summaries, corrections, names and
numbers in translation) repeat source n-grams, and a looping decoder repeats its
own. No model runs: this is numpy over the token ids, on the scheduler's side.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def _first_match(source: np.ndarray, pattern: np.ndarray, limit: int, last: bool) -> int:
    """Index just past the first (``last``: the latest) occurrence of ``pattern`` in
    ``source[:limit]`` that has at least one token after it in ``source``; -1: none."""
    n = pattern.shape[0]
    if limit < n:
        return -1
    windows = sliding_window_view(source[:limit], n)  # [limit - n + 1, n], no copy
    hits = np.flatnonzero((windows == pattern).all(axis=1))
    if hits.size == 0:
        return -1
    end = int(hits[-1] if last else hits[0]) + n
    return end if end < source.shape[0] else -1


def propose(decoder: np.ndarray, encoder: np.ndarray | None, k: int, lookup_max: int, lookup_min: int) -> list[int]:
    """Up to ``k`` draft tokens for a sequence whose decoder tokens (prompt and output)
    are ``decoder``; ``encoder``: its encoder input token ids (None for features)."""
    length = decoder.shape[0]
    for n in range(min(lookup_max, length - 1), lookup_min - 1, -1):
        pattern = decoder[length - n:]
        if encoder is not None:
            end = _first_match(encoder, pattern, encoder.shape[0], last=False)
            if end >= 0:
                return encoder[end:end + k].tolist()
        # Earlier in the decoder tokens: a match ending before the suffix itself ends.
        end = _first_match(decoder, pattern, length - 1, last=True)
        if end >= 0:
            return decoder[end:end + k].tolist()
    return []
