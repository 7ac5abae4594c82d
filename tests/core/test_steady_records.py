"""The scheduler's steady decode path against the general one it stands in for.

``Scheduler._steady`` builds the step records of the usual decode step inline (no
Python call per group), and ``SamplingStrategy.update_all`` applies a plain group's
token inline: each writes out by hand what ``Scheduler._metadata``, and
``Sequence.append_token`` with ``Scheduler.check_stop``, do. These tests hold the
inline versions to the general ones, field by field (a record field the inline
builder forgot to set fails the comparison), over random requests, steps and stops.
``tests/core/test_scheduler.py`` runs whole scenarios (preemption, swaps, forks)
through both paths against a fake KV cache.
"""

from __future__ import annotations

import itertools
from collections import deque

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem.core.inputs import EncoderInputs
from tandem.core.kv.block_manager import BlockManager
from tandem.core.kv.block_pool import Device
from tandem.core.sampling_params import RequestOutputKind, SamplingParams
from tandem.core.sched.scheduler import Scheduler, SchedulerConfig
from tandem.core.scheduler_output import ModelRunnerOutput
from tandem.core.sequence import Sequence, SequenceGroup, SequenceStatus
from tandem.core.strategies.sampling import SamplingStrategy

_ids = itertools.count()
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow], max_examples=150)


def _group(enc_len: int, prompt_len: int, n: int, params: SamplingParams, doc: int = 0) -> SequenceGroup:
    gid = next(_ids)
    enc = EncoderInputs.from_token_ids([1000 * doc + i for i in range(enc_len)])
    seqs = [Sequence(next(_ids), [5 + i for i in range(prompt_len)], i) for i in range(n)]
    group = SequenceGroup(f"r{gid}", enc, seqs, params, 0.0)
    group.strategy = SamplingStrategy()
    return group


def _sample_all(sched: Scheduler, out, token: int = 11) -> ModelRunnerOutput:
    ids = [s.seq_id for g in out.scheduled for s in g.seqs]
    return ModelRunnerOutput(ids, [token] * len(ids), [-0.5] * len(ids), [None] * len(ids))


@settings(**SETTINGS)
@given(
    block_size=st.sampled_from([1, 2, 4, 16]),
    requests=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 9), st.integers(1, 3), st.integers(0, 2)),
                      min_size=1, max_size=6),
    steps=st.integers(0, 20),
    prefix_cache=st.booleans(),
)
def test_steady_records_equal_the_general_ones(block_size, requests, steps, prefix_cache):
    bm = BlockManager(block_size, 4096, 0, watermark=0.0, prefix_cache_blocks=64 if prefix_cache else 0)
    sched = Scheduler(SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=4096), bm, eos_token_ids=[2])
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    for enc_len, prompt_len, n, doc in requests:
        sched.add(_group(enc_len, prompt_len, n, params if n == 1 else params.replace(n=n), doc))
    for _ in range(steps):
        out = sched.schedule()
        sched.update_from_output(out, _sample_all(sched, out))
    sent_before = {sid: list(table) for sid, table in sched._sent_tables.items()}
    free_before = bm.num_free_blocks()
    records, in_place, _ = sched._steady(deque(sched.running))
    assert not set(records) & set(in_place)
    opened = 0
    for group in sched.running:
        rid = group.request_id
        seqs = bm.append_in_place(group)  # passes now for a sequence _steady gave a block
        if rid in records:
            # _metadata as the general path would have called it: against the worker's
            # tables as they were before _steady (which records the blocks it opened).
            for s in group.seqs:
                if s.seq_id in sent_before:
                    sched._sent_tables[s.seq_id] = list(sent_before[s.seq_id])
            assert records[rid] == sched._metadata(group, False, seqs)
            assert records[rid].seqs and not any(s.replace_blocks for s in records[rid].seqs)
            for s, rec in zip(seqs, records[rid].seqs):
                table = bm.get_block_table(s)
                if rec.block_ids:  # its token opened the table's last block, which it alone holds
                    assert rec.block_ids == table[-1:] and s.num_computed_tokens == (len(table) - 1) * block_size
                    assert bm.refcount(Device.DEVICE, table[-1]) == 1
                    opened += 1
        elif rid in in_place:
            assert [s.seq_id for s in in_place[rid]] == [s.seq_id for s in seqs]
        else:  # left to the general path (a block to copy, or one to open where the step cannot give it)
            assert seqs is None
    assert bm.num_free_blocks() == free_before - opened  # the opened blocks, and nothing else, were taken


