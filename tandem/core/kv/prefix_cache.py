"""Decoder-prompt blocks found by content: automatic prefix caching for
encoder/decoder models.

A full block of a sequence's decoder prompt whose tokens are all computed is
*registered* under a key chained block by block: the first block's key is
``(encoder key, its tokens)``, block ``i``'s is ``(id of block i-1's entry, its
tokens)``. Decoder self-attention K/V at a position depends on the tokens up to
it and, through cross attention, on the encoder's output, so the chain's root
is the request's encoder-input key (``EncoderInputs.cache_key``, the cross
table's): the same decoder prompt over another encoder input never matches.
Entry ids are never reused, so a key naming an evicted parent is never matched
again; keys are compared, not only hashed, so a hash collision never shares a
block. What else the K/V depends on (weights, dtype, block size) is fixed per
engine, and each engine has its own cache.

A registered block is shared by every table whose prompt matches (refcount,
as any shared block); it is never written again, because only full, computed
prompt blocks are registered and a sequence only writes past what it has
computed. When its last holder lets go, the block is *kept* (refcount 0, off
the free list: ``BlockPool.keep``) until a request with the same encoder input
and prompt prefix takes it (``acquire``) or an allocation evicts it, least
recently kept first. Kept blocks count as available wherever the block manager
checks for room.
"""

from __future__ import annotations

import itertools
from collections import Counter, OrderedDict
from collections.abc import Hashable, Iterable, Iterator
from dataclasses import dataclass

from tandem.core.kv.block_pool import BlockPool
from tandem.core.sequence import Sequence


@dataclass(eq=False)
class _Entry:
    id: int  # what the next block's key names as its parent
    key: tuple  # (encoder key or parent entry id, block token ids)
    block: int


