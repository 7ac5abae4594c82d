"""What the block-manager state machines share (tests/core/test_block_manager.py,
test_encoder_cache.py, test_prefix_cache.py): the groups they drive, a fake K/V per
device block (``cache[device][block][slot]``) that a swap moves as the block manager
says, and picking a group by an index hypothesis draws."""

from __future__ import annotations

from hypothesis import strategies as st
from collections import Counter

from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tandem.core.kv.block_manager import Admission, AllocStatus, BlockManager

from tandem.core.kv.block_pool import Device
from tandem.core.sequence import Sequence, SequenceGroup

DEV, HOST = Device.DEVICE, Device.HOST


def live_seqs(g: SequenceGroup, bm: BlockManager) -> list[Sequence]:
    """The group's sequences that hold a block table."""
    return [s for s in g.seqs if bm.has_block_table(s)]


def admission_as_before(bm: BlockManager, g: SequenceGroup) -> Admission:
    """``bm.admission(g)``, checked against what the scheduler asked separately before it
    (``has_encoder_output``, ``num_prefix_hit_tokens``, ``blocks_needed``, can_allocate's
    rule); the allocation that takes it is then the scheduler's path."""
    a = bm.admission(g)
    assert a.seqs == g.unfinished_seqs() and a.key == g.encoder_key
    assert a.run_encoder is (not bm.has_encoder_output(g))
    assert len(a.hits) * bm.block_size == bm.num_prefix_hit_tokens(g)
    assert a.need == bm.blocks_needed(g, share_cross=True)
    if bm.blocks_needed(g) > bm.usable_blocks:
        assert a.status is AllocStatus.NEVER
    else:
        ok = bm.num_free_blocks() - a.need >= bm.watermark_blocks
        assert a.status is (AllocStatus.OK if ok else AllocStatus.LATER)
    return a


class KVMachine(RuleBasedStateMachine):
    """A subclass sets ``self.bm`` in its ``@initialize`` and may override :meth:`_on`."""

    def __init__(self) -> None:
        super().__init__()
        self.bm: BlockManager | None = None
        self.groups: list[SequenceGroup] = []
        self.cache: dict[Device, dict[int, dict]] = {DEV: {}, HOST: {}}  # block -> slot -> fake K/V

    @invariant()
    def cross_holders_counted_per_input(self):
        """What lets ``_unlist`` skip its search: the holders counted per encoder key."""
        if self.bm is not None:
            assert self.bm._key_holders == Counter(t.key for t in self.bm._cross.values())

    def _pick(self, idx: int, pred) -> SequenceGroup:
        cands = [g for g in self.groups if pred(g)]
        return cands[idx % len(cands)]

    def _on(self, device: Device):
        return lambda g: self.bm.device_of(g) is device

    def _idle(self, g: SequenceGroup) -> bool:
        return self.bm.device_of(g) is None and not g.is_finished

    def _copy(self, pairs, src: Device, dst: Device) -> None:
        moved = {d: dict(self.cache[src].get(s, {})) for s, d in pairs}
        self.cache[dst].update(moved)

    def _check_evictions(self, counted=None) -> None:
        """Every eviction of a kept block asserts the block is unreferenced and in no
        table; ``counted(blocks)`` sees each eviction."""
        pool, evict = self.bm.pools[DEV], self.bm.pools[DEV].evict

        def checked_evict(blocks):
            held = {b for t in self.bm.tables(DEV) for b in t}
            assert all(pool.refcount(b) == 0 and b not in held for b in blocks), blocks
            if counted is not None:
                counted(blocks)
            evict(blocks)

        pool.evict = checked_evict

    @precondition(lambda self: self.bm is not None and any(self._on(DEV)(g) for g in self.groups))
    @rule(idx=st.integers(0, 1000))
    def swap_out(self, idx):
        g = self._pick(idx, self._on(DEV))
        if self.bm.can_swap_out(g):
            self._copy(self.bm.swap_out(g), DEV, HOST)

    @precondition(lambda self: self.bm is not None and any(self._on(HOST)(g) for g in self.groups))
    @rule(idx=st.integers(0, 1000))
    def swap_in(self, idx):
        g = self._pick(idx, self._on(HOST))
        if self.bm.can_swap_in(g):
            self._copy(self.bm.swap_in(g), HOST, DEV)