def test_mid_block_decode_steps_are_all_steady():
    """Plain requests whose next token lands inside a block they hold alone: every one
    is recorded by the steady path, in the scheduler's order, and the step's records
    are those objects."""
    bm = BlockManager(16, 1024, 0, watermark=0.0)
    sched = Scheduler(SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=4096), bm, eos_token_ids=[2])
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    for i in range(12):
        sched.add(_group(3 + i, 2, 1 + i % 2, params if i % 2 == 0 else params.replace(n=2)))
    for _ in range(3):  # admission, then two decode steps
        out = sched.schedule()
        sched.update_from_output(out, _sample_all(sched, out))
    records, in_place, _ = sched._steady(deque(sched.running))
    assert list(records) == [g.request_id for g in sched.running] and not in_place
    out = sched.schedule()
    assert [id(g) for g in out.scheduled] == [id(records[g.request_id]) for g in out.scheduled] or all(
        g == records[g.request_id] for g in out.scheduled)
    assert [s.num_computed_tokens for g in out.scheduled for s in g.seqs] == [4] * 18


@settings(**SETTINGS)
@given(
    block_size=st.sampled_from([1, 2, 4, 16]),
    requests=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 9), st.integers(1, 2)), min_size=1, max_size=6),
    steps=st.integers(2, 30),
)
def test_records_advanced_in_place_equal_the_general_ones_every_step(block_size, requests, steps):
    """A group of one sequence gets its last step's record back, advanced in place:
    after every step's schedule() each record equals ``_metadata``'s, and records are
    reused (the same object as the last step's) on steps that follow a steady one."""
    bm = BlockManager(block_size, 4096, 0, watermark=0.0)
    sched = Scheduler(SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=4096), bm, eos_token_ids=[2])
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    for enc_len, prompt_len, n in requests:
        sched.add(_group(enc_len, prompt_len, n, params if n == 1 else params.replace(n=n)))
    for _ in range(steps):
        sent_before = {sid: list(table) for sid, table in sched._sent_tables.items()}
        out = sched.schedule()
        sent_after = dict(sched._sent_tables)
        for sg in out.scheduled:
            group = sched.groups[sg.request_id]
            # _metadata against the worker's tables as they were before this step.
            for s in group.seqs:
                sched._sent_tables.pop(s.seq_id, None)
                if s.seq_id in sent_before:
                    sched._sent_tables[s.seq_id] = list(sent_before[s.seq_id])
            seqs = [s for s in group.seqs if s.status is SequenceStatus.RUNNING]
            assert sg == sched._metadata(group, sg.run_encoder, seqs)
        sched._sent_tables.clear()
        sched._sent_tables.update(sent_after)
        sched.update_from_output(out, _sample_all(sched, out))
    # Whether records are reused at all depends on the steps being steady (a block opened
    # beside a group of two sequences takes the general path): test_records_are_reused_*
    # checks it where it must happen.


def test_records_are_reused_on_steps_that_follow_a_steady_one():
    bm = BlockManager(16, 1024, 0, watermark=0.0)
    sched = Scheduler(SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=4096), bm, eos_token_ids=[2])
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    for i in range(5):
        sched.add(_group(3 + i, 2, 1, params))
    last = None
    for step in range(6):  # admission, then mid-block decode steps (2 + step tokens of 16)
        out = sched.schedule()
        ids = {sg.request_id: id(sg) for sg in out.scheduled}
        if step >= 2:  # the step before was steady: each record is last step's object, advanced
            assert ids == last
        last = ids
        sched.update_from_output(out, _sample_all(sched, out))


class _Ops:
    """What ``update`` asks of the scheduler, the stop rule being the scheduler's own."""

    check_stop = Scheduler.check_stop

    def __init__(self, eos):
        self.eos_token_ids = frozenset(eos)
        self.released: list[str] = []

    def release_finished(self, group: SequenceGroup) -> None:
        self.released.append(group.request_id)


def _state(seq: Sequence):
    return (seq.token_ids, seq.output_token_ids, seq.num_computed_tokens, seq.status, seq.stop_reason,
            seq.cumulative_logprob, seq.output_logprobs)


def _result(res):
    if res is None:
        return None
    return (res.request_id, res.finished,
            [(d.index, d.new_token_ids, d.new_logprobs, d.cumulative_logprob, d.finish_reason, d.stop_reason, d.replace)
             for d in res.completions])


