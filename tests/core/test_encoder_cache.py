"""The encoder cache's block accounting (``tandem.core.kv.encoder_cache``).

A hypothesis state machine drives one ``BlockManager`` with the cache on
through random interleavings of admit / step / finish / abort (before or after
the group's first step) / preempt-by-recompute / swap, over groups whose
encoder inputs repeat. Next to it the test keeps a fake device cache (what
each slot of each block holds): the encoder's "K/V" is its input ids, written
only when the block manager says the encoder runs. After every operation:

- every device block is exactly one of free, kept by the cache, or held by a
  table; free + kept + distinct held = total, and ``num_free_blocks`` (what
  admission and preemption compare against) = free + kept;
- a block's refcount is the number of tables holding it, so a kept block
  (refcount 0) is in no table: a kept table is never handed to a request
  while kept;
- each kept table still holds the encoder ids of its key (nothing overwrote
  it), and every group whose encoder ran or was skipped reads its own
  encoder ids back through its cross table: a hit that skipped the encoder
  got the right K/V;
- the cache never holds more than its bound, and every eviction the pool sees
  is of blocks no table holds (checked on a wrapper of ``BlockPool.evict``).
"""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule

from tandem.core.kv.block_manager import AllocStatus, BlockManager

from tandem.core.kv.block_pool import BlockPool, Device
from tandem.core.inputs import EncoderInputs
from tandem.core.sampling_params import SamplingParams
from tandem.core.sequence import Sequence, SequenceGroup, SequenceStatus
from kv_machine import KVMachine, admission_as_before, live_seqs

_ids = itertools.count()
_tokens = itertools.count(10_000)
DEV, HOST = Device.DEVICE, Device.HOST


def make_group(encoder: list[int], prompt_len: int, n: int = 1) -> SequenceGroup:
    gid = next(_ids)
    prompt = [1_000_000 * (gid + 1) + i for i in range(prompt_len)]
    seqs = [Sequence(next(_ids), prompt) for _ in range(n)]
    return SequenceGroup(f"req-{gid}", EncoderInputs.from_token_ids(encoder), seqs, SamplingParams(n=n), 0.0)


def _run(g: SequenceGroup) -> None:
    """What the scheduler's update does after a step: the group's cross table is filled."""
    g.encoder_computed = True


# -- unit checks ---------------------------------------------------------------


def test_a_finished_table_is_kept_and_taken_back_without_the_encoder():
    bm = BlockManager(4, 16, 0, watermark=0.0, encoder_cache_blocks=None)
    a = make_group([7] * 9, 2)  # 3 cross blocks + 1 self block
    assert bm.allocate(a) is True
    cross = list(bm.get_cross_block_table(a))
    _run(a)
    bm.free_group(a)
    assert bm.num_cached_blocks() == 3 and bm.num_free_blocks() == 16
    assert all(bm.refcount(DEV, b) == 0 and bm.pools[DEV].is_kept(b) for b in cross)
    b = make_group([7] * 9, 5)
    assert bm.cross_is_cached(b) and bm.has_encoder_output(b) and not bm.cross_is_live(b)
    assert bm.blocks_needed(b, share_cross=True) == 3 + 2  # taking kept blocks uses them up
    assert bm.allocate(b) is False  # no encoder run
    assert bm.get_cross_block_table(b) == cross and bm.num_cached_blocks() == 0
    assert (bm.encoder_runs, bm.encoder_cache_hits, bm.encoder_live_shares) == (1, 1, 0)


def test_a_table_never_filled_is_not_kept():
    # Admitted, then aborted before its first step: its cross table holds garbage.
    bm = BlockManager(4, 16, 0, watermark=0.0, encoder_cache_blocks=None)
    a = make_group([7] * 9, 2)
    bm.allocate(a)
    bm.free_group(a)
    assert bm.num_cached_blocks() == 0 and bm.pools[DEV].num_free == 16
    assert bm.allocate(make_group([7] * 9, 2)) is True


