"""The prefix cache's block accounting (``tandem.core.kv.prefix_cache``).

Unit checks of the chained keys, then a hypothesis state machine that drives one
``BlockManager`` with the prefix cache (and the encoder cache) on through random
interleavings of admit / step / fork (a beam) / finish / abort / preempt by
recompute / swap / a failed step, over groups whose encoder inputs and decoder
prompts share prefixes. Next to it the test keeps a fake device cache: the
"K/V" of decoder position ``p`` is what it depends on in the model, the encoder
input and the tokens up to ``p``, written only where a step computes it. After
every operation:

- free, kept (by either cache) and held blocks partition the pool and
  ``num_free_blocks`` = free + kept; a block's refcount is the number of tables
  holding it, so a kept block is in no table;
- every sequence reads back, for each computed position, the K/V of its own
  encoder input and tokens: a prefix hit got the right blocks, and no shared
  block was written by another sequence;
- every registered block (held or kept) holds the K/V its chained key names;
- evictions touch only blocks no table holds, and the cache keeps no more than
  its bound.
"""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule

from tandem.core.kv.block_manager import AllocStatus, BlockManager

from tandem.core.kv.block_pool import Device
from tandem.core.inputs import EncoderInputs
from tandem.core.sampling_params import SamplingParams
from tandem.core.sequence import Sequence, SequenceGroup, SequenceStatus
from tandem.core.strategies.sampling import SamplingStrategy
from kv_machine import KVMachine, admission_as_before, live_seqs

_ids = itertools.count()
DEV, HOST = Device.DEVICE, Device.HOST
DOCS = [[7] * 5, [8] * 5, [9] * 3]
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [1, 2, 3, 4, 11, 12], [20, 21, 22]]


def make_group(doc: list[int], prompt: list[int], n: int = 1) -> SequenceGroup:
    gid = next(_ids)
    seqs = [Sequence(next(_ids), prompt) for _ in range(n)]
    group = SequenceGroup(f"req-{gid}", EncoderInputs.from_token_ids(doc), seqs, SamplingParams(n=n), 0.0)
    group.strategy = SamplingStrategy()  # what the engine's modes give a plain request
    return group


def _run(bm: BlockManager, g: SequenceGroup) -> None:
    """A step of the group's live sequences: slots, then every new token computed."""
    for s in g.unfinished_seqs():
        if bm.has_block_table(s):
            bm.append_slots(s)
            s.num_computed_tokens = len(s)
    g.encoder_computed = True


# -- unit checks ---------------------------------------------------------------


def test_a_finished_prompt_s_full_blocks_are_kept_and_shared_by_the_next_request():
    bm = BlockManager(4, 32, 0, watermark=0.0, encoder_cache_blocks=0, prefix_cache_blocks=None)
    prompt = list(range(100, 110))  # 2 full blocks + 2 tokens
    a = make_group([5] * 4, prompt)
    bm.allocate(a)
    _run(bm, a)
    table = list(bm.get_block_table(a.seqs[0]))
    bm.free_group(a)
    assert bm.num_prefix_cached_blocks() == 2 and bm.num_free_blocks() == 32
    assert sorted(bm.prefix_cache.kept_blocks()) == sorted(table[:2])
    b = make_group([5] * 4, prompt[:9] + [999])  # the same 2 full blocks, another tail
    assert bm.num_prefix_hit_tokens(b) == 8
    assert bm.blocks_needed(b, share_cross=True) == 1 + 3  # kept blocks count: taking them uses them up
    bm.allocate(b)
    assert bm.get_block_table(b.seqs[0])[:2] == table[:2] and b.seqs[0].num_computed_tokens == 8
    assert bm.num_prefix_cached_blocks() == 0
    assert (bm.prefix_queried_tokens, bm.prefix_hit_tokens) == (20, 8)
    # Live: a third request shares the blocks b holds (refcount 2), which are not counted as
    # needed, as b's live cross table is not.
    c = make_group([5] * 4, prompt)
    assert bm.blocks_needed(c, share_cross=True) == 3 - 2
    bm.allocate(c)
    assert all(bm.refcount(DEV, blk) == 2 for blk in table[:2])


