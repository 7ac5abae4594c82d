"""Property-based tests for ``tandem.core.kv.block_manager``.

A hypothesis state machine drives one ``BlockManager`` through random
allocate / step (append + copy-on-write) / fork / swap / free / recompute /
abort / reset sequences over groups that share encoder inputs and decoder
prompts. Next to it the test keeps a fake KV cache: what each slot of each
block holds. It applies the swap and copy pairs the manager returns and writes
every computed token where the tables say, so after every operation:

- on each device, ``refcount(block)`` = the number of tables holding it, and
  the free blocks (refcount 0) number ``num_free_blocks``;
- every sequence reads its computed tokens back through its table, and every
  group whose encoder ran (or was shared) reads its encoder ids back through
  its cross table: nothing was overwritten by a sharer, lost in a swap, or
  left uncopied.
"""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule

from tandem.core.kv.block_manager import AllocStatus, BlockManager

from tandem.core.kv.block_pool import BlockPool, Device, blocks_for
from tandem.core.inputs import EncoderInputs
from tandem.core.sampling_params import SamplingParams
from tandem.core.sequence import Sequence, SequenceGroup, SequenceStatus
from kv_machine import KVMachine, admission_as_before, live_seqs

_ids = itertools.count()
_tokens = itertools.count(10_000)  # every generated token is distinct: stale slots never match

DEV, HOST = Device.DEVICE, Device.HOST  # the device pool and the host swap pool


def make_group(encoder: list[int], prompt_len: int, n: int) -> SequenceGroup:
    gid = next(_ids)
    prompt = [1_000_000 * (gid + 1) + i for i in range(prompt_len)]
    enc = EncoderInputs.from_token_ids(encoder)
    seqs = [Sequence(next(_ids), prompt) for _ in range(n)]
    return SequenceGroup(f"req-{gid}", enc, seqs, SamplingParams(n=n), 0.0)


# -- plain unit checks ---------------------------------------------------------