@settings(**SETTINGS)
@given(
    outputs=st.lists(st.integers(0, 9), max_size=6),
    token=st.integers(0, 9),
    eos=st.sets(st.integers(0, 9), max_size=2),
    stop_ids=st.lists(st.integers(0, 9), max_size=3),
    min_tokens=st.integers(0, 8),
    extra=st.integers(0, 3),
    ignore_eos=st.booleans(),
    kind=st.sampled_from(list(RequestOutputKind)),
    stop_strings=st.booleans(),
    logprobs=st.sampled_from([None, 0, 2]),
)
def test_inline_update_equals_append_token_and_check_stop(outputs, token, eos, stop_ids, min_tokens, extra,
                                                          ignore_eos, kind, stop_strings, logprobs):
    max_tokens = max(len(outputs) + 1, min_tokens) + extra
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=min_tokens, ignore_eos=ignore_eos,
                            stop_token_ids=stop_ids, output_kind=kind, stop=["zz"] if stop_strings else None,
                            logprobs=logprobs)
    top = None if logprobs is None else {token: -0.25}
    pairs = []
    for _ in range(2):
        g = _group(4, 2, 1, params)
        seq = g.seqs[0]
        for t in outputs:  # earlier steps
            seq.append_token(t, -0.5 if logprobs is not None else None, {t: -0.5} if logprobs is not None else None)
        seq.num_computed_tokens = len(seq.token_ids) - 1
        seq.status = SequenceStatus.RUNNING
        out = sched_out = _Sched(g, seq)
        pairs.append((g, sched_out, out))
    (ga, sa, _), (gb, sb, _) = pairs
    result = ModelRunnerOutput([ga.seqs[0].seq_id, gb.seqs[0].seq_id], [token, token],
                               [-0.25 if logprobs is not None else None] * 2, [top, top])
    rows = {ga.seqs[0].seq_id: 0, gb.seqs[0].seq_id: 1}
    ops_a, ops_b = _Ops(eos), _Ops(eos)
    (inline,) = SamplingStrategy.update_all(ops_a, [(ga, sa.record)], result, rows)
    general = gb.strategy.update(ops_b, gb, sb.record, result, rows)
    assert _state(ga.seqs[0]) == _state(gb.seqs[0])
    strip = lambda r: None if r is None else (r[1], r[2])  # noqa: E731 - request ids differ
    assert strip(_result(inline)) == strip(_result(general))
    assert len(ops_a.released) == len(ops_b.released)
    assert not result.failed_requests


class _Sched:
    """A one-sequence group's step record, as the scheduler would send it."""

    def __init__(self, group: SequenceGroup, seq: Sequence):
        from tandem.core.scheduler_output import ScheduledGroup, ScheduledSequence

        ss = ScheduledSequence(seq.seq_id, seq.token_ids[seq.num_computed_tokens:], seq.num_computed_tokens, [],
                               False, len(seq.output_token_ids))
        self.record = ScheduledGroup(group.request_id, [ss], None, 4, [0])


class _Broken:
    """Sampling params whose stop fields cannot be read (a fault inside the inline path)."""

    output_kind = RequestOutputKind.FINAL_ONLY
    logprobs = None

    def __getattr__(self, name):
        raise ArithmeticError(f"broken field {name}")


def test_a_fault_in_the_inline_update_fails_its_request_alone():
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, output_kind=RequestOutputKind.CUMULATIVE)
    groups = [_group(4, 2, 1, params) for _ in range(3)]
    groups[1].sampling_params = _Broken()
    items, ids = [], []
    for g in groups:
        seq = g.seqs[0]
        seq.status = SequenceStatus.RUNNING
        seq.num_computed_tokens = 1
        items.append((g, _Sched(g, seq).record))
        ids.append(seq.seq_id)
    result = ModelRunnerOutput(ids, [40, 41, 42], [None] * 3, [None] * 3)
    out = SamplingStrategy.update_all(_Ops([2]), items, result, {s: i for i, s in enumerate(ids)})
    assert list(result.failed_requests) == [groups[1].request_id]
    assert "ArithmeticError: broken field" in result.failed_requests[groups[1].request_id]
    assert out[1] is None
    assert [o.completions[0].new_token_ids for o in (out[0], out[2])] == [[40], [42]]
    assert [g.seqs[0].output_token_ids for g in (groups[0], groups[2])] == [[40], [42]]


def test_a_strategy_class_whose_update_all_raises_fails_its_run_alone():
    """``update_all`` must not raise; one that does (a third-party strategy's) fails the
    requests of its run, and the step's other runs are applied."""

    class Raising(SamplingStrategy):
        @classmethod
        def update_all(cls, ops, items, result, rows):
            raise RuntimeError("a batch hook that raises")

    bm = BlockManager(16, 256, 0, watermark=0.0)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=4096), bm, eos_token_ids=[2])
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    groups = [_group(5, 2, 1, params) for _ in range(4)]
    groups[1].strategy = groups[2].strategy = Raising()
    for g in groups:
        sched.add(g)
    out = sched.schedule()
    result = _sample_all(sched, out)
    sched.update_from_output(out, result)
    bad = {groups[1].request_id, groups[2].request_id}
    assert set(result.failed_requests) == bad
    assert all("RuntimeError: a batch hook that raises" in why for why in result.failed_requests.values())
    assert [len(g.seqs[0].output_token_ids) for g in groups] == [1, 0, 0, 1]