def test_the_same_prompt_over_another_encoder_input_never_matches():
    bm = BlockManager(4, 32, 0, watermark=0.0, prefix_cache_blocks=None)
    prompt = list(range(100, 109))
    a = make_group([5] * 4, prompt)
    bm.allocate(a)
    _run(bm, a)
    bm.free_group(a)
    assert bm.num_prefix_hit_tokens(make_group([5] * 4, prompt)) == 8
    assert bm.num_prefix_hit_tokens(make_group([6] * 4, prompt)) == 0
    assert bm.num_prefix_hit_tokens(make_group([5] * 4, [0] + prompt[1:])) == 0  # the chain breaks at block 0
    assert bm.num_prefix_hit_tokens(make_group([5] * 4, prompt[:4] + [0] + prompt[5:])) == 4


def test_at_least_one_prompt_token_is_left_to_compute():
    bm = BlockManager(4, 32, 0, watermark=0.0, prefix_cache_blocks=None)
    prompt = list(range(100, 108))  # exactly 2 full blocks
    a = make_group([5] * 4, prompt)
    bm.allocate(a)
    _run(bm, a)
    bm.free_group(a)
    b = make_group([5] * 4, prompt)
    assert bm.num_prefix_hit_tokens(b) == 4  # not 8: the last token's logits are needed
    bm.allocate(b)
    assert b.seqs[0].num_computed_tokens == 4 and b.seqs[0].num_new_tokens == 4


def test_the_bound_and_zero_turns_it_off():
    prompt = list(range(100, 113))  # 3 full blocks
    bm = BlockManager(4, 32, 0, watermark=0.0, prefix_cache_blocks=2)
    a = make_group([5] * 4, prompt)
    bm.allocate(a)
    _run(bm, a)
    bm.free_group(a)
    # The table's last blocks are evicted first: the first two stay matchable.
    assert bm.num_prefix_cached_blocks() == 2 and bm.prefix_cache.evictions == 1
    assert bm.num_prefix_hit_tokens(make_group([5] * 4, prompt)) == 8
    off = BlockManager(4, 32, 0, watermark=0.0, prefix_cache_blocks=0)
    a = make_group([5] * 4, prompt)
    off.allocate(a)
    _run(off, a)
    off.free_group(a)
    b = make_group([5] * 4, prompt)
    assert off.num_prefix_cached_blocks() == 0 and off.num_prefix_hit_tokens(b) == 0
    off.allocate(b)
    assert b.seqs[0].num_computed_tokens == 0 and off.prefix_queried_tokens == 0


@pytest.mark.parametrize("bad", [-1, 1.5, "8", True])
def test_a_bad_bound_is_refused_naming_it(bad):
    with pytest.raises(ValueError, match=f"prefix_cache_blocks={bad!r}"):
        BlockManager(4, 8, 0, prefix_cache_blocks=bad)


def test_eviction_takes_the_least_recently_kept_of_both_caches():
    bm = BlockManager(4, 12, 0, watermark=0.0, encoder_cache_blocks=None, prefix_cache_blocks=None)
    a = make_group([5] * 8, list(range(100, 109)))  # 2 cross + 3 self blocks, 2 of them full prompt blocks
    bm.allocate(a)
    _run(bm, a)
    bm.free_group(a)  # kept: its 2 prompt blocks, then its cross table
    b = make_group([6] * 4, [1])  # 1 cross + 1 self
    bm.allocate(b)
    _run(bm, b)
    bm.free_group(b)  # kept: its cross table
    assert (bm.num_prefix_cached_blocks(), bm.num_cached_blocks(), bm.pools[DEV].num_free) == (2, 3, 7)
    c = make_group([7] * 12, list(range(200, 204)))  # 3 cross + 1 self: fits in the free blocks
    bm.allocate(c)
    assert bm.prefix_cache.evictions == bm.encoder_cache.evictions == 0
    d = make_group([8] * 16, [1, 2])  # 4 cross + 1 self, 3 free: the 2 oldest kept go, a's prompt blocks
    bm.allocate(d)
    assert (bm.prefix_cache.evictions, bm.encoder_cache.evictions) == (2, 0)
    e = make_group([9] * 4, [1])  # 1 cross + 1 self, 1 free: then a's cross table
    bm.allocate(e)
    assert (bm.prefix_cache.evictions, bm.encoder_cache.evictions) == (2, 1)
    assert list(bm.encoder_cache.tables()) == [b.encoder_key]


