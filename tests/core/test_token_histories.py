"""The worker's token histories (``TokenHistories``, with the worker's own one-by-one path)
against a plain-Python oracle (a dict of token lists) over random step sequences: steady
decode runs (the fast path) broken by new sequences, forks sent with their prefix, rows
copied over others (beams), recomputes in full and in part, chunks of several tokens, a
token after rejected drafts (one token at a position before the row's end),
sequences left out for a while (swapped out) and back, rows reordered, and sequences
removed (finished, aborted). After every step each sequence's tokens, its length, and the
in-place view the processors read (every row, and subsets) equal the oracle's; the C++
n-gram op reading that view bans what HF's rule bans."""

import random
from types import SimpleNamespace

import pytest
import torch
from test_ngram_bans import _reference  # HF's rule written out

from tandem.core.scheduler_output import ScheduledSequence
from tandem.core.worker.token_histories import TokenHistories
from tandem.core.worker.worker import Worker


def _scheduled(seq_id, token_ids, num_computed, prefix=None):
    return ScheduledSequence(seq_id, list(token_ids), num_computed, [], False, 0, prefix_token_ids=prefix)


class _Driver:
    """Random steps: ``truth`` holds each live sequence's computed tokens (the oracle)."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.truth: dict[int, list[int]] = {}
        self.next_id = 0
        self.order: list[int] = []  # the steady run's sequences, in order

    def _tok(self):
        return self.rng.randrange(6)  # few ids: many repeated n-grams

    def new_id(self):
        self.next_id += 1
        return self.next_id

    def step(self, h: TokenHistories, worker) -> list:
        """One step's scheduled sequences, the truth updated; copies and removals applied to
        ``h`` as the worker applies them before its step."""
        rng, truth = self.rng, self.truth
        event = rng.random()
        if not self.order or event < 0.08:  # a new sequence: its prompt
            sid = self.new_id()
            truth[sid] = []
            self.order.append(sid)
        elif event < 0.12:  # a fork sent with its prefix (a sibling the worker has not seen)
            src = rng.choice(self.order)
            sid = self.new_id()
            truth[sid] = list(truth[src])
            self.order.insert(rng.randrange(len(self.order) + 1), sid)
        elif event < 0.16 and len(self.order) > 1:  # a row copied over another (beams)
            src, dst = rng.sample(self.order, 2)
            if src in h:
                worker._copy_seqs_histories([(src, dst)])
                truth[dst] = list(truth[src])
        elif event < 0.20:  # finished or aborted
            sid = self.order.pop(rng.randrange(len(self.order)))
            del truth[sid]
            h.remove(sid)
        elif event < 0.24:  # reordered
            rng.shuffle(self.order)
        elif event < 0.28 and len(self.order) > 1:  # left out this step (swapped out)
            out = rng.choice(self.order)
            return self._schedule([s for s in self.order if s != out], h)
        return self._schedule(self.order, h)

    def _schedule(self, seq_ids, h):
        rng, truth = self.rng, self.truth
        seqs = []
        for sid in seq_ids:
            toks = truth[sid]
            kind = rng.random()
            if sid not in h and toks:  # a fork: its computed tokens as the prefix
                new = [self._tok()]
                seqs.append(_scheduled(sid, new, len(toks), prefix=list(toks)))
            elif not toks:  # a prompt, one or several tokens
                new = [self._tok() for _ in range(rng.randint(1, 4))]
                seqs.append(_scheduled(sid, new, 0))
            elif kind < 0.03:  # recomputed in full, one more token
                new = toks + [self._tok()]
                seqs.append(_scheduled(sid, new, 0))
                truth[sid] = []
            elif kind < 0.06:  # recomputed from k on
                k = rng.randrange(len(toks) + 1)
                new = toks[k:] + [self._tok()]
                seqs.append(_scheduled(sid, new, k))
                truth[sid] = toks[:k]
            elif kind < 0.08:  # one token after rejected drafts: the row's tail is dropped
                k = rng.randrange(len(toks))
                new = [self._tok()]
                seqs.append(_scheduled(sid, new, k))
                truth[sid] = toks[:k]
            elif kind < 0.10:  # several tokens (a chunk, or verified drafts)
                new = [self._tok() for _ in range(rng.randint(2, 3))]
                seqs.append(_scheduled(sid, new, len(toks)))
            else:  # a plain decode
                new = [self._tok()]
                seqs.append(_scheduled(sid, new, len(toks)))
            truth[sid] = truth[sid] + new
        return seqs


class _Worker:
    """The worker's history methods over ``h`` (``Worker`` itself, unbound)."""

    def __init__(self, h):
        self.histories = h

    def record(self, seqs):
        Worker._record_histories(self, seqs)

    def _record_history(self, seq):
        Worker._record_history(self, seq)

    def _copy_seqs_histories(self, pairs):
        src, dst = zip(*pairs)
        self.histories.copy_rows(list(src), list(dst))


