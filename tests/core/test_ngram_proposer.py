"""The n-gram proposer against a plain-Python statement of its rule."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.core.strategies.speculative.ngram import propose


def oracle(decoder: list[int], encoder: list[int] | None, k: int, hi: int, lo: int) -> list[int]:
    """Longest suffix first (hi down to lo, shorter than the decoder): its first
    occurrence in the encoder with a token after it, else its latest occurrence in
    the decoder ending before the decoder's end; the up-to-k tokens after it."""
    for n in range(min(hi, len(decoder) - 1), lo - 1, -1):
        suffix = decoder[-n:]
        if encoder is not None:
            for i in range(len(encoder) - n):
                if encoder[i:i + n] == suffix:
                    return encoder[i + n:i + n + k]
        for i in range(len(decoder) - n - 1, -1, -1):
            if decoder[i:i + n] == suffix:
                return decoder[i + n:i + n + k]
    return []


def test_examples():
    enc = np.array([0, 7, 8, 9, 10, 11, 2])
    # "8 9" occurs in the encoder: the tokens after it are proposed.
    assert propose(np.array([2, 0, 8, 9]), enc, 3, 3, 1) == [10, 11, 2]
    # The longest suffix wins: "5 8" is nowhere, "8" is in the encoder.
    assert propose(np.array([2, 0, 5, 8]), enc, 2, 2, 1) == [9, 10]
    # prompt_lookup_min=2: a one-token match is not enough.
    assert propose(np.array([2, 0, 5, 8]), enc, 2, 2, 2) == []
    # The decoder's own history, latest occurrence: "4 6" followed by 3 last time.
    assert propose(np.array([2, 4, 6, 1, 4, 6, 3, 4, 6]), None, 2, 2, 2) == [3, 4]
    # A match at the very end of the encoder has nothing after it.
    assert propose(np.array([2, 11, 2]), enc, 2, 1, 1) == [11, 2]


@settings(max_examples=300, deadline=None)
@given(
    decoder=st.lists(st.integers(0, 5), min_size=1, max_size=30),
    encoder=st.none() | st.lists(st.integers(0, 5), min_size=0, max_size=30),
    k=st.integers(1, 5), hi=st.integers(1, 4), lo=st.integers(1, 4),
)
def test_matches_the_rule(decoder, encoder, k, hi, lo):
    lo = min(lo, hi)
    enc = None if encoder is None else np.array(encoder, dtype=np.int64)
    got = propose(np.array(decoder, dtype=np.int64), enc, k, hi, lo)
    assert got == oracle(decoder, encoder, k, hi, lo)