def test_the_scheduler_charges_and_sends_only_the_tokens_left():
    from tandem.core.sched.scheduler import Scheduler, SchedulerConfig

    bm = BlockManager(4, 32, 0, watermark=0.0, prefix_cache_blocks=None)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), bm)
    prompt = list(range(100, 111))  # 2 full blocks + 3
    a = make_group([5] * 4, prompt)
    sched.add(a)
    first = sched.schedule()
    assert first.num_batched_tokens == 4 + 11 and first.scheduled[0].seqs[0].prefix_token_ids is None
    _run(bm, a)  # the step ran: a's prompt is computed (registered at its next append_slots)
    a.seqs[0].append_token(50, 0.0, None)
    b = make_group([5] * 4, prompt[:10] + [999, 998])
    sched.add(b)
    out = sched.schedule()
    sb = next(g for g in out.scheduled if g.request_id == b.request_id)
    # b shares a's live cross table (no encoder tokens) and its 2 prompt blocks.
    assert not sb.run_encoder and sb.seqs[0].num_computed_tokens == 8
    assert sb.seqs[0].token_ids == b.seqs[0].token_ids[8:] and sb.seqs[0].prefix_token_ids == prompt[:8]
    assert out.num_batched_tokens == 1 + 4  # a's decode token and b's 4 tokens past the cached blocks
    assert bm.get_block_table(b.seqs[0])[:2] == bm.get_block_table(a.seqs[0])[:2]


# -- the state machine ---------------------------------------------------------