def _read(table, rows, lengths):
    return [table[r, :n].tolist() for r, n in zip(rows.tolist(), lengths.tolist())]


def _check(h, truth, seqs):
    for sid, toks in truth.items():
        if sid in h:
            assert h.get(sid) == toks
    ids = [s.seq_id for s in seqs]
    assert h.lengths(ids) == [len(truth[s]) for s in ids]
    lengths = [len(truth[s]) for s in ids]
    every = list(range(len(ids)))
    table, rows, lens = h.view(ids, lengths, every)
    assert _read(table, rows, lens) == [truth[s] for s in ids]
    some = every[::2]
    table, rows, lens = h.view(ids, lengths, some)
    assert _read(table, rows, lens) == [truth[ids[i]] for i in some]


@pytest.mark.parametrize("seed", range(8))
def test_histories_follow_the_oracle(seed):
    h = TokenHistories(2, 2)  # tiny: rows and columns grow on the way
    worker = _Worker(h)
    driver = _Driver(seed)
    fast = 0
    for _ in range(300):
        seqs = driver.step(h, worker)
        if not seqs:
            continue
        was = h._steady
        worker.record(seqs)
        fast += was is not None and h._steady is was
        _check(h, driver.truth, seqs)
    assert fast > 20  # the steady path ran (the test checks it, not only the general one)


def test_handed_out_lengths_keep_their_values():
    """A view's lengths tensor is not changed by the next steady record (the processors
    may still hold it)."""
    h = TokenHistories(4, 4)
    w = _Worker(h)
    w.record([_scheduled(1, [5, 6], 0), _scheduled(2, [7], 0)])
    _, _, lens = h.view([1, 2], [2, 1], [0, 1])
    w.record([_scheduled(1, [8], 2), _scheduled(2, [9], 1)])
    assert lens.tolist() == [2, 1]
    table, rows, lens = h.view([1, 2], [3, 2], [0, 1])
    assert _read(table, rows, lens) == [[5, 6, 8], [7, 9]]


def _hf_bans(scores, hists, n):
    return _reference(scores, dict(enumerate(hists)), n)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_ngram_op_reads_the_view(n):
    from tandem.backends.cpu_sampling import ops

    try:
        ops.load()
    except ops.CPUOpUnavailable as e:
        pytest.skip(f"the C++ ops cannot be built here: {e}")
    op = torch.ops.tandem_cpu_sampling.ban_repeated_ngrams_rows
    h = TokenHistories(2, 2)
    worker = _Worker(h)
    driver = _Driver(100 + n)
    for _ in range(120):
        seqs = driver.step(h, worker)
        if not seqs:
            continue
        worker.record(seqs)
        ids = [s.seq_id for s in seqs]
        hists = [driver.truth[s] for s in ids]
        table, rows, lens = h.view(ids, [len(t) for t in hists], list(range(len(ids))))
        scores = torch.randn(len(ids), 6)
        got = scores.clone()
        op(got, torch.arange(len(ids)), table, rows, lens, n)
        assert torch.equal(got, _hf_bans(scores, hists, n))
