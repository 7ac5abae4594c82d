"""The scheduler's decode fast path (``BlockManager.append_in_place`` and, for all
running groups at once, ``append_in_place_all``: issues 40 and 49).

A running group whose sequences each compute one token into a block they alone
hold skips ``can_append_slots`` / ``append_slots``. The oracle is the general
path itself: the same requests run through the scheduler simulation of
``test_scheduler.py`` (which checks the refcount identities, the worker's tables
and the fake KV contents after every step) with the fast path and with it turned
off, and every step's ``SchedulerOutput`` and every sequence's tokens must be equal;
wherever the fast path answers, the general path is asked too and must find
nothing to allocate or copy.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools

import pytest
from hypothesis import given, settings

import test_scheduler as ts
from test_scheduler import DEV, SETTINGS, Spec, new_sim, scenarios, step_bound

from tandem.core.inputs import EncoderInputs
from tandem.core.kv.block_manager import BlockManager
from tandem.core.sampling_params import SamplingParams
from tandem.core.sequence import Sequence, SequenceGroup, SequenceStatus


def _run(scenario, monkeypatch, fast: bool):
    """Run ``scenario`` from fresh id and token counters; returns every step's output,
    the finished sequences' tokens and how often the fast path answered."""
    monkeypatch.setattr(ts, "_ids", itertools.count())
    monkeypatch.setattr(ts, "_tokens", itertools.count(10_000))
    sim = new_sim(*scenario)
    bm, outputs, taken = sim.bm, [], [0]
    general = bm.append_in_place_all  # append_in_place and the scheduler's steady pass both ask it

    def checked(groups, openers=None):
        found = general(groups, openers)
        for group, seqs, *_ in found.values():
            taken[0] += 1
            opening = (openers or {}).get(group.request_id, [])
            # The general path, asked the same, must find nothing to do but open the blocks
            # of the sequences listed as openers (one each; the scheduler gives them those
            # blocks, or sends the group down the general path).
            assert bm._append_need(group, DEV) == len(opening)
            if opening:
                assert all(len(s) == len(bm.get_block_table(s)) * bm.block_size + 1 for s in opening)
                continue
            assert bm.can_append_slots(group)
            tables = {s.seq_id: list(bm.get_block_table(s)) for s in group.seqs if bm.has_block_table(s)}
            refs = bm.pools[DEV].refcounts.copy()
            assert [c for s in seqs for c in bm.append_slots(s)] == []
            assert tables == {s.seq_id: list(bm.get_block_table(s)) for s in group.seqs if bm.has_block_table(s)}
            assert (bm.pools[DEV].refcounts == refs).all()
            assert seqs == group.get_seqs(SequenceStatus.RUNNING)
        return found

    bm.append_in_place_all = checked if fast else (lambda groups, openers=None: {})
    schedule = sim.sched.schedule

    def recorded():
        out = schedule()
        outputs.append(copy.deepcopy(out))  # the next schedule() may advance its records in place
        return out

    sim.sched.schedule = recorded
    specs = scenario[-1]
    sim.run(specs, step_bound(specs))
    sim.check_all_free()
    tokens = sorted((g.request_id, s.index, s.status.value, tuple(s.output_token_ids))
                    for g in sim.finished for s in g.seqs)
    return outputs, tokens, taken[0]


def _data(out) -> dict:
    """A step's output as plain values (``EncoderInputs`` compares by identity: its ids here)."""
    d = dataclasses.asdict(out)
    # Which groups the worker is told to look at differs by design (steady records are
    # left out); test_scheduler's simulation checks the groups left out hold still.
    del d["table_updates"]
    for g, sg in zip(d["scheduled"], out.scheduled):
        g["encoder_inputs"] = None if sg.encoder_inputs is None else sg.encoder_inputs.token_ids
    return d


