"""Paged KV-block accounting for encoder/decoder groups.

One pool of blocks on the compute device and one in CPU swap space. A group
holds one cross-attention table (covering the encoder tokens) and one
self-attention table per decoder sequence, so on whichever pool the group
lives, ``group blocks = |cross table| + sum_i |self table_i|``.
"""

from __future__ import annotations

import enum
import heapq

import numpy as np

from tandem.core.sequence import Sequence, SequenceGroup


class AllocStatus(enum.Enum):
    OK = "ok"
    LATER = "later"  # not enough free blocks now
    NEVER = "never"  # more blocks than the pool has


class Device(enum.Enum):
    GPU = "device"
    CPU = "cpu"


class BlockPool:
    """Free block ids ``0 .. num_blocks - 1`` of one device.

    Self-attention blocks come one at a time from the low end (a min-heap);
    cross-attention tables, allocated whole and freed whole, take the
    best-fitting run of consecutive ids, so that a backend can read a
    sequence's encoder keys through one view of the cache instead of a gather.
    Keeping the two apart keeps the runs from fragmenting.
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.reset()

    def reset(self) -> None:
        self._is_free = np.ones(self.num_blocks, dtype=bool)
        # Lazily pruned: ids taken as part of a run stay here until popped.
        self._heap: list[int] = list(range(self.num_blocks))
        self.num_free = self.num_blocks

    def free_ids(self) -> list[int]:
        return np.flatnonzero(self._is_free).tolist()

    def allocate(self, n: int) -> list[int]:
        """``n`` blocks, lowest ids first; not necessarily consecutive."""
        if n > self.num_free:
            raise RuntimeError(f"asked for {n} blocks, {self.num_free} free")
        taken: list[int] = []
        while len(taken) < n:
            b = heapq.heappop(self._heap)
            if self._is_free[b]:
                self._is_free[b] = False
                taken.append(b)
        self.num_free -= n
        return taken

    def allocate_run(self, n: int) -> list[int]:
        """``n`` consecutive blocks from the smallest run that fits (highest
        ids of it), or scattered ones when no run is long enough."""
        if n > self.num_free:
            raise RuntimeError(f"asked for {n} blocks, {self.num_free} free")
        if n == 0:
            return []
        edges = np.diff(np.concatenate(([0], self._is_free.view(np.int8), [0])))
        starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
        lengths = ends - starts
        fits = np.flatnonzero(lengths >= n)
        if fits.size == 0:
            return self.allocate(n)
        best = fits[np.argmin(lengths[fits])]
        end = int(ends[best])
        self._is_free[end - n : end] = False
        self.num_free -= n
        return list(range(end - n, end))

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            if self._is_free[b]:
                raise RuntimeError(f"block {b} freed twice")
            self._is_free[b] = True
            heapq.heappush(self._heap, b)
        self.num_free += len(blocks)
        if len(self._heap) > 2 * self.num_blocks:  # drop stale ids left by runs
            self._heap = self.free_ids()


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockManager:
    def __init__(
        self,
        block_size: int,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        watermark: float = 0.01,
    ) -> None:
        self.block_size = block_size
        self.pools = {Device.GPU: BlockPool(num_gpu_blocks), Device.CPU: BlockPool(num_cpu_blocks)}
        self.watermark_blocks = int(watermark * num_gpu_blocks)
        self.self_tables: dict[int, list[int]] = {}
        self.cross_tables: dict[str, list[int]] = {}
        self.location: dict[str, Device] = {}

    # -- queries -----------------------------------------------------------
    def num_free_blocks(self, device: Device = Device.GPU) -> int:
        return self.pools[device].num_free

    @property
    def usable_blocks(self) -> int:
        """Device blocks one group may ever hold: the pool less the watermark."""
        return self.pools[Device.GPU].num_blocks - self.watermark_blocks

    def num_total_blocks(self, device: Device = Device.GPU) -> int:
        return self.pools[device].num_blocks

    def get_block_table(self, seq: Sequence) -> list[int]:
        return self.self_tables[seq.seq_id]

    def get_cross_block_table(self, group: SequenceGroup) -> list[int]:
        return self.cross_tables[group.request_id]

    def group_blocks(self, group: SequenceGroup) -> int:
        """Blocks the group holds now, on whichever pool it lives."""
        own = sum(len(self.self_tables[s.seq_id]) for s in group.seqs if s.seq_id in self.self_tables)
        return len(self.cross_tables.get(group.request_id, ())) + own

    def blocks_needed(self, group: SequenceGroup, extra_tokens: int = 0) -> int:
        """Blocks a fresh allocation of the group needs (plus ``extra_tokens`` per sequence)."""
        bs = self.block_size
        seqs = group.unfinished_seqs()
        return blocks_for(group.encoder_len, bs) + sum(blocks_for(len(s) + extra_tokens, bs) for s in seqs)

    # -- allocation --------------------------------------------------------
    def can_allocate(self, group: SequenceGroup) -> AllocStatus:
        needed = self.blocks_needed(group)
        pool = self.pools[Device.GPU]
        if needed > self.usable_blocks:
            return AllocStatus.NEVER
        if pool.num_free - needed >= self.watermark_blocks:
            return AllocStatus.OK
        return AllocStatus.LATER

    def allocate(self, group: SequenceGroup) -> None:
        rid = group.request_id
        if rid in self.cross_tables:
            raise RuntimeError(f"request {rid!r} already holds blocks")
        pool = self.pools[Device.GPU]
        if self.blocks_needed(group) > pool.num_free:
            raise RuntimeError(f"not enough free blocks to allocate request {rid!r}")
        self.cross_tables[rid] = pool.allocate_run(blocks_for(group.encoder_len, self.block_size))
        for seq in group.unfinished_seqs():
            self.self_tables[seq.seq_id] = pool.allocate(blocks_for(len(seq), self.block_size))
        self.location[rid] = Device.GPU

    def _append_need(self, seq: Sequence) -> int:
        return max(0, blocks_for(len(seq), self.block_size) - len(self.self_tables[seq.seq_id]))

    def can_append_slots(self, group: SequenceGroup) -> bool:
        need = sum(self._append_need(s) for s in group.get_seqs() if s.seq_id in self.self_tables)
        return need <= self.pools[Device.GPU].num_free

    def append_slots(self, seq: Sequence) -> None:
        """Grow the sequence's self table to hold all of its tokens."""
        need = self._append_need(seq)
        if need:
            self.self_tables[seq.seq_id].extend(self.pools[Device.GPU].allocate(need))

    # -- swapping ----------------------------------------------------------
    def can_swap_in(self, group: SequenceGroup) -> bool:
        # The group's blocks plus what append_slots adds right after the move
        # (not a flat spare per sequence: that can exceed the whole pool for a
        # group the engine admitted, which would then never come back).
        need = self.group_blocks(group) + sum(
            self._append_need(s) for s in group.unfinished_seqs() if s.seq_id in self.self_tables
        )
        return self.pools[Device.GPU].num_free - need >= self.watermark_blocks

    def can_swap_out(self, group: SequenceGroup) -> bool:
        return self.group_blocks(group) <= self.pools[Device.CPU].num_free

    def swap_in(self, group: SequenceGroup) -> list[tuple[int, int]]:
        return self._move(group, Device.CPU, Device.GPU)

    def swap_out(self, group: SequenceGroup) -> list[tuple[int, int]]:
        return self._move(group, Device.GPU, Device.CPU)

    def _move(self, group: SequenceGroup, src: Device, dst: Device) -> list[tuple[int, int]]:
        rid = group.request_id
        if self.location.get(rid) is not src:
            raise RuntimeError(f"request {rid!r} is not on {src.value}")
        src_pool, dst_pool = self.pools[src], self.pools[dst]
        mapping: list[tuple[int, int]] = []

        def move(table: list[int], run: bool = False) -> list[int]:
            new = dst_pool.allocate_run(len(table)) if run else dst_pool.allocate(len(table))
            mapping.extend(zip(table, new))
            src_pool.free(table)
            return new

        if self.group_blocks(group) > dst_pool.num_free:
            raise RuntimeError(f"not enough free {dst.value} blocks to move request {rid!r}")
        self.cross_tables[rid] = move(self.cross_tables[rid], run=True)
        for seq in group.seqs:
            if seq.seq_id in self.self_tables:
                self.self_tables[seq.seq_id] = move(self.self_tables[seq.seq_id])
        self.location[rid] = dst
        return mapping

    # -- freeing -----------------------------------------------------------
    def free(self, seq: Sequence, group: SequenceGroup) -> None:
        table = self.self_tables.pop(seq.seq_id, None)
        if table is not None:
            self.pools[self.location[group.request_id]].free(table)
        self._forget_if_empty(group)

    def free_cross(self, group: SequenceGroup) -> None:
        rid = group.request_id
        table = self.cross_tables.pop(rid, None)
        if table is not None:
            self.pools[self.location[rid]].free(table)
        self._forget_if_empty(group)

    def _forget_if_empty(self, group: SequenceGroup) -> None:
        rid = group.request_id
        if rid not in self.cross_tables and not any(s.seq_id in self.self_tables for s in group.seqs):
            self.location.pop(rid, None)

    def free_group(self, group: SequenceGroup) -> None:
        """Free every block the group holds: each self table, then the cross table."""
        for seq in group.seqs:
            self.free(seq, group)
        self.free_cross(group)

    def reset(self) -> None:
        for pool in self.pools.values():
            pool.reset()
        self.self_tables.clear()
        self.cross_tables.clear()
        self.location.clear()
