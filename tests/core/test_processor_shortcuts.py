"""The processors' shortcuts for the usual step (issue 49): the grouping of rows by
params object (``_by_params``) checks one object for every row first, and must group
as a plain dict would; the EOS ban of rows short of ``min_tokens`` is one column write
when every row is short, and must leave what the row-by-row ban leaves.
"""

from __future__ import annotations

import random

import pytest
import torch

from tandem import SamplingParams
from tandem.core.worker.logits_processors import LogitsProcessors, ProcessorRows, _by_params


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
    torch.manual_seed(rows)
    eos = [2, 5]
    p = SamplingParams(temperature=0.0, max_tokens=20, min_tokens=4)
    scores = torch.randn(rows + 1, 50)
    every = LogitsProcessors(eos)(scores[:rows].clone(), ProcessorRows([p] * rows, [1] * rows, [3] * rows))
    some = LogitsProcessors(eos)(scores.clone(), ProcessorRows([p] * (rows + 1), [1] * rows + [4], [3] * (rows + 1)))
    want = scores.clone()
    want[:rows, eos] = float("-inf")
    assert torch.equal(every, want[:rows]) and torch.equal(some, want)