class PrefixCacheMachine(KVMachine):
    def __init__(self) -> None:
        super().__init__()  # cache: block -> slot -> (encoder key, tokens up to the slot)
        self.hits = 0

    @initialize(
        block_size=st.integers(1, 4),
        gpu=st.integers(8, 48),
        cpu=st.integers(0, 32),
        watermark=st.sampled_from([0.0, 0.1]),
        bound=st.sampled_from([None, None, 1, 4, 12]),
        enc_bound=st.sampled_from([None, 0, 4]),
    )
    def setup(self, block_size, gpu, cpu, watermark, bound, enc_bound):
        self.bs = block_size
        self.bm = BlockManager(block_size, gpu, cpu, watermark=watermark, encoder_cache_blocks=enc_bound,
                               prefix_cache_blocks=bound)
        self.bound = gpu if bound is None else min(bound, gpu)
        self._check_evictions()

    # -- helpers -----------------------------------------------------------
    def _on(self, device: Device):
        return lambda g: self.bm.device_of(g) is device and bool(live_seqs(g, self.bm))

    @staticmethod
    def _kv(g: SequenceGroup, tokens: list[int], pos: int) -> tuple:
        return (g.encoder_key, tuple(tokens[: pos + 1]))

    def _forward(self, g: SequenceGroup) -> None:
        cache = self.cache[DEV]
        for s in live_seqs(g, self.bm):
            if s.finished:
                continue
            table = self.bm.get_block_table(s)
            for pos in range(s.num_computed_tokens, len(s)):
                cache.setdefault(table[pos // self.bs], {})[pos % self.bs] = self._kv(g, s.token_ids, pos)
            s.num_computed_tokens = len(s)
            s.append_token(50 + (s.seq_id + len(s)) % 3, 0.0, None)  # a fork and its parent diverge
        g.encoder_computed = True

    def _try_allocate(self, g: SequenceGroup, run: bool) -> None:
        bm = self.bm
        if bm.can_allocate(g) is not AllocStatus.OK:
            return
        free, needed = bm.num_free_blocks(), bm.blocks_needed(g, share_cross=True)
        cached = bm.num_prefix_hit_tokens(g)
        bm.allocate(g, admission_as_before(bm, g))
        assert bm.num_free_blocks() == free - needed
        assert all(s.num_computed_tokens == cached for s in g.unfinished_seqs())
        self.hits += cached > 0
        for s in g.unfinished_seqs():
            s.status = SequenceStatus.RUNNING
        if run:
            self._forward(g)

    # -- rules -------------------------------------------------------------
    @precondition(lambda self: self.bm is not None and sum(not g.is_finished for g in self.groups) < 6)
    @rule(doc=st.integers(0, 2), prefix=st.integers(0, 2), cut=st.integers(0, 10),
          tail=st.lists(st.integers(30, 32), max_size=3), n=st.integers(1, 2), run=st.booleans())
    def add_group(self, doc, prefix, cut, tail, n, run):
        prompt = PREFIXES[prefix][:cut] + tail or [1]
        g = make_group(DOCS[doc], prompt, n)
        self.groups.append(g)
        self._try_allocate(g, run)

    @precondition(lambda self: self.bm is not None and any(self._idle(g) for g in self.groups))
    @rule(idx=st.integers(0, 1000), run=st.booleans())
    def reallocate(self, idx, run):
        self._try_allocate(self._pick(idx, self._idle), run)

    @precondition(lambda self: self.bm is not None and any(self._on(DEV)(g) for g in self.groups))
    @rule(idx=st.integers(0, 1000))
    def step(self, idx):
        bm = self.bm
        g = self._pick(idx, self._on(DEV))
        if not bm.can_append_slots(g):
            return
        pairs = [p for s in live_seqs(g, bm) for p in bm.append_slots(s)]
        self._copy(pairs, DEV, DEV)
        self._forward(g)

    @precondition(lambda self: self.bm is not None and any(self._on(DEV)(g) for g in self.groups))
    @rule(idx=st.integers(0, 1000))
    def fork(self, idx):
        """A beam continued twice: the parent's table shared whole, copied on write."""
        g = self._pick(idx, self._on(DEV))
        parent = live_seqs(g, self.bm)[0]
        if parent.num_computed_tokens == 0 or len(g.seqs) >= 3:
            return
        child = parent.fork(next(_ids))
        self.bm.fork(parent, child)
        g.seqs.append(child)

    @precondition(lambda self: self.bm is not None and any(self._on(DEV)(g) for g in self.groups))
    @rule(idx=st.integers(0, 1000), new=st.booleans())
    def take_over(self, idx, new):
        """A beam continuing another's hypothesis in its own sequence: it drops its
        table (registered blocks losing their last holder are kept) and shares the
        other's, the partly filled block copied (applied at once: the worker copies it
        before anything else of the next step)."""
        g = self._pick(idx, self._on(DEV))
        live = [s for s in live_seqs(g, self.bm) if not s.finished]
        if not live:
            return
        src = live[-1]
        if new or len(live) < 2:
            if len(g.seqs) >= 3:
                return
            dst = Sequence(next(_ids), src.prompt_token_ids)
            g.seqs.append(dst)
        else:
            dst = live[0]
        _, copies = self.bm.take_over([(src, dst)])
        dst.token_ids, dst.output_token_ids = list(src.token_ids), list(src.output_token_ids)
        dst.num_computed_tokens, dst.status = src.num_computed_tokens, src.status
        self._copy(copies, DEV, DEV)

    @precondition(lambda self: self.bm is not None and any(self.bm.device_of(g) for g in self.groups))
    @rule(idx=st.integers(0, 1000), how=st.sampled_from(["finish", "abort", "recompute", "one"]))
    def leave(self, idx, how):
        """The group finishes, is aborted or preempted to be recomputed; or one of
        its sequences finishes (a beam dropped, a sample stopped)."""
        g = self._pick(idx, lambda g: self.bm.device_of(g))
        if how == "one":
            live = [s for s in live_seqs(g, self.bm) if not s.finished]
            if len(live) > 1:
                live[0].status = SequenceStatus.FINISHED_STOPPED
                self.bm.free(live[0], g)
            return
        if how != "recompute":
            for s in g.unfinished_seqs():
                s.status = SequenceStatus.FINISHED_STOPPED if how == "finish" else SequenceStatus.FINISHED_ABORTED
        self.bm.free_group(g)
        if how == "recompute":
            g.reset_for_recompute()

    @precondition(lambda self: self.bm is not None)
    @rule()
    def failed_step(self):
        self.bm.clear_encoder_cache()  # what the engine does after a failed step
        assert self.bm.num_prefix_cached_blocks() == 0

    # -- invariants ----------------------------------------------------------
    @invariant()
    def free_kept_and_held_partition_the_pool(self):
        if self.bm is None:
            return
        bm, pool = self.bm, self.bm.pools[DEV]
        total = bm.num_total_blocks(DEV)
        held = Counter(b for t in bm.tables(DEV) for b in t)
        free, kept = set(pool.free_ids()), set(pool.kept_ids())
        assert not free & kept and not (free | kept) & held.keys()
        assert len(free) + len(kept) + len(held) == total
        assert len(kept) == bm.num_cached_blocks() + bm.num_prefix_cached_blocks()
        assert set(bm.prefix_cache.kept_blocks()) <= kept and bm.num_prefix_cached_blocks() <= self.bound
        assert bm.num_free_blocks() == len(free) + len(kept) == pool.num_free + pool.num_kept
        assert [bm.refcount(DEV, b) for b in range(total)] == [held[b] for b in range(total)]
        assert set(bm.prefix_cache.registered()) <= kept | held.keys()  # never a free block
        host = Counter(b for t in bm.tables(HOST) for b in t)
        assert [bm.refcount(HOST, b) for b in range(bm.num_total_blocks(HOST))] == [
            host[b] for b in range(bm.num_total_blocks(HOST))
        ]
        for dev in Device:  # a free block's contents are garbage
            for b in [b for b in self.cache[dev] if bm.refcount(dev, b) == 0 and not (dev is DEV and b in kept)]:
                del self.cache[dev][b]

    @invariant()
    def every_sequence_reads_back_its_own_kv(self):
        if self.bm is None:
            return
        bm = self.bm
        for g in self.groups:
            dev = bm.device_of(g)
            for s in live_seqs(g, bm):
                table = bm.get_block_table(s)
                for pos in range(s.num_computed_tokens):
                    got = self.cache[dev].get(table[pos // self.bs], {}).get(pos % self.bs)
                    assert got == self._kv(g, s.token_ids, pos), (g, s, pos)

    @invariant()
    def registered_blocks_hold_what_their_keys_name(self):
        if self.bm is None:
            return
        entries = {e.id: e for e in self.bm.prefix_cache._by_block.values()}
        for block, entry in self.bm.prefix_cache._by_block.items():
            chain, e = [], entry
            while isinstance(e.key[0], int):  # walk to the root: the encoder key
                chain.append(e.key[1])
                e = entries.get(e.key[0])
                if e is None:
                    break  # an evicted parent: this key can never be matched again
            else:
                chain.append(e.key[1])
                tokens = [t for part in reversed(chain) for t in part]
                start = len(tokens) - self.bs
                for j in range(self.bs):
                    assert self.cache[DEV].get(block, {}).get(j) == (e.key[0], tuple(tokens[: start + j + 1])), block


PrefixCacheMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    derandomize=True,  # the same scenarios every run
    database=None,
    suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow],
)
TestPrefixCacheMachine = PrefixCacheMachine.TestCase
