"""Cross tables no request holds, kept on the device by encoder-input key.

When the last group holding a cross table lets go of it (it finished, was
aborted, or was preempted to be recomputed) after the encoder filled it, the
block manager hands the table here instead of freeing it. Its blocks then have
reference count zero but stay out of the free list (``BlockPool.keep``): a
later request with the same encoder input takes the table back (``take``) and
skips the encoder; a request that needs blocks evicts kept tables, least
recently kept first, before anything is refused or preempted (``make_room``).
Kept blocks therefore count as available everywhere the block manager checks
for room: keeping a table never makes a request wait.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Hashable, Iterator

from tandem.core.kv.block_pool import BlockPool


class EncoderCache:
    def __init__(self, pool: BlockPool, max_blocks: int, clock: Iterator[int] | None = None) -> None:
        """``max_blocks``: the most blocks kept at once (0: nothing is kept).
        ``clock``: keep stamps, shared with the prefix cache (``prefix_cache.py``)."""
        self.pool = pool
        self.max_blocks = max_blocks
        self._clock = clock if clock is not None else itertools.count()
        # Least recently kept first. Keys are compared, not just hashed (EncoderInputs.cache_key).
        self._tables: OrderedDict[Hashable, list[int]] = OrderedDict()
        self._stamps: dict[Hashable, int] = {}
        self.num_blocks = 0
        self.evictions = 0  # tables evicted (to make room, or past the bound)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._tables

    def __len__(self) -> int:
        return len(self._tables)

    def tables(self) -> dict[Hashable, list[int]]:
        return dict(self._tables)

    def keep(self, key: Hashable, blocks: list[int]) -> bool:
        """Take over a filled cross table whose last reference is being dropped.
        Returns False (and frees it) when it is larger than the bound; evicts the
        least recently kept tables to stay within the bound, and a kept table of
        the same key (the newer copy wins)."""
        if not blocks or len(blocks) > self.max_blocks:
            self.pool.decref(blocks)
            return False
        if key in self._tables:
            self._evict(key)
        while self.num_blocks + len(blocks) > self.max_blocks:
            self._evict(next(iter(self._tables)))
        self.pool.keep(blocks)
        self._tables[key] = blocks
        self._stamps[key] = next(self._clock)
        self.num_blocks += len(blocks)
        return True

    def take(self, key: Hashable) -> list[int] | None:
        """The kept table of ``key``, held once again (None when there is none)."""
        blocks = self._tables.pop(key, None)
        if blocks is not None:
            del self._stamps[key]
            self.pool.reuse(blocks)
            self.num_blocks -= len(blocks)
        return blocks

    def make_room(self, n: int) -> None:
        """Evict kept tables, least recently kept first, until ``n`` blocks are free
        (or nothing is kept)."""
        while self.pool.num_free < n and self._tables:
            self._evict(next(iter(self._tables)))

    def oldest_stamp(self) -> int | None:
        """When the least recently kept table was kept (None: nothing is)."""
        return self._stamps[next(iter(self._tables))] if self._tables else None

    def evict_oldest(self) -> None:
        self._evict(next(iter(self._tables)))

    def clear(self) -> None:
        """Forget every table (the pool was reset under it)."""
        self._tables.clear()
        self._stamps.clear()
        self.num_blocks = 0

    def evict_all(self) -> None:
        while self._tables:
            self._evict(next(iter(self._tables)))

    def _evict(self, key: Hashable) -> None:
        blocks = self._tables.pop(key)
        del self._stamps[key]
        self.pool.evict(blocks)
        self.num_blocks -= len(blocks)
        self.evictions += 1