def test_allocation_evicts_least_recently_kept_first():
    bm = BlockManager(4, 10, 0, watermark=0.0, encoder_cache_blocks=None)
    docs = [[d] * 8 for d in range(3)]  # 2 cross blocks each
    for d in docs:
        g = make_group(d, 4)  # + 1 self block
        bm.allocate(g)
        _run(g)
        bm.free_group(g)
    assert bm.num_cached_blocks() == 6 and bm.pools[DEV].num_free == 4
    # A hit on doc 0 makes it the most recently used once it is kept again.
    g0 = make_group(docs[0], 4)
    assert bm.allocate(g0) is False
    _run(g0)
    bm.free_group(g0)
    keys = list(bm.encoder_cache.tables())
    assert keys == [make_group(d, 1).encoder_key for d in (docs[1], docs[2], docs[0])]
    # 6 blocks: 4 free + the least recently used table (doc 1), not doc 2 or doc 0.
    big = make_group([9] * 12, 12)  # 3 cross + 3 self
    assert bm.can_allocate(big) is AllocStatus.OK
    assert bm.allocate(big) is True
    assert list(bm.encoder_cache.tables()) == keys[1:] and bm.encoder_cache.evictions == 1


def test_the_bound_evicts_to_fit_and_zero_turns_the_cache_off():
    bm = BlockManager(4, 32, 0, watermark=0.0, encoder_cache_blocks=4)
    for d in range(3):
        g = make_group([d] * 8, 1)
        bm.allocate(g)
        _run(g)
        bm.free_group(g)
        assert bm.num_cached_blocks() <= 4
    assert [k[1][0] for k in bm.encoder_cache.tables()] == [1, 2]
    too_big = make_group([5] * 20, 1)  # 5 cross blocks > the bound: freed, not kept
    bm.allocate(too_big)
    _run(too_big)
    bm.free_group(too_big)
    assert [k[1][0] for k in bm.encoder_cache.tables()] == [1, 2]
    off = BlockManager(4, 32, 0, encoder_cache_blocks=0)
    g = make_group([1] * 8, 1)
    off.allocate(g)
    _run(g)
    off.free_group(g)
    assert off.num_cached_blocks() == 0 and off.pools[DEV].num_free == 32


@pytest.mark.parametrize("bad", [-1, 1.5, "8", True])
def test_a_bad_bound_is_refused_naming_it(bad):
    with pytest.raises(ValueError, match=f"encoder_cache_blocks={bad!r}"):
        BlockManager(4, 8, 0, encoder_cache_blocks=bad)


def test_the_pool_refuses_to_evict_or_reuse_a_held_block():
    pool = BlockPool(4)
    held = pool.allocate(2)
    with pytest.raises(RuntimeError, match="not kept"):
        pool.evict(held)
    with pytest.raises(RuntimeError, match="not kept"):
        pool.reuse(held)
    pool.incref(held[:1])
    with pytest.raises(RuntimeError, match="cannot be kept"):
        pool.keep(held)  # held twice: another table still reads it
    pool.decref(held[:1])
    pool.keep(held)
    assert pool.num_free == 2 and pool.num_kept == 2 and pool.free_ids() == [2, 3]
    assert sorted(pool.allocate(2)) == [2, 3]  # kept blocks are never handed out
    with pytest.raises(RuntimeError):
        pool.allocate(1)
    with pytest.raises(RuntimeError, match="is free"):
        pool.incref(held)
    pool.evict(held)
    assert pool.num_free == 2 and pool.num_kept == 0 and sorted(pool.allocate(2)) == held


# -- the state machine ---------------------------------------------------------