class PrefixCache:
    def __init__(self, pool: BlockPool, block_size: int, max_blocks: int, clock: Iterator[int]) -> None:
        """``max_blocks``: the most blocks kept at once (0: nothing is registered,
        shared or kept). ``clock``: stamps shared with the encoder cache, so the
        block manager evicts the older of the two caches' oldest."""
        self.pool = pool
        self.block_size = block_size
        self.max_blocks = max_blocks
        self._clock = clock
        self._ids = itertools.count()
        self._by_key: dict[tuple, _Entry] = {}
        self._by_block: dict[int, _Entry] = {}  # registered blocks, held or kept
        self._kept: OrderedDict[int, int] = OrderedDict()  # block -> stamp, least recently kept first
        # seq id -> (full prompt blocks registered, the chain's parent for the next)
        self._progress: dict[int, tuple[int, Hashable]] = {}
        self.evictions = 0  # blocks evicted

    @property
    def enabled(self) -> bool:
        return self.max_blocks > 0

    @property
    def num_blocks(self) -> int:
        """Blocks kept now (no table holds them)."""
        return len(self._kept)

    def kept_blocks(self) -> list[int]:
        return list(self._kept)

    def is_registered(self, block: int) -> bool:
        return block in self._by_block

    def registered(self) -> dict[int, tuple]:
        """Registered device blocks (held or kept) and their keys."""
        return {b: e.key for b, e in self._by_block.items()}

    # -- lookups -------------------------------------------------------------
    def _block_tokens(self, tokens: list[int], i: int) -> tuple[int, ...]:
        return tuple(tokens[i * self.block_size : (i + 1) * self.block_size])

    def lookup(self, encoder_key: Hashable, seqs: list[Sequence]) -> list[int]:
        """Registered blocks holding the first full blocks of the decoder prompt of
        ``seqs`` (one group's, all with the same prompt, else none), leaving every
        sequence at least one token to compute (its logits are needed)."""
        if not self.enabled or not seqs:
            return []
        prompt = seqs[0].prompt_token_ids
        if any(s.prompt_token_ids != prompt for s in seqs[1:]):
            return []
        limit = min(len(prompt) // self.block_size, *((len(s) - 1) // self.block_size for s in seqs))
        return self.match(encoder_key, prompt, limit)

    def match(self, encoder_key: Hashable, tokens: list[int], limit: int) -> list[int]:
        """Registered blocks holding the K/V of ``tokens``' first full blocks over
        ``encoder_key``'s input, at most ``limit``, stopping at the first miss."""
        parent, found = encoder_key, []
        for i in range(limit):
            entry = self._by_key.get((parent, self._block_tokens(tokens, i)))
            if entry is None:
                break
            found.append(entry.block)
            parent = entry.id
        return found

    def register_computed(self, seq: Sequence, table: list[int], encoder_key: Hashable) -> None:
        """Register the full, computed decoder-prompt blocks of ``seq`` (``table``:
        its self table, on the device) not registered yet."""
        if not self.enabled:
            return
        n = min(seq.num_computed_tokens, len(seq.prompt_token_ids)) // self.block_size
        done, parent = self._progress.get(seq.seq_id, (0, encoder_key))
        if n > done:
            parent = self.register(parent, seq.prompt_token_ids, table, done, n)
            self._progress[seq.seq_id] = (n, parent)

    def forget(self, seq_id: int) -> None:
        """The sequence's table is gone or moved: the next registration walks from block 0."""
        self._progress.pop(seq_id, None)

    def fork(self, parent_id: int, child_id: int) -> None:
        if parent_id in self._progress:
            self._progress[child_id] = self._progress[parent_id]

    def register(self, parent: Hashable, tokens: list[int], table: list[int], begin: int, end: int) -> Hashable:
        """Register ``table[begin:end]``, full blocks of computed prompt tokens, the
        chain continuing from ``parent`` (the encoder key for ``begin == 0``, else
        what this returned for the blocks before). A block whose key is already
        registered with another block (two requests computed the same prefix at
        once) stays unregistered; the chain goes on through the registered one.
        Returns the parent of block ``end``."""
        for i in range(begin, end):
            key = (parent, self._block_tokens(tokens, i))
            entry = self._by_key.get(key)
            if entry is None:
                block = table[i]
                entry = self._by_block.get(block)
                if entry is None:
                    entry = self._by_block[block] = _Entry(next(self._ids), key, block)
                else:
                    # Registered under a chain whose parent entry was evicted and
                    # registered again (new id): same content, so only the key moves.
                    if self._by_key.get(entry.key) is entry:
                        del self._by_key[entry.key]
                    entry.key = key
                self._by_key[key] = entry
            parent = entry.id
        return parent

    # -- references ----------------------------------------------------------
    def acquire(self, blocks: list[int]) -> None:
        """One more reference to each of ``blocks`` (a hit): kept ones are held again."""
        if not blocks:  # no hit, the usual admission: no pool call
            return
        kept = {b for b in blocks if b in self._kept}
        for b in kept:
            del self._kept[b]
        self.pool.reuse(sorted(kept))
        self.pool.incref([b for b in blocks if b not in kept])

    def release(self, blocks: list[int]) -> None:
        """Drop one reference per entry of ``blocks`` (repeats count); registered
        blocks losing their last one are kept, a table's last blocks first in line
        for eviction."""
        if not self.enabled:
            self.pool.decref(blocks)
            return
        counts = Counter(blocks)
        last = [b for b, c in counts.items() if b in self._by_block and self.pool.refcount(b) == c]
        for b in last:
            counts[b] -= 1
        self.pool.decref(list(counts.elements()))
        self.keep(reversed(last))

    def keep(self, blocks: Iterable[int]) -> None:
        """Registered blocks losing their last reference: kept, evicting the least
        recently kept to stay within the bound (evicted first: the first given)."""
        for b in blocks:
            while len(self._kept) >= self.max_blocks:
                self.evict_oldest()
            self.pool.keep([b])
            self._kept[b] = next(self._clock)

    # -- eviction ------------------------------------------------------------
    def oldest_stamp(self) -> int | None:
        return next(iter(self._kept.values()), None)

    def evict_oldest(self) -> None:
        self._evict(next(iter(self._kept)))

    def evict_all(self) -> None:
        while self._kept:
            self.evict_oldest()

    def _evict(self, block: int) -> None:
        del self._kept[block]
        entry = self._by_block.pop(block)
        if self._by_key.get(entry.key) is entry:
            del self._by_key[entry.key]
        self.pool.evict([block])
        self.evictions += 1

    def clear(self) -> None:
        """Forget everything (the pool was reset under it)."""
        self._by_key.clear()
        self._by_block.clear()
        self._kept.clear()
        self._progress.clear()