def test_blocks_for_is_ceil_div():
    for bs in range(1, 9):
        for n in range(0, 50):
            assert blocks_for(n, bs) == -(-n // bs)


def test_pool_refcounts():
    pool = BlockPool(5)
    a = pool.allocate(2)
    b = pool.allocate(3)
    assert sorted(a + b) == list(range(5)) and pool.num_free == 0
    with pytest.raises(RuntimeError):
        pool.allocate(1)
    pool.incref(a + a[:1])
    assert [pool.refcount(x) for x in a] == [3, 2]
    pool.decref(a)
    assert pool.num_free == 0
    pool.decref(a, times=1)
    assert pool.num_free == 1 and pool.refcount(a[1]) == 0 and pool.free_ids() == [a[1]]
    with pytest.raises(RuntimeError, match="freed twice"):
        pool.decref([a[1]])
    assert pool.num_free == 1  # a failed decref changes nothing
    with pytest.raises(RuntimeError, match="is free"):
        pool.incref([a[1]])
    assert pool.allocate(0) == []
    pool.reset()
    assert pool.free_ids() == list(range(5))


def test_cross_tables_take_consecutive_runs_and_self_blocks_the_low_end():
    pool = BlockPool(32)
    low = pool.allocate(3)
    assert low == [0, 1, 2]
    run = pool.allocate_run(5)
    assert run == list(range(27, 32))  # best fit is the only run: its top end
    pool.free(low[1:2])  # a hole of length 1 at id 1
    assert pool.allocate_run(1) == [1]  # the smallest run that fits
    pool.free(run)
    assert pool.num_free == len(pool.free_ids()) == 32 - 3
    # No run long enough: fall back to scattered blocks, still exact accounting.
    full = BlockPool(6)
    a = full.allocate(6)
    full.free([a[0], a[2], a[4]])
    assert sorted(full.allocate_run(3)) == [0, 2, 4] and full.num_free == 0


def test_allocate_twice_and_move_from_wrong_device_raise():
    bm = BlockManager(4, 16, 16, watermark=0.0)
    g = make_group([1] * 5, 3, 2)
    bm.allocate(g)
    with pytest.raises(RuntimeError):
        bm.allocate(g)
    with pytest.raises(RuntimeError):
        bm.swap_in(g)  # lives on the device
    bm.swap_out(g)
    with pytest.raises(RuntimeError):
        bm.swap_out(g)  # lives on the host
    bm.free_group(g)
    assert bm.num_free_blocks(DEV) == 16 and bm.num_free_blocks(HOST) == 16
    assert bm.device_of(g) is None


def test_swapped_group_fits_back_into_an_empty_pool():
    # A group that fills the whole pool must be able to come back once the pool
    # is empty; a flat "one spare block per sequence" rule would need 4 + 3 > 4.
    bm = BlockManager(8, 4, 8, watermark=0.0)
    g = make_group([1] * 8, 1, 3)  # cross 1 + the shared prompt block
    bm.allocate(g)
    for s in g.seqs:
        s.num_computed_tokens = 1
        s.append_token(next(_tokens), 0.0, None)
    assert bm.can_append_slots(g)  # two copies of the shared block; the last keeps it
    for s in g.seqs:
        bm.append_slots(s)
    assert bm.num_free_blocks() == 0
    assert len(bm.swap_out(g)) == 4
    assert bm.num_free_blocks() == 4
    assert bm.can_swap_in(g)
    bm.swap_in(g)
    assert bm.can_append_slots(g)
    assert bm.num_free_blocks() == 0
    # Tokens past the last block need room for one more block each.
    bm.swap_out(g)
    for s in g.seqs:
        for _ in range(7):
            s.append_token(next(_tokens), 0.0, None)
    assert not bm.can_swap_in(g)  # 4 held + 3 new > 4
    bm.free_group(g)
    assert bm.num_free_blocks(HOST) == 8


@settings(max_examples=300, deadline=None)
@given(
    block_size=st.integers(1, 8),
    gpu=st.integers(4, 64),
    watermark=st.sampled_from([0.0, 0.01, 0.1, 0.25, 0.5]),
    enc_len=st.integers(1, 40),
    prompt_len=st.integers(1, 10),
    n=st.integers(1, 4),
)
def test_can_allocate_never_iff_over_capacity(block_size, gpu, watermark, enc_len, prompt_len, n):
    bm = BlockManager(block_size, gpu, 0, watermark=watermark)
    g = make_group([1] * enc_len, prompt_len, n)
    needed = blocks_for(enc_len, block_size) + blocks_for(prompt_len, block_size)  # prompt shared
    assert bm.blocks_needed(g) == needed
    at_full = blocks_for(prompt_len + 7, block_size) - prompt_len // block_size
    assert bm.blocks_needed(g, extra_tokens=7) == needed - blocks_for(prompt_len, block_size) + (
        prompt_len // block_size + n * at_full
    )
    wm = int(watermark * gpu)
    status = bm.can_allocate(g)
    assert (status is AllocStatus.NEVER) == (needed > gpu - wm)
    if status is AllocStatus.OK:
        bm.allocate(g)
        assert bm.num_free_blocks() == gpu - needed
    else:
        assert status is AllocStatus.NEVER  # on an empty pool "not now" means "never"
        if needed > gpu:
            with pytest.raises(RuntimeError):
                bm.allocate(g)
        assert bm.num_free_blocks() == gpu


# -- the state machine ---------------------------------------------------------


class BlockManagerMachine(KVMachine):
    def __init__(self) -> None:
        super().__init__()  # cache: block -> slot -> token
        self.enc_written: set[str] = set()  # groups whose cross table holds their encoder ids
        self.steps_since_reset = 0

    @initialize(
        block_size=st.integers(1, 8),
        gpu=st.integers(4, 64),
        cpu=st.integers(0, 64),
        watermark=st.sampled_from([0.0, 0.01, 0.05, 0.1, 0.25]),
    )
    def setup(self, block_size, gpu, cpu, watermark):
        self.bs = block_size
        self.bm = BlockManager(block_size, gpu, cpu, watermark=watermark)
        self.wm = self.bm.watermark_blocks
        assert self.wm == int(watermark * gpu)

    # -- helpers -----------------------------------------------------------
    def _where(self, pred) -> list[SequenceGroup]:
        return [g for g in self.groups if pred(g)]

    def _forward(self, g: SequenceGroup, run_encoder: bool) -> None:
        """Write what the model would into the cache, then sample one token per sequence."""
        bm, cache = self.bm, self.cache[DEV]
        if run_encoder:
            for pos, tok in enumerate(list(g.encoder_inputs.token_ids)):
                cache.setdefault(bm.get_cross_block_table(g)[pos // self.bs], {})[pos % self.bs] = tok
        for s in live_seqs(g, bm):
            table = bm.get_block_table(s)
            for pos in range(s.num_computed_tokens, len(s)):
                cache.setdefault(table[pos // self.bs], {})[pos % self.bs] = s.token_ids[pos]
            s.num_computed_tokens = len(s)
            s.append_token(next(_tokens), 0.0, None)
        self.enc_written.add(g.request_id)

    def _expected_append_need(self, g: SequenceGroup, device: Device) -> int:
        bm, need, writers = self.bm, 0, Counter()
        for s in live_seqs(g, bm):
            table = bm.get_block_table(s)
            need += max(0, blocks_for(len(s), self.bs) - len(table))
            if s.num_computed_tokens < len(s):
                first = s.num_computed_tokens // self.bs
                writers.update(b for b in table[first : blocks_for(len(s), self.bs)] if bm.refcount(device, b) > 1)
        return need + sum(min(w, bm.refcount(device, b) - 1) for b, w in writers.items())

    def _cross_moves(self, g: SequenceGroup, src: Device) -> bool:
        bm = self.bm
        if bm.cross_device(g) is not src:
            return False
        table = bm.get_cross_block_table(g)
        return src is HOST or not any(
            h is not g and bm.device_of(h) is DEV and bm.cross_device(h) is DEV
            and bm.get_cross_block_table(h) == table
            for h in self.groups
        )

    def _distinct_self(self, g: SequenceGroup) -> list[int]:
        return list(dict.fromkeys(b for s in live_seqs(g, self.bm) for b in self.bm.get_block_table(s)))

    def _try_allocate(self, g: SequenceGroup) -> None:
        bm = self.bm
        live_key = any(
            h is not g and bm.cross_device(h) is DEV and h.encoder_key == g.encoder_key for h in self.groups
        )
        assert bm.cross_is_live(g) == live_key
        seqs = g.unfinished_seqs()
        fresh = all(len(s) == len(s.prompt_token_ids) for s in seqs)
        prompt = len(seqs[0].prompt_token_ids)
        shared = blocks_for(prompt, self.bs) if fresh else prompt // self.bs
        own = sum(blocks_for(len(s), self.bs) - shared for s in seqs)
        cross = blocks_for(g.encoder_len, self.bs)
        assert bm.blocks_needed(g) == cross + shared + own
        needed = (0 if live_key else cross) + shared + own
        assert bm.blocks_needed(g, share_cross=True) == needed
        status, free = bm.can_allocate(g), bm.num_free_blocks()
        if cross + shared + own > bm.usable_blocks:
            assert status is AllocStatus.NEVER
        else:
            assert status is (AllocStatus.OK if free - needed >= self.wm else AllocStatus.LATER)
        if status is not AllocStatus.OK:
            return
        assert bm.allocate(g, admission_as_before(bm, g)) is (not live_key)
        assert bm.num_free_blocks() == free - needed
        tables = [bm.get_block_table(s) for s in seqs]
        assert all(len(t) == blocks_for(len(s), self.bs) for t, s in zip(tables, seqs))
        assert all(t[:shared] == tables[0][:shared] for t in tables)
        for s in seqs:
            s.status = SequenceStatus.RUNNING
        self._forward(g, run_encoder=not live_key)

    # -- rules -------------------------------------------------------------
    @precondition(lambda self: self.bm is not None and sum(not g.is_finished for g in self.groups) < 8)
    @rule(doc=st.integers(0, 2), enc_len=st.sampled_from([1, 5, 17]), prompt_len=st.integers(1, 10),
          n=st.integers(1, 3))
    def add_group(self, doc, enc_len, prompt_len, n):
        g = make_group([doc] * enc_len, prompt_len, n)
        self.groups.append(g)
        self._try_allocate(g)

    @precondition(lambda self: any(self._idle(g) for g in self.groups))
    @rule(idx=st.integers(0, 1000))
    def reallocate(self, idx):
        """A group that holds nothing (never admitted, or preempted by recompute) tries again."""
        self._try_allocate(self._pick(idx, self._idle))

    @precondition(lambda self: any(live_seqs(g, self.bm) for g in self._where(self._on(DEV))))
    @rule(idx=st.integers(0, 1000), extra=st.integers(0, 12), seq_idx=st.integers(0, 4))
    def step(self, idx, extra, seq_idx):
        """One scheduler step for a running group; ``extra`` more tokens for one sequence."""
        bm = self.bm
        g = self._pick(idx, lambda g: self.bm.device_of(g) is DEV and live_seqs(g, self.bm))
        live = live_seqs(g, bm)
        for _ in range(extra):
            live[seq_idx % len(live)].append_token(next(_tokens), 0.0, None)
        need, free = self._expected_append_need(g, DEV), bm.num_free_blocks()
        assert bm.can_append_slots(g) == (need <= free)
        if need > free:
            return
        pairs = [p for s in live for p in bm.append_slots(s)]
        assert bm.num_free_blocks() == free - need
        assert len({d for _, d in pairs}) == len(pairs)
        # Whatever the forward writes into is now the writer's alone.
        for s in live:
            table = bm.get_block_table(s)
            assert len(table) == blocks_for(len(s), self.bs)
            for b in table[s.num_computed_tokens // self.bs :]:
                assert bm.refcount(DEV, b) == 1
        self._copy(pairs, DEV, DEV)
        self._forward(g, run_encoder=False)

    @precondition(lambda self: any(live_seqs(g, self.bm) and len(g.seqs) < 5 for g in self.groups))
    @rule(idx=st.integers(0, 1000), seq_idx=st.integers(0, 4))
    def fork(self, idx, seq_idx):
        bm = self.bm
        g = self._pick(idx, lambda g: live_seqs(g, self.bm) and len(g.seqs) < 5)
        live = live_seqs(g, bm)
        parent = live[seq_idx % len(live)]
        child = Sequence(next(_ids), parent.prompt_token_ids)
        child.token_ids = list(parent.token_ids)
        child.output_token_ids = list(parent.output_token_ids)
        child.num_computed_tokens, child.status = parent.num_computed_tokens, parent.status
        g.seqs.append(child)
        free = bm.num_free_blocks(bm.device_of(g))
        bm.fork(parent, child)
        assert bm.get_block_table(child) == bm.get_block_table(parent)
        assert bm.num_free_blocks(bm.device_of(g)) == free

    @precondition(lambda self: any(live_seqs(g, self.bm) for g in self._where(self._on(DEV))))
    @rule(idx=st.integers(0, 1000), src_idx=st.integers(0, 4), dst_idx=st.integers(0, 4), new=st.booleans())
    def take_over(self, idx, src_idx, dst_idx, new):
        """A beam continuing another's hypothesis: one of the group's sequences (or a new
        one) takes another's place. The K/V copies it returns are applied at once: the
        worker runs them before anything else of the next step."""
        bm = self.bm
        g = self._pick(idx, lambda g: self.bm.device_of(g) is DEV and live_seqs(g, self.bm))
        live = live_seqs(g, bm)
        src = live[src_idx % len(live)]
        others = [s for s in live if s is not src]
        if new or not others:
            if len(g.seqs) >= 5:
                return
            dst = Sequence(next(_ids), src.prompt_token_ids)
            g.seqs.append(dst)
        else:
            dst = others[dst_idx % len(others)]
        src_table = list(bm.get_block_table(src))
        dst_old = list(bm.get_block_table(dst)) if bm.has_block_table(dst) else []
        free = bm.num_free_blocks()
        own = sum(bm.refcount(DEV, b) == dst_old.count(b) for b in set(dst_old))  # freed with dst's table
        [(table, n)], copies = bm.take_over([(src, dst)])
        dst.token_ids, dst.output_token_ids = list(src.token_ids), list(src.output_token_ids)
        dst.num_computed_tokens, dst.status = src.num_computed_tokens, src.status
        self._copy(copies, DEV, DEV)
        assert bm.get_block_table(src) == src_table  # the source is left as it was
        assert bm.get_block_table(dst) == table and len(table) == len(src_table)
        assert table[:n] == src_table[:n] and n >= min(src.num_computed_tokens // self.bs, len(src_table))
        if copies:  # the blocks past the shared ones are copies, dst's alone
            assert copies == list(zip(src_table[n:], table[n:]))
            assert all(bm.refcount(DEV, b) == 1 for b in table[n:])
        else:  # no partly filled block, or no room for its copy: shared
            assert table == src_table
        # Blocks: those only dst held are free again, one new block per copy.
        assert bm.num_free_blocks() == free + own - len(copies)

    def _swap(self, g: SequenceGroup, src: Device, dst: Device) -> None:
        bm = self.bm
        old_tables = {s.seq_id: list(bm.get_block_table(s)) for s in live_seqs(g, bm)}
        has_cross = bm.cross_device(g) is not None
        old_cross = list(bm.get_cross_block_table(g)) if has_cross else []
        moves = self._cross_moves(g, src)
        moved = len(self._distinct_self(g)) + (len(old_cross) if moves else 0)
        src_free, dst_free = bm.num_free_blocks(src), bm.num_free_blocks(dst)
        pairs = bm.swap_out(g) if dst is HOST else bm.swap_in(g)
        assert len(pairs) == moved
        assert len({a for a, _ in pairs}) == len({b for _, b in pairs}) == moved
        assert bm.num_free_blocks(src) == src_free + moved
        assert bm.num_free_blocks(dst) == dst_free - moved
        assert bm.device_of(g) is dst
        m = dict(pairs)
        for sid, t in old_tables.items():  # tables map position by position
            assert bm.get_block_table(next(s for s in g.seqs if s.seq_id == sid)) == [m[b] for b in t]
        if has_cross:
            new_cross = bm.get_cross_block_table(g)
            assert new_cross == ([m[b] for b in old_cross] if moves else old_cross)
        self._copy(pairs, src, dst)

    @precondition(lambda self: any(self._where(self._on(DEV))))
    @rule(idx=st.integers(0, 1000))
    def swap_out(self, idx):
        g = self._pick(idx, self._on(DEV))
        moved = len(self._distinct_self(g)) + (
            len(self.bm.get_cross_block_table(g)) if self._cross_moves(g, DEV) else 0
        )
        can = self.bm.can_swap_out(g)
        assert can == (moved <= self.bm.num_free_blocks(HOST))
        if can:
            self._swap(g, DEV, HOST)

    @precondition(lambda self: any(self._where(self._on(HOST))))
    @rule(idx=st.integers(0, 1000))
    def swap_in(self, idx):
        bm = self.bm
        g = self._pick(idx, self._on(HOST))
        moved = len(self._distinct_self(g)) + (len(bm.get_cross_block_table(g)) if self._cross_moves(g, HOST) else 0)
        need = moved + self._expected_append_need(g, HOST)
        can = bm.can_swap_in(g)
        assert can == (bm.num_free_blocks(DEV) - need >= self.wm)
        if can:
            self._swap(g, HOST, DEV)
            assert bm.can_append_slots(g)  # what the scheduler does next must succeed

    @precondition(lambda self: any(live_seqs(g, self.bm) for g in self.groups))
    @rule(idx=st.integers(0, 1000), seq_idx=st.integers(0, 4))
    def finish_seq(self, idx, seq_idx):
        bm = self.bm
        g = self._pick(idx, lambda g: live_seqs(g, self.bm))
        live = live_seqs(g, bm)
        seq = live[seq_idx % len(live)]
        seq.status = SequenceStatus.FINISHED_LENGTH
        bm.free(seq, g)
        assert not bm.has_block_table(seq)
        bm.free(seq, g)  # freeing again is a no-op

    @precondition(lambda self: any(self.bm.cross_device(g) for g in self.groups))
    @rule(idx=st.integers(0, 1000), coin=st.integers(0, 3))
    def free_cross(self, idx, coin):
        if coin != 3:  # rare: a group without its cross table cannot run
            return
        g = self._pick(idx, lambda g: self.bm.cross_device(g))
        self.bm.free_cross(g)
        self.enc_written.discard(g.request_id)
        assert self.bm.cross_device(g) is None

    @precondition(lambda self: any(self.bm.device_of(g) for g in self.groups))
    @rule(idx=st.integers(0, 1000), abort=st.booleans())
    def preempt_or_abort(self, idx, abort):
        g = self._pick(idx, lambda g: self.bm.device_of(g))
        self.bm.free_group(g)
        self.enc_written.discard(g.request_id)
        assert self.bm.device_of(g) is None and self.bm.group_blocks(g) == 0
        if abort:
            for s in g.unfinished_seqs():
                s.status = SequenceStatus.FINISHED_ABORTED
        else:
            g.reset_for_recompute()

    # Rare on purpose, or most runs would keep restarting from an empty pool.
    @precondition(lambda self: self.steps_since_reset >= 20)
    @rule()
    def reset(self):
        self.steps_since_reset = 0
        self.bm.reset()
        self.enc_written.clear()
        for g in self.groups:
            g.reset_for_recompute()
        self.groups = [g for g in self.groups if not g.is_finished]
        for dev in Device:
            assert self.bm.num_free_blocks(dev) == self.bm.num_total_blocks(dev)
            assert self.bm.tables(dev) == []

    # -- invariants, checked after every step -------------------------------
    @invariant()
    def refcounts_are_the_tables_holding_each_block(self):
        if self.bm is None:
            return
        self.steps_since_reset += 1
        bm = self.bm
        for dev in Device:
            total = bm.num_total_blocks(dev)
            counts = Counter(b for t in bm.tables(dev) for b in t)
            assert all(0 <= b < total for b in counts)
            refs = [bm.refcount(dev, b) for b in range(total)]
            assert refs == [counts[b] for b in range(total)], dev
            assert refs.count(0) == bm.num_free_blocks(dev)  # free + distinct held = total
            for b in [b for b in self.cache[dev] if refs[b] == 0]:
                del self.cache[dev][b]  # a free block's contents are garbage

    @invariant()
    def every_table_reads_back_what_was_written(self):
        if self.bm is None:
            return
        bm = self.bm
        for g in self.groups:
            dev = bm.device_of(g)
            for s in live_seqs(g, bm):
                table, cache = bm.get_block_table(s), self.cache[dev]
                assert blocks_for(s.num_computed_tokens, self.bs) <= len(table) <= blocks_for(len(s), self.bs)
                got = [cache.get(table[p // self.bs], {}).get(p % self.bs) for p in range(s.num_computed_tokens)]
                assert got == s.token_ids[: s.num_computed_tokens], (g, s)
            cross_dev = bm.cross_device(g)
            if cross_dev is not None and g.request_id in self.enc_written:
                table, cache = bm.get_cross_block_table(g), self.cache[cross_dev]
                got = [cache.get(table[p // self.bs], {}).get(p % self.bs) for p in range(g.encoder_len)]
                assert got == list(g.encoder_inputs.token_ids), g


BlockManagerMachine.TestCase.settings = settings(
    max_examples=400,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow],
)
TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.pytestmark = [pytest.mark.slow]