class EncoderCacheMachine(KVMachine):
    def __init__(self) -> None:
        super().__init__()  # cache: block -> slot -> token
        self.evicted_blocks = 0
        # Groups holding a cross table whose encoder has not run yet: it runs (the
        # fake writes the ids) in the first step of any of them, as in the engine,
        # where the creator and the sharers admitted with it run one forward.
        self.pending: set[str] = set()

    @initialize(
        block_size=st.integers(1, 6),
        gpu=st.integers(6, 48),
        cpu=st.integers(0, 32),
        watermark=st.sampled_from([0.0, 0.05, 0.2]),
        bound=st.sampled_from([None, None, 0, 1, 3, 8, 20]),
    )
    def setup(self, block_size, gpu, cpu, watermark, bound):
        self.bs = block_size
        self.bm = BlockManager(block_size, gpu, cpu, watermark=watermark, encoder_cache_blocks=bound)
        self.bound = gpu if bound is None else min(bound, gpu)

        def count(blocks):
            self.evicted_blocks += len(blocks)

        self._check_evictions(count)

    # -- helpers -----------------------------------------------------------
    def _write_encoder(self, g: SequenceGroup) -> None:
        table = self.bm.get_cross_block_table(g)
        for pos, tok in enumerate(g.encoder_inputs.token_ids):
            self.cache[DEV].setdefault(table[pos // self.bs], {})[pos % self.bs] = tok

    def _holders(self, g: SequenceGroup) -> list[SequenceGroup]:
        bm, dev = self.bm, self.bm.cross_device(g)
        table = bm.get_cross_block_table(g)
        return [h for h in self.groups if bm.cross_device(h) is dev and bm.get_cross_block_table(h) == table]

    def _forward(self, g: SequenceGroup) -> None:
        bm, cache = self.bm, self.cache[DEV]
        holders = self._holders(g)
        if any(h.request_id in self.pending for h in holders):
            self._write_encoder(g)
            self.pending -= {h.request_id for h in holders}
        for s in live_seqs(g, bm):
            table = bm.get_block_table(s)
            for pos in range(s.num_computed_tokens, len(s)):
                cache.setdefault(table[pos // self.bs], {})[pos % self.bs] = s.token_ids[pos]
            s.num_computed_tokens = len(s)
            s.append_token(next(_tokens), 0.0, None)
        _run(g)

    def _try_allocate(self, g: SequenceGroup, run: bool) -> None:
        bm = self.bm
        live = any(h is not g and bm.cross_device(h) is DEV and h.encoder_key == g.encoder_key for h in self.groups)
        kept = g.encoder_key in bm.encoder_cache
        assert bm.cross_is_live(g) == live and bm.has_encoder_output(g) == (live or kept)
        status, free = bm.can_allocate(g), bm.num_free_blocks()
        needed = bm.blocks_needed(g, share_cross=True)
        # Kept blocks count as free: the cache never makes an admission wait.
        if bm.blocks_needed(g) <= bm.usable_blocks:
            assert status is (AllocStatus.OK if free - needed >= bm.watermark_blocks else AllocStatus.LATER)
        if status is not AllocStatus.OK:
            return
        kept_blocks = bm.encoder_cache.tables().get(g.encoder_key)
        assert bm.allocate(g, admission_as_before(bm, g)) is not (live or kept)
        assert bm.num_free_blocks() == free - needed
        if kept_blocks is not None and not live:
            assert bm.get_cross_block_table(g) == kept_blocks  # the hit got the kept table itself
        for s in g.unfinished_seqs():
            s.status = SequenceStatus.RUNNING
        if not (live or kept):
            self.pending.add(g.request_id)  # the encoder runs in the group's first step
        elif any(h.request_id in self.pending for h in self._holders(g)):
            self.pending.add(g.request_id)
        if run:
            self._forward(g)

    def _release(self, g: SequenceGroup) -> None:
        """free_group, checking what the cache must keep."""
        bm = self.bm
        cross = list(bm.get_cross_block_table(g)) if bm.cross_device(g) is not None else None
        last = cross is not None and not any(
            h is not g and bm.cross_device(h) is bm.cross_device(g) and bm.get_cross_block_table(h) == cross
            for h in self.groups
        )
        on_dev = bm.cross_device(g) is DEV
        other_live = any(
            h is not g and bm.cross_device(h) is DEV and h.encoder_key == g.encoder_key for h in self.groups
        )
        if g.request_id in self.pending:  # the table's other holders still wait for the encoder
            self.pending.discard(g.request_id)
            if not last:
                self.pending |= {h.request_id for h in self._holders(g) if h is not g}
        bm.free_group(g)
        if last and on_dev and g.encoder_computed and not other_live and len(cross) <= self.bound:
            assert bm.encoder_cache.tables().get(g.encoder_key) == cross
        if cross is not None and not g.encoder_computed and last and on_dev and g.encoder_key not in (
            bm.encoder_cache
        ):
            assert all(bm.refcount(DEV, b) == 0 and not bm.pools[DEV].is_kept(b) for b in cross)

    # -- rules -------------------------------------------------------------
    @precondition(lambda self: self.bm is not None and sum(not g.is_finished for g in self.groups) < 8)
    @rule(doc=st.integers(0, 2), enc_len=st.sampled_from([1, 5, 17]), prompt_len=st.integers(1, 8),
          n=st.integers(1, 2), run=st.booleans())
    def add_group(self, doc, enc_len, prompt_len, n, run):
        g = make_group([doc] * enc_len, prompt_len, n)
        self.groups.append(g)
        self._try_allocate(g, run)

    @precondition(lambda self: self.bm is not None and any(self._idle(g) for g in self.groups))
    @rule(idx=st.integers(0, 1000), run=st.booleans())
    def reallocate(self, idx, run):
        self._try_allocate(self._pick(idx, self._idle), run)

    @precondition(lambda self: self.bm is not None and any(live_seqs(g, self.bm) for g in self.groups
                                                           if self.bm.device_of(g) is DEV))
    @rule(idx=st.integers(0, 1000), extra=st.integers(0, 9))
    def step(self, idx, extra):
        bm = self.bm
        g = self._pick(idx, lambda g: bm.device_of(g) is DEV and live_seqs(g, bm))
        live = live_seqs(g, bm)
        for _ in range(extra):
            live[0].append_token(next(_tokens), 0.0, None)
        if not bm.can_append_slots(g):
            return
        pairs = [p for s in live for p in bm.append_slots(s)]
        self._copy(pairs, DEV, DEV)
        self._forward(g)

    @precondition(lambda self: self.bm is not None and any(self.bm.device_of(g) for g in self.groups))
    @rule(idx=st.integers(0, 1000), how=st.sampled_from(["finish", "abort", "recompute"]))
    def leave(self, idx, how):
        """The group finishes, is aborted, or is preempted to be recomputed."""
        g = self._pick(idx, lambda g: self.bm.device_of(g))
        if how != "recompute":
            for s in g.unfinished_seqs():
                s.status = SequenceStatus.FINISHED_STOPPED if how == "finish" else SequenceStatus.FINISHED_ABORTED
        self._release(g)
        if how == "recompute":
            g.reset_for_recompute()

    # -- invariants ----------------------------------------------------------
    @invariant()
    def free_kept_and_held_partition_the_pool(self):
        if self.bm is None:
            return
        bm, pool = self.bm, self.bm.pools[DEV]
        total = bm.num_total_blocks(DEV)
        held = Counter(b for t in bm.tables(DEV) for b in t)
        free, kept = set(pool.free_ids()), set(pool.kept_ids())
        assert not free & kept and not (free | kept) & held.keys()  # no block both free/kept and referenced
        assert len(free) + len(kept) + len(held) == total
        assert len(free) == pool.num_free and len(kept) == bm.num_cached_blocks() <= self.bound
        assert bm.num_free_blocks() == len(free) + len(kept)
        assert [bm.refcount(DEV, b) for b in range(total)] == [held[b] for b in range(total)]
        tables = bm.encoder_cache.tables()
        assert sorted(b for t in tables.values() for b in t) == sorted(kept)
        for host_dev in (HOST,):
            counts = Counter(b for t in bm.tables(host_dev) for b in t)
            n = bm.num_total_blocks(host_dev)
            assert [bm.refcount(host_dev, b) for b in range(n)] == [counts[b] for b in range(n)]
        for dev in Device:  # a free block's contents are garbage; a kept block's are not
            for b in [b for b in self.cache[dev] if bm.refcount(dev, b) == 0
                      and not (dev is DEV and pool.is_kept(b))]:
                del self.cache[dev][b]

    @invariant()
    def kept_and_held_cross_tables_read_back_their_encoder_ids(self):
        if self.bm is None:
            return
        bm = self.bm

        def read(table, n, dev=DEV):
            return [self.cache[dev].get(table[p // self.bs], {}).get(p % self.bs) for p in range(n)]

        for key, table in bm.encoder_cache.tables().items():
            ids = list(key[1])
            assert read(table, len(ids)) == ids, key
        for g in self.groups:
            dev = bm.cross_device(g)
            if dev is not None and g.encoder_computed:
                assert read(bm.get_cross_block_table(g), g.encoder_len, dev) == list(g.encoder_inputs.token_ids), g


EncoderCacheMachine.TestCase.settings = settings(
    max_examples=250,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow],
)
TestEncoderCacheMachine = EncoderCacheMachine.TestCase
TestEncoderCacheMachine.pytestmark = [pytest.mark.slow]