def _same_runs(scenario, monkeypatch) -> int:
    fast_out, fast_tokens, taken = _run(scenario, monkeypatch, fast=True)
    slow_out, slow_tokens, none = _run(scenario, monkeypatch, fast=False)
    assert none == 0
    assert len(fast_out) == len(slow_out)
    for step, (a, b) in enumerate(zip(fast_out, slow_out)):
        assert _data(a) == _data(b), f"step {step}: the fast path's output differs from the general path's"
    assert fast_tokens == slow_tokens
    # Without steady records every group's tables are looked at.
    assert all(o.table_updates == list(range(len(o.scheduled))) for o in slow_out)
    return taken, fast_out


@settings(max_examples=150, **SETTINGS)
@given(scenarios())
def test_fast_path_steps_equal_the_general_paths(scenario):
    with pytest.MonkeyPatch.context() as mp:
        _same_runs(scenario, mp)


@settings(max_examples=100, **SETTINGS)
@given(scenarios(tiny=True, max_groups=6))
def test_fast_path_under_preemption_and_swaps_equals_the_general_path(scenario):
    with pytest.MonkeyPatch.context() as mp:
        _same_runs(scenario, mp)


def test_fast_path_serves_plain_decode_steps(monkeypatch):
    # Long outputs over 4-token blocks: most decode steps write into a block the
    # sequence already holds alone; a quarter open a block, which the steady path gives
    # them while the free blocks cover every opener (200 blocks here: always).
    cfg = ts.SchedulerConfig(8, 128, None)
    specs = [Spec(enc_len=5, prompt_len=2, n=1, max_tokens=40, targets=[40], arrival=0, doc=i) for i in range(4)]
    taken, outputs = _same_runs((cfg, 4, 200, 0, 0.0, specs), monkeypatch)
    assert taken == 4 * 39  # 4 groups x 39 decode steps, none on the general path
    # The worker looks at no group's tables in a step whose tokens all go into blocks
    # they hold (3 of 4 decode steps here), and only at the openers' in the others.
    decode_steps = [o for o in outputs if o.scheduled and all(len(s.token_ids) == 1 for g in o.scheduled
                                                                 for s in g.seqs)]
    assert sum(o.table_updates == [] for o in decode_steps) >= 3 * len(decode_steps) // 4 - 1
    for o in decode_steps:
        assert all(o.scheduled[i].seqs[0].block_ids for i in o.table_updates)


def _group(n: int, prompt: list[int]) -> SequenceGroup:
    seqs = [Sequence(100 + i, prompt, index=i) for i in range(n)]
    g = SequenceGroup("r", EncoderInputs.from_token_ids([1, 2, 3]), seqs, SamplingParams(n=n), 0.0)
    for s in seqs:
        s.status = SequenceStatus.RUNNING
    return g


def test_fast_path_declines_what_needs_blocks_or_copies():
    bm = BlockManager(4, 32, 0)
    g = _group(2, [5, 6, 7])  # n=2: the partly filled prompt block is shared
    bm.allocate(g)
    for s in g.seqs:
        s.num_computed_tokens = 3
        s.append_token(9, 0.0, None)
    # Both would write into the shared block: the general path copies it.
    assert bm.append_in_place(g) is None
    copies = [c for s in g.seqs for c in bm.append_slots(s)]
    assert len(copies) == 1  # the last writer keeps the original
    for s in g.seqs:
        s.num_computed_tokens = 4
        s.append_token(10, 0.0, None)
    # Position 4 opens a block neither holds yet.
    assert bm.append_in_place(g) is None
    assert [c for s in g.seqs for c in bm.append_slots(s)] == []
    for s in g.seqs:
        s.num_computed_tokens = 5
        s.append_token(11, 0.0, None)
    assert bm.append_in_place(g) == g.seqs  # each writes into its own block now
    g.seqs[0].lookahead_token_ids = [12]  # drafts: the general path sizes for them
    assert bm.append_in_place(g) is None
    g.seqs[0].lookahead_token_ids = []
    g.seqs[1].status = SequenceStatus.SWAPPED  # holds a table but does not run
    assert bm.append_in_place(g) is None
    assert not bm.accounting_errors()
