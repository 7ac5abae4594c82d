"""``topk.beam_topk``'s chunked top-k against the full top-k HF runs (the add over every
``[g, beams * vocab]`` value, then ``torch.topk``): values and indices bit for bit, on
random log-probs, on the first step's one row per request, and where ties, ``-inf``
and NaN make the chunked answer step aside for the full one."""

from __future__ import annotations

import pytest
import torch

from tandem.core.strategies.beam import topk as beam_topk_mod
from tandem.core.strategies.beam.topk import beam_topk, chunk_size


def _full(logp, running, keep, first):
    g, beams = running.shape
    per_beam = logp[:, None, :] if first else logp.view(g, beams, logp.shape[1])
    return torch.topk((per_beam + running[:, :, None]).view(g, -1), k=keep)


def _check(logp, running, keep, first, size):
    want_v, want_i = _full(logp, running, keep, first)
    got_v, got_i = beam_topk(logp, running, keep, first, size)
    assert torch.equal(got_v, want_v)
    assert torch.equal(got_i, want_i)


@pytest.mark.parametrize("vocab,beams,keep", [(2000, 4, 8), (2000, 5, 10), (32128, 4, 8), (4096, 2, 4), (51865, 3, 6)])
@pytest.mark.parametrize("first", [False, True])
def test_chunked_topk_equals_the_full_one(vocab, beams, keep, first):
    g = torch.Generator().manual_seed(vocab + beams)
    size = chunk_size(vocab, beams, keep)
    assert size is not None and vocab % size == 0 and vocab // size >= 64
    reqs = 6
    logp = torch.log_softmax(torch.randn(reqs * (1 if first else beams), vocab, generator=g) * 3, dim=-1)
    if first:
        running = torch.tensor([[0.0] + [-1e9] * (beams - 1)] * reqs)
    else:
        running = -torch.rand(reqs, beams, generator=g) * 20
    _check(logp, running, keep, first, size)


def test_it_answers_alone_where_it_can_and_steps_aside_on_ties_inf_and_nan(monkeypatch):
    g = torch.Generator().manual_seed(3)
    vocab, beams, keep = 2000, 4, 8
    size = chunk_size(vocab, beams, keep)
    calls = []
    real = beam_topk_mod._chunked

    def spy(*a):
        out = real(*a)
        calls.append(out[2].tolist())  # per request: answered by the chunks
        return out

    monkeypatch.setattr(beam_topk_mod, "_chunked", spy)
    base = torch.log_softmax(torch.randn(2 * beams, vocab, generator=g) * 3, dim=-1)
    running = -torch.rand(2, beams, generator=g) * 5
    _check(base, running, keep, False, size)
    assert calls == [[True, True]]

    # A tie among the winners (the same value at two tokens of one beam).
    tied = base.clone()
    best = tied[0].argmax()
    tied[0, (best + 1) % vocab] = tied[0, best]
    # -inf everywhere but a few tokens: the winners' tail is a tie of -inf.
    sparse = torch.full_like(base, float("-inf"))
    sparse[:, :1] = base[:, :1]
    # A NaN, which torch.topk ranks first.
    nan = base.clone()
    nan[5, 17] = float("nan")
    # Equal chunk maxima at the chunk ranking's boundary (every chunk's best the same).
    flat = base.clone().view(2 * beams, size, vocab // size)
    flat[:, 0] = -1.0
    for logp, want in ((tied, [[False, True]]), (sparse, [[False, False]]),
                       (flat.view(2 * beams, vocab), [[False, False]])):
        calls.clear()
        _check(logp, running, keep, False, size)
        assert calls == want
    calls.clear()
    want_v, want_i = _full(nan, running, keep, False)
    got_v, got_i = beam_topk(nan, running, keep, False, size)
    assert torch.equal(got_i, want_i) and torch.equal(got_v.isnan(), want_v.isnan())
    assert calls == [[True, False]]


def test_small_vocabularies_take_the_full_topk():
    assert chunk_size(300, 4, 8) is None
    assert chunk_size(2003, 4, 8) is None  # a prime: no chunk length divides it
    assert chunk_size(2000, 2, 300) is None  # too few chunks for that many candidates


@pytest.mark.parametrize("first", [False, True])
def test_many_requests_some_tied_equal_the_full_topk(first):
    g = torch.Generator().manual_seed(7)
    vocab, beams, keep, reqs = 2000, 4, 8, 40
    logp = torch.log_softmax(torch.randn(reqs * (1 if first else beams), vocab, generator=g), dim=-1)
    logp = (logp * 64).round() / 64  # a coarse grid: ties among the winners in some requests
    running = (-torch.rand(reqs, beams, generator=g) * 8 * 64).round() / 64
    if first:
        running[:, 0], running[:, 1:] = 0.0, -1e9
    size = chunk_size(vocab, beams, keep)
    answered = beam_topk_mod._chunked(logp, running, keep, first, size)[2]
    assert 0 < int(answered.sum()) < reqs  # some requests answered by the chunks, some by the full top-k
    _check(logp, running, keep, first, size)
