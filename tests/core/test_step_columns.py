"""The worker's sampling rows read column by column (issue 49): ``Worker._rows`` takes
the usual step (one sequence a group, one row each, no mode) with ``map`` over
attribute getters and every other step row by row (``_rows_one_by_one``); both must
give the same columns. The processors' grouping by params object (``_by_params``)
checks one object for every row first; it must group as a plain dict would.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from tandem import SamplingParams
from tandem.core.scheduler_output import ScheduledGroup, ScheduledSequence, SchedulerOutput
from tandem.core.worker.logits_processors import _by_params
from tandem.core.worker.worker import Worker, _RequestState


class _Mode:
    def __init__(self, joint: bool) -> None:
        self.joint_rows = joint


def _step(rng: random.Random, plain: bool):
    """A scheduler output and the worker's request states: plain (one sequence a group,
    one row, no mode), or any mix of several sequences, verified drafts and modes."""
    shared = SamplingParams(temperature=0.0, max_tokens=50)
    states, groups, seq_id = {}, [], 0
    for g in range(rng.randint(1, 12)):
        rid = f"r{g}"
        p = shared if rng.random() < 0.7 else SamplingParams(temperature=0.0, max_tokens=rng.randint(5, 60))
        gen = torch.Generator().manual_seed(g) if rng.random() < 0.3 else None
        states[rid] = _RequestState(p, gen, keeps_history=rng.random() < 0.3)
        seqs = []
        for _ in range(1 if plain else rng.randint(1, 3)):
            computed = rng.randint(0, 40)
            logits = 1 if plain else rng.choice([1, 1, 3])
            tokens = [rng.randrange(100) for _ in range(logits if logits > 1 else rng.choice([1, 1, 4]))]
            seqs.append(ScheduledSequence(seq_id, tokens, computed, [], False, rng.randint(0, 20), None, logits))
            seq_id += 1
        mode = None if plain or rng.random() < 0.6 else _Mode(rng.random() < 0.5)
        groups.append(ScheduledGroup(rid, seqs, None, 8, [0], mode))
    return SchedulerOutput(groups, 0, [], []), states


@pytest.mark.parametrize("seed", range(60))
def test_columns_equal_the_row_by_row_ones(seed):
    rng = random.Random(seed)
    out, states = _step(rng, plain=seed % 2 == 0)
    worker = SimpleNamespace(requests=states, _rows_one_by_one=Worker._rows_one_by_one)
    got = Worker._rows(worker, out)
    want = Worker._rows_one_by_one(out.scheduled, [states[g.request_id] for g in out.scheduled])
    assert len(got) == len(want) == 9
    for a, b in zip(got, want):
        assert len(a) == len(b) and all(x is y or x == y for x, y in zip(a, b))


def test_both_row_paths_ran():
    plain, _ = _step(random.Random(0), plain=True)
    assert all(len(g.seqs) == 1 and g.mode is None and g.seqs[0].num_logits == 1 for g in plain.scheduled)
    mixed = [_step(random.Random(s), plain=False)[0] for s in range(1, 60, 2)]
    assert any(len(g.seqs) > 1 or g.mode is not None for o in mixed for g in o.scheduled)


@pytest.mark.parametrize("seed", range(40))
def test_rows_group_by_params_object_in_first_seen_order(seed):
    rng = random.Random(seed)
    objs = [SamplingParams(max_tokens=10) for _ in range(rng.randint(1, 4))]  # equal, distinct objects
    params = [rng.choice(objs) for _ in range(rng.randint(1, 30))]
    want: dict[int, tuple] = {}
    for i, p in enumerate(params):
        want.setdefault(id(p), (p, []))[1].append(i)
    got = _by_params(params)
    assert [(id(p), rows) for p, rows in got] == [(k, rows) for k, (_, rows) in want.items()]
    assert _by_params([]) == []


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_min_tokens_bans_eos_alike_on_every_row_and_on_some(rows):
    """Where every row is short of its ``min_tokens`` the EOS columns are banned in one
    write for all rows; where some row is not, row by row. Both leave the same scores."""
    from tandem.core.worker.logits_processors import LogitsProcessors, ProcessorRows

    torch.manual_seed(rows)
    eos = [2, 5]
    p = SamplingParams(temperature=0.0, max_tokens=20, min_tokens=4)
    scores = torch.randn(rows + 1, 50)
    every = LogitsProcessors(eos)(scores[:rows].clone(), ProcessorRows([p] * rows, [1] * rows, [3] * rows))
    some = LogitsProcessors(eos)(scores.clone(), ProcessorRows([p] * (rows + 1), [1] * rows + [4], [3] * (rows + 1)))
    want = scores.clone()
    want[:rows, eos] = float("-inf")
    assert torch.equal(every, want[:rows]) and torch.equal(some, want)
