"""Refcounted KV blocks of one device.

A block's reference count is the number of block tables holding it (self
tables of decoder sequences, cross tables of groups). A block with count zero
is either free or *kept*: part of a cross table the encoder cache keeps
(``encoder_cache.py``); a kept block is handed out again only through
``reuse`` (the same table for a later request) or ``evict`` (it becomes free).
"""

from __future__ import annotations

import enum
import heapq

import numpy as np


class Device(enum.Enum):
    """Where a block pool lives."""

    DEVICE = "device"  # on the device the model runs on (a GPU, or the CPU itself)
    HOST = "host"  # host memory: the swap space

    # Members are singletons compared by identity: hash them in C (Enum's own __hash__
    # is a Python call, paid for each pool lookup of every running group each step).
    __hash__ = object.__hash__


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockPool:
    """Block ids ``0 .. num_blocks - 1`` of one device, with reference counts.

    Self-attention blocks come one at a time from the low end (a min-heap);
    cross-attention tables, allocated whole and freed whole, take the
    best-fitting run of consecutive ids, so that a backend can read a
    sequence's encoder keys through one view of the cache instead of a gather.
    Keeping the two apart keeps the runs from fragmenting.
    """

    # Up to this many free runs, ``allocate_run`` looks for the best fit in a loop; past
    # it, in numpy.
    loop_runs = 16
    # Up to this many blocks, ``decref`` drops their references one by one; past it, in numpy.
    few_blocks = 16

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.reset()

    def reset(self) -> None:
        self._refs = np.zeros(self.num_blocks, dtype=np.int64)
        # Every block's reference count, ``[num_blocks]``, read-only: for callers that
        # read many counts in a loop (``refcounts[b]`` is no Python call).
        self.refcounts = self._refs.view()
        self.refcounts.flags.writeable = False
        self._kept = np.zeros(self.num_blocks, dtype=bool)
        self._pad = np.zeros(self.num_blocks + 2, dtype=bool)  # _free_runs' scratch
        # The free blocks' runs, ``(starts, ends)`` ascending, while known: kept up to date
        # by the allocations, found again after anything frees a block.
        self._runs: tuple[list[int], list[int]] | None = None
        # Lazily pruned: ids taken as part of a run (or kept) stay here until popped.
        self._heap: list[int] = list(range(self.num_blocks))
        self.num_free = self.num_blocks  # free blocks, kept ones not counted
        self.num_kept = 0

    # -- queries -----------------------------------------------------------
    def free_ids(self) -> list[int]:
        return np.flatnonzero((self._refs == 0) & ~self._kept).tolist()

    def kept_ids(self) -> list[int]:
        return np.flatnonzero(self._kept).tolist()

    def refcount(self, block: int) -> int:
        return int(self._refs[block])

    def is_kept(self, block: int) -> bool:
        return bool(self._kept[block])

    # -- allocation (each new block has one reference) ----------------------
    def allocate(self, n: int) -> list[int]:
        """``n`` free blocks, lowest ids first; not necessarily consecutive."""
        if n > self.num_free:
            raise RuntimeError(f"asked for {n} blocks, {self.num_free} free")
        taken: list[int] = []
        while len(taken) < n:
            b = heapq.heappop(self._heap)
            if self._refs[b] == 0 and not self._kept[b]:  # a kept one is pushed again when evicted
                self._refs[b] = 1
                taken.append(b)
        self.num_free -= n
        runs = self._runs
        if runs is not None and taken:
            # The lowest free ids: the front of the first runs.
            starts, ends = runs
            if taken[0] != starts[0]:
                self._runs = None
            else:
                k = n
                while k:
                    length = ends[0] - starts[0]
                    if length > k:
                        starts[0] += k
                        break
                    del starts[0], ends[0]
                    k -= length
        return taken

    def allocate_run(self, n: int) -> list[int]:
        """``n`` consecutive free blocks from the smallest run that fits (the first of
        the smallest; its highest ids), or scattered ones when no run is long enough."""
        if n > self.num_free:
            raise RuntimeError(f"asked for {n} blocks, {self.num_free} free")
        if n == 0:
            return []
        starts, ends = self._free_runs()
        best = -1
        if len(starts) <= self.loop_runs:  # the usual few runs: no array made
            fit = self.num_blocks + 1
            for i, (a, e) in enumerate(zip(starts, ends)):
                if n <= e - a < fit:
                    best, fit = i, e - a
        else:
            lengths = np.subtract(ends, starts)
            fits = np.flatnonzero(lengths >= n)
            if fits.size:
                best = int(fits[np.argmin(lengths[fits])])
        if best < 0:
            return self.allocate(n)
        end = ends[best]
        if end - n == starts[best]:
            del starts[best], ends[best]
        else:
            ends[best] = end - n
        self._refs[end - n : end] = 1
        self.num_free -= n
        return list(range(end - n, end))

    def _free_runs(self) -> tuple[list[int], list[int]]:
        """The free blocks' runs, ``(starts, ends)`` ascending (found in one pass over
        the pool when not known)."""
        runs = self._runs
        if runs is None:
            # Free, padded with a used block at each end: its changes of value are the
            # runs' starts and ends, alternately.
            is_free = self._pad
            free = self._refs == 0
            free &= ~self._kept
            is_free[1:-1] = free
            edges = np.flatnonzero(is_free[1:] != is_free[:-1])
            runs = self._runs = (edges[0::2].tolist(), edges[1::2].tolist())
        return runs

    # -- references ----------------------------------------------------------
    def incref(self, blocks: list[int], times: int = 1) -> None:
        """One more reference (``times`` more) to each of ``blocks`` (repeats count)."""
        if not blocks or times == 0:
            return
        ids = np.asarray(blocks, dtype=np.int64)
        if (self._refs[ids] == 0).any():
            raise RuntimeError(f"a block of {blocks} is free: it cannot gain a reference")
        np.add.at(self._refs, ids, times)

    def decref(self, blocks: list[int], times: int = 1) -> None:
        """Drop one reference (``times``) from each of ``blocks`` (repeats count);
        blocks whose count reaches zero are free again."""
        if not blocks or times == 0:
            return
        if len(blocks) <= self.few_blocks:  # a table's few blocks: cheaper one by one than in numpy
            self._decref_few(blocks, times)
            return
        ids = np.asarray(blocks, dtype=np.int64)
        np.subtract.at(self._refs, ids, times)
        if (self._refs[ids] < 0).any():
            np.add.at(self._refs, ids, times)  # leave the pool as it was
            raise RuntimeError(f"a block of {blocks} freed twice")
        freed = np.unique(ids[self._refs[ids] == 0]).tolist()
        if freed:
            self._runs = None
        for b in freed:
            heapq.heappush(self._heap, b)
        self.num_free += len(freed)
        if len(self._heap) > 2 * self.num_blocks:  # drop stale ids left by runs
            self._heap = self.free_ids()

    def _decref_few(self, blocks: list[int], times: int) -> None:
        """``decref`` for a few blocks: the same checks and result, without numpy calls."""
        refs = self._refs
        drop: dict[int, int] = {}
        for b in blocks:
            drop[b] = drop.get(b, 0) + times
        for b, d in drop.items():
            if refs.item(b) < d:  # item: a Python int (IndexError past the pool, as numpy's)
                raise RuntimeError(f"a block of {blocks} freed twice")
        freed = []
        for b, d in drop.items():
            left = refs.item(b) - d
            refs[b] = left
            if left == 0:
                freed.append(b)
        if freed:
            self._runs = None
            freed.sort()
            for b in freed:
                heapq.heappush(self._heap, b)
            self.num_free += len(freed)
            if len(self._heap) > 2 * self.num_blocks:  # drop stale ids left by runs
                self._heap = self.free_ids()

    # Releasing the only reference is freeing.
    free = decref

    # -- kept blocks (the encoder cache's) -------------------------------------
    def keep(self, blocks: list[int]) -> None:
        """Drop the last reference to each of ``blocks`` but keep their contents:
        they are neither free nor held until ``reuse`` or ``evict``."""
        ids = np.asarray(blocks, dtype=np.int64)
        if len(set(blocks)) != len(blocks) or (self._refs[ids] != 1).any():
            raise RuntimeError(f"blocks {blocks} cannot be kept: each must be held once, by the table kept")
        self._refs[ids] = 0
        self._kept[ids] = True
        self.num_kept += len(blocks)

    def reuse(self, blocks: list[int]) -> None:
        """Kept blocks become held again, one reference each (a cache hit)."""
        self._unkeep(blocks)
        self._refs[np.asarray(blocks, dtype=np.int64)] = 1

    def evict(self, blocks: list[int]) -> None:
        """Kept blocks become free. Only kept blocks (count zero) can be evicted,
        so eviction never frees a block a table holds."""
        self._unkeep(blocks)
        self._runs = None
        for b in blocks:
            heapq.heappush(self._heap, b)
        self.num_free += len(blocks)

    def _unkeep(self, blocks: list[int]) -> None:
        ids = np.asarray(blocks, dtype=np.int64)
        if not self._kept[ids].all() or (self._refs[ids] != 0).any():
            raise RuntimeError(f"a block of {blocks} is not kept")
        self._kept[ids] = False
        self.num_kept -= len(blocks)
