"""Property-based tests for ``tandem.core.block_manager``.

A hypothesis state machine drives one ``BlockManager`` through random
allocate / append / swap / free / reset sequences and, after every single
operation, compares it with an independent model kept here: which device each
group lives on and how many blocks each of its tables must hold.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from tandem.core.block_manager import (
    AllocStatus,
    BlockManager,
    BlockPool,
    Device,
    blocks_for,
)
from tandem.core.sampling_params import SamplingParams
from tandem.core.sequence import Sequence, SequenceGroup, SequenceStatus

_ids = itertools.count()


def ceil_div(a: int, b: int) -> int:
    return (a + b - 1) // b


def make_group(enc_len: int, prompt_lens: list[int]) -> SequenceGroup:
    rid = f"req-{next(_ids)}"
    enc = Sequence(next(_ids), list(range(enc_len)))
    seqs = [Sequence(next(_ids), [7] * p) for p in prompt_lens]
    return SequenceGroup(rid, enc, seqs, SamplingParams(n=len(prompt_lens)), 0.0)


# -- plain unit checks ---------------------------------------------------------


def test_blocks_for_is_ceil_div():
    for bs in range(1, 9):
        for n in range(0, 50):
            assert blocks_for(n, bs) == ceil_div(n, bs)


def test_pool_allocate_free_roundtrip():
    pool = BlockPool(5)
    a = pool.allocate(2)
    b = pool.allocate(3)
    assert sorted(a + b) == list(range(5))
    assert pool.num_free == 0
    with pytest.raises(RuntimeError):
        pool.allocate(1)
    pool.free(a)
    assert pool.num_free == 2
    assert pool.allocate(0) == []
    pool.reset()
    assert pool.free_ids() == list(range(5))


def test_allocate_twice_and_move_from_wrong_device_raise():
    bm = BlockManager(4, 16, 16, watermark=0.0)
    g = make_group(5, [3, 2])
    bm.allocate(g)
    with pytest.raises(RuntimeError):
        bm.allocate(g)
    with pytest.raises(RuntimeError):
        bm.swap_in(g)  # lives on the GPU
    bm.swap_out(g)
    with pytest.raises(RuntimeError):
        bm.swap_out(g)  # lives on the CPU
    bm.free_group(g)
    assert bm.num_free_blocks(Device.GPU) == 16
    assert bm.num_free_blocks(Device.CPU) == 16
    assert not bm.location


def test_group_blocks_counts_self_tables_after_free_cross():
    bm = BlockManager(2, 16, 0, watermark=0.0)
    g = make_group(3, [3, 1])  # cross 2, self 2 + 1
    bm.allocate(g)
    assert bm.group_blocks(g) == 5
    bm.free_cross(g)
    assert bm.group_blocks(g) == 3
    assert bm.num_free_blocks() == 16 - 3
    bm.free_group(g)
    assert bm.group_blocks(g) == 0
    assert bm.num_free_blocks() == 16


def test_swapped_group_fits_back_into_an_empty_pool():
    # A group that fills the whole pool must be able to come back once the pool
    # is empty; a flat "one spare block per sequence" rule would need 4 + 3 > 4.
    bm = BlockManager(8, 4, 8, watermark=0.0)
    g = make_group(8, [1, 1, 1])  # cross 1 + 3 x self 1
    bm.allocate(g)
    assert bm.num_free_blocks() == 0
    bm.swap_out(g)
    assert bm.num_free_blocks() == 4
    assert bm.can_swap_in(g)
    bm.swap_in(g)
    for s in g.seqs:
        bm.append_slots(s)
    assert bm.num_free_blocks() == 0
    # Tokens past the last block need room for one more block each.
    bm.swap_out(g)
    for s in g.seqs:
        for _ in range(8):
            s.append_token(5, 0.0, None)
    assert not bm.can_swap_in(g)  # 4 held + 3 new > 4
    bm.free_group(g)
    assert bm.num_free_blocks(Device.CPU) == 8


# -- the state machine ---------------------------------------------------------


class GroupModel:
    """What the test believes about one group: independent of the manager."""

    def __init__(self, group: SequenceGroup) -> None:
        self.group = group
        self.device: Device | None = None  # None: holds nothing
        self.cross: int | None = None  # expected cross-table length, None once freed
        self.selfs: dict[int, int] = {}  # seq_id -> expected self-table length

    def held(self) -> int:
        return (self.cross or 0) + sum(self.selfs.values())


def _idle(m: GroupModel) -> bool:
    return bool(m.device is None and not m.group.is_finished)


def _on_gpu_with_seqs(m: GroupModel) -> bool:
    return bool(m.device is Device.GPU and m.selfs)


def _swappable_out(m: GroupModel) -> bool:
    return bool(m.device is Device.GPU and m.cross)


def _swappable_in(m: GroupModel) -> bool:
    return bool(m.device is Device.CPU and m.cross)


def _has_seqs(m: GroupModel) -> bool:
    return bool(m.selfs)


def _has_cross(m: GroupModel) -> bool:
    return bool(m.cross)


def _holds_blocks(m: GroupModel) -> bool:
    return bool(m.device is not None)


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.bm: BlockManager | None = None
        self.groups: list[GroupModel] = []
        self.steps_since_reset = 0

    # -- setup -------------------------------------------------------------
    @initialize(
        block_size=st.integers(1, 8),
        gpu=st.integers(4, 64),
        cpu=st.integers(0, 64),
        watermark=st.sampled_from([0.0, 0.01, 0.05, 0.1, 0.25]),
    )
    def setup(self, block_size, gpu, cpu, watermark):
        self.bs = block_size
        self.gpu_total = gpu
        self.cpu_total = cpu
        self.bm = BlockManager(block_size, gpu, cpu, watermark=watermark)
        self.wm = self.bm.watermark_blocks
        assert self.wm == int(watermark * gpu)

    # -- helpers -----------------------------------------------------------
    def _any(self, pred) -> bool:
        return any(pred(m) for m in self.groups)

    def _pick(self, idx: int, pred) -> GroupModel:
        cands = [m for m in self.groups if pred(m)]
        assert cands, "precondition and pick disagree"
        return cands[idx % len(cands)]

    def _needed(self, m: GroupModel) -> int:
        g = m.group
        return ceil_div(g.encoder_len, self.bs) + sum(
            ceil_div(len(s), self.bs) for s in g.seqs if not s.finished
        )

    def _free(self, dev: Device) -> int:
        return self.bm.num_free_blocks(dev)

    def _tables_of(self, m: GroupModel) -> list[int]:
        blocks = list(self.bm.cross_tables.get(m.group.request_id, []))
        for s in m.group.seqs:
            blocks += self.bm.self_tables.get(s.seq_id, [])
        return blocks

    def _check_status(self, m: GroupModel) -> AllocStatus:
        needed = self._needed(m)
        assert self.bm.blocks_needed(m.group) == needed
        status = self.bm.can_allocate(m.group)
        free = self._free(Device.GPU)
        if needed > self.gpu_total - self.wm:
            assert status is AllocStatus.NEVER, (needed, self.gpu_total, self.wm, status)
        elif free - needed >= self.wm:
            assert status is AllocStatus.OK, (needed, free, self.wm, status)
        else:
            assert status is AllocStatus.LATER, (needed, free, self.wm, status)
        return status

    def _do_allocate(self, m: GroupModel) -> None:
        before = self._free(Device.GPU)
        if self._check_status(m) is not AllocStatus.OK:
            return
        self.bm.allocate(m.group)
        m.device = Device.GPU
        m.cross = ceil_div(m.group.encoder_len, self.bs)
        m.selfs = {
            s.seq_id: ceil_div(len(s), self.bs) for s in m.group.seqs if not s.finished
        }
        assert self._free(Device.GPU) == before - m.held()
        for s in m.group.unfinished_seqs():
            s.status = SequenceStatus.RUNNING

    # -- rules -------------------------------------------------------------
    @precondition(lambda self: sum(1 for m in self.groups if not m.group.is_finished) < 8)
    @rule(
        enc_len=st.integers(1, 40),
        prompt_lens=st.lists(st.integers(1, 10), min_size=1, max_size=3),
    )
    def add_group(self, enc_len, prompt_lens):
        m = GroupModel(make_group(enc_len, prompt_lens))
        self.groups.append(m)
        self._do_allocate(m)

    @precondition(lambda self: self._any(_idle))
    @rule(idx=st.integers(0, 1000))
    def reallocate(self, idx):
        """A group that holds nothing (never admitted or fully freed) tries again."""
        m = self._pick(idx, _idle)
        m.group.reset_for_recompute()
        self._do_allocate(m)

    @precondition(lambda self: self._any(_on_gpu_with_seqs))
    @rule(idx=st.integers(0, 1000), seq_idx=st.integers(0, 2), k=st.integers(1, 12))
    def append(self, idx, seq_idx, k):
        m = self._pick(idx, _on_gpu_with_seqs)
        live = [s for s in m.group.seqs if s.seq_id in m.selfs]
        seq = live[seq_idx % len(live)]
        for _ in range(k):
            seq.append_token(5, 0.0, None)
        need = sum(
            max(0, ceil_div(len(s), self.bs) - m.selfs[s.seq_id]) for s in live
        )
        free = self._free(Device.GPU)
        can = self.bm.can_append_slots(m.group)
        assert can == (need <= free), (need, free, can)
        if not can:
            return
        for s in live:
            self.bm.append_slots(s)
            m.selfs[s.seq_id] = max(m.selfs[s.seq_id], ceil_div(len(s), self.bs))
            assert len(self.bm.get_block_table(s)) >= ceil_div(len(s), self.bs)
        assert self._free(Device.GPU) == free - need

    def _swap(self, m: GroupModel, src: Device, dst: Device) -> None:
        g = m.group
        n = self.bm.group_blocks(g)
        assert n == m.held()
        old = self._tables_of(m)
        src_free, dst_free = self._free(src), self._free(dst)
        mapping = self.bm.swap_out(g) if dst is Device.CPU else self.bm.swap_in(g)
        new = self._tables_of(m)
        m.device = dst
        assert self._free(src) == src_free + n
        assert self._free(dst) == dst_free - n
        assert len(mapping) == n
        assert sorted(a for a, _ in mapping) == sorted(old)
        assert sorted(b for _, b in mapping) == sorted(new)
        assert len(set(a for a, _ in mapping)) == n
        assert len(set(b for _, b in mapping)) == n
        assert self.bm.location[g.request_id] is dst
        # Table shapes are preserved: each table maps position-by-position.
        src_to_dst = dict(mapping)
        assert [src_to_dst[a] for a in old] == new
        assert self.bm.group_blocks(g) == n

    @precondition(lambda self: self._any(_swappable_out))
    @rule(idx=st.integers(0, 1000))
    def swap_out(self, idx):
        m = self._pick(idx, _swappable_out)
        can = self.bm.can_swap_out(m.group)
        assert can == (m.held() <= self._free(Device.CPU))
        if not can:
            return
        self._swap(m, Device.GPU, Device.CPU)
        for s in m.group.get_seqs(SequenceStatus.RUNNING):
            s.status = SequenceStatus.SWAPPED

    @precondition(lambda self: self._any(_swappable_in))
    @rule(idx=st.integers(0, 1000))
    def swap_in(self, idx):
        self._swap_in(idx)

    # The same rule twice: swapped groups otherwise get freed before they come back.
    @precondition(lambda self: self._any(_swappable_in))
    @rule(idx=st.integers(0, 1000))
    def swap_in_again(self, idx):
        self._swap_in(idx)

    def _swap_in(self, idx):
        m = self._pick(idx, _swappable_in)
        live = [s for s in m.group.seqs if s.seq_id in m.selfs]
        # The blocks it holds plus those its sequences' pending tokens need.
        grow = sum(max(0, ceil_div(len(s), self.bs) - m.selfs[s.seq_id]) for s in live)
        can = self.bm.can_swap_in(m.group)
        assert can == (self._free(Device.GPU) - (m.held() + grow) >= self.wm)
        if not can:
            return
        self._swap(m, Device.CPU, Device.GPU)
        for s in m.group.get_seqs(SequenceStatus.SWAPPED):
            s.status = SequenceStatus.RUNNING
        # What the scheduler does right after a swap-in must then succeed.
        assert self.bm.can_append_slots(m.group)
        before = self._free(Device.GPU)
        for s in live:
            self.bm.append_slots(s)
            m.selfs[s.seq_id] = max(m.selfs[s.seq_id], ceil_div(len(s), self.bs))
        assert self._free(Device.GPU) == before - grow >= self.wm

    @precondition(lambda self: self._any(_has_seqs))
    @rule(idx=st.integers(0, 1000), seq_idx=st.integers(0, 2))
    def finish_seq(self, idx, seq_idx):
        m = self._pick(idx, _has_seqs)
        live = [s for s in m.group.seqs if s.seq_id in m.selfs]
        seq = live[seq_idx % len(live)]
        dev = m.device
        before = self._free(dev)
        seq.status = SequenceStatus.FINISHED_LENGTH
        self.bm.free(seq, m.group)
        assert self._free(dev) == before + m.selfs.pop(seq.seq_id)
        assert seq.seq_id not in self.bm.self_tables
        if not m.selfs and m.cross is None:
            m.device = None
        # Freeing again is a no-op.
        after = self._free(dev)
        self.bm.free(seq, m.group)
        assert self._free(dev) == after

    @precondition(lambda self: self._any(_has_cross))
    @rule(idx=st.integers(0, 1000), coin=st.integers(0, 3))
    def free_cross(self, idx, coin):
        # Rare on purpose: a group without its cross table can no longer swap.
        if coin != 3:
            return
        m = self._pick(idx, _has_cross)
        dev = m.device
        before = self._free(dev)
        self.bm.free_cross(m.group)
        assert self._free(dev) == before + m.cross
        m.cross = None
        if not m.selfs:
            m.device = None

    @precondition(lambda self: self._any(_holds_blocks))
    @rule(idx=st.integers(0, 1000))
    def free_group(self, idx):
        m = self._pick(idx, _holds_blocks)
        dev = m.device
        before = self._free(dev)
        other = Device.CPU if dev is Device.GPU else Device.GPU
        other_before = self._free(other)
        self.bm.free_group(m.group)
        assert self._free(dev) == before + m.held()
        assert self._free(other) == other_before
        m.device, m.cross, m.selfs = None, None, {}
        assert self.bm.group_blocks(m.group) == 0

    # Rare on purpose, or most runs would keep restarting from an empty pool.
    @precondition(lambda self: self.steps_since_reset >= 20)
    @rule()
    def reset(self):
        self.steps_since_reset = 0
        self.bm.reset()
        for m in self.groups:
            m.device, m.cross, m.selfs = None, None, {}
        self.groups = [m for m in self.groups if not m.group.is_finished]
        assert self._free(Device.GPU) == self.gpu_total
        assert self._free(Device.CPU) == self.cpu_total

    # -- invariants, checked after every step -------------------------------
    @invariant()
    def accounting(self):
        if self.bm is None:
            return
        self.steps_since_reset += 1
        bm = self.bm
        for dev, total in ((Device.GPU, self.gpu_total), (Device.CPU, self.cpu_total)):
            assert bm.num_total_blocks(dev) == total
            held = sum(m.held() for m in self.groups if m.device is dev)
            assert bm.num_free_blocks(dev) + held == total, (dev, bm.num_free_blocks(dev), held)
            free = bm.pools[dev].free_ids()
            assert len(free) == len(set(free)), f"duplicate ids in the {dev} free list"
            in_tables: list[int] = []
            for m in self.groups:
                if m.device is dev:
                    in_tables += self._tables_of(m)
            assert len(in_tables) == len(set(in_tables)), f"a {dev} block id is in two tables"
            assert not set(in_tables) & set(free), f"a {dev} block is both held and free"
            assert sorted(in_tables + free) == list(range(total))

    @invariant()
    def tables_match_model(self):
        if self.bm is None:
            return
        bm = self.bm
        live_rids = set()
        live_sids = set()
        for m in self.groups:
            g = m.group
            rid = g.request_id
            assert bm.location.get(rid) is m.device
            if m.cross is None:
                assert rid not in bm.cross_tables
            else:
                live_rids.add(rid)
                assert len(bm.get_cross_block_table(g)) == ceil_div(g.encoder_len, self.bs)
                assert len(bm.get_cross_block_table(g)) == m.cross
            for s in g.seqs:
                if s.seq_id in m.selfs:
                    live_sids.add(s.seq_id)
                    assert len(bm.get_block_table(s)) == m.selfs[s.seq_id]
                else:
                    assert s.seq_id not in bm.self_tables
            assert bm.group_blocks(g) == m.held()
        # Nothing the model does not know about (no leaks after free/reset).
        assert set(bm.cross_tables) == live_rids
        assert set(bm.self_tables) == live_sids
        assert set(bm.location) == {m.group.request_id for m in self.groups if m.device}


BlockManagerMachine.TestCase.settings = settings(
    max_examples=400,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow],
)
TestBlockManagerMachine = BlockManagerMachine.TestCase


# -- can_allocate NEVER boundary, directly ----------------------------------------


@settings(max_examples=300, deadline=None)
@given(
    block_size=st.integers(1, 8),
    gpu=st.integers(4, 64),
    watermark=st.sampled_from([0.0, 0.01, 0.1, 0.25, 0.5]),
    enc_len=st.integers(1, 40),
    prompt_lens=st.lists(st.integers(1, 10), min_size=1, max_size=3),
)
def test_can_allocate_never_iff_over_capacity(block_size, gpu, watermark, enc_len, prompt_lens):
    bm = BlockManager(block_size, gpu, 0, watermark=watermark)
    g = make_group(enc_len, prompt_lens)
    needed = ceil_div(enc_len, block_size) + sum(ceil_div(p, block_size) for p in prompt_lens)
    wm = int(watermark * gpu)
    status = bm.can_allocate(g)
    assert (status is AllocStatus.NEVER) == (needed > gpu - wm)
    if status is AllocStatus.OK:
        bm.allocate(g)
        assert bm.num_free_blocks() == gpu - needed
    else:
        # On an empty pool "not now" can only mean "never".
        assert status is AllocStatus.NEVER
        if needed > gpu:
            with pytest.raises(RuntimeError):
                bm.allocate(g)
        assert bm.num_free_blocks() == gpu


def test_cross_tables_take_consecutive_runs_and_self_blocks_the_low_end():
    pool = BlockPool(32)
    low = pool.allocate(3)
    assert low == [0, 1, 2]
    run = pool.allocate_run(5)
    assert run == list(range(27, 32))  # best fit is the only run: its top end
    pool.free(low[1:2])  # a hole of length 1 at id 1
    run2 = pool.allocate_run(1)
    assert run2 == [1]  # the smallest run that fits
    pool.free(run)
    assert pool.num_free == len(pool.free_ids()) == 32 - 3
    # No run long enough: fall back to scattered blocks, still exact accounting.
    full = BlockPool(6)
    a = full.allocate(6)
    full.free([a[0], a[2], a[4]])
    got = full.allocate_run(3)
    assert sorted(got) == [0, 2, 4] and full.num_free == 0
    with pytest.raises(RuntimeError, match="freed twice"):
        full.free([a[1]]) or full.free([a[1]])
