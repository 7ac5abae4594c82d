"""Block tables of encoder/decoder groups over refcounted pools.

A group holds one cross-attention table (covering the encoder tokens) and one
self-attention table per decoder sequence; a block's refcount is the number
of tables holding it. Tables share blocks in two ways:

- the ``n`` sequences of a group share their decoder prompt's blocks; a
  sequence about to write into a shared block copies it first
  (copy-on-write: ``append_slots`` returns the ``(src, dst)`` pairs the
  engine copies before the forward pass);
- groups whose encoder input is identical share one cross table while it is
  on the device, so the encoder runs once for all of them;
- a filled cross table no group holds any more stays in the encoder cache
  (``encoder_cache.py``) until a request with the same input takes it back or
  a request that needs its blocks evicts it. Kept blocks count as free in every
  check for room here, and each allocation evicts what it needs first;
- full blocks of computed decoder prompts are registered by content, chained
  on the encoder key (``prefix_cache.py``): a group admitted with the same
  encoder input and prompt prefix shares them (live, or kept after their last
  holder left) and its sequences start computed past them. Eviction takes the
  least recently kept of both caches first.
"""

from __future__ import annotations

import enum
import itertools
from collections import Counter
from collections.abc import Hashable
from dataclasses import dataclass, field

from tandem.core.kv.block_pool import BlockPool, Device, blocks_for
from tandem.core.kv.encoder_cache import EncoderCache
from tandem.core.kv.prefix_cache import PrefixCache
from tandem.core.sequence import Sequence, SequenceGroup, SequenceStatus


class AllocStatus(enum.Enum):
    OK = "ok"
    LATER = "later"  # not enough free blocks now
    NEVER = "never"  # more blocks than the pool has


@dataclass(eq=False)
class _CrossTable:
    """One cross table and the groups holding it (each holds every block once)."""

    key: Hashable  # the encoder inputs' cache_key
    blocks: list[int]
    device: Device
    holders: set[str] = field(default_factory=set)  # request ids
    filled: bool = False  # a holder's step wrote the encoder's K/V (known when a holder leaves)
    # Encoder positions it holds once compressed (``compress_cross``): then it is one
    # request's own (never shared, listed or kept); None: all of the encoder's.
    positions: int | None = None


@dataclass(slots=True)
class Admission:
    """What admitting a group now takes, found once (``BlockManager.admission``) for the
    scheduler's checks and ``allocate``; true while nothing changes the pools or caches."""

    seqs: list[Sequence]  # its unfinished sequences
    key: Hashable  # its encoder key
    hits: list[int]  # registered decoder-prompt blocks its sequences would share
    run_encoder: bool  # no live or kept cross table of its input: its encoder runs
    n_shared: int  # blocks at the front of its self tables all its sequences share
    own: int  # the self-table blocks of its sequences past the shared ones, together
    need: int  # device blocks allocating it now takes (``blocks_needed(share_cross=True)``)
    status: AllocStatus  # ``can_allocate``'s answer


class BlockManager:
    def __init__(
        self,
        block_size: int,
        num_device_blocks: int,
        num_host_blocks: int,
        watermark: float = 0.01,
        encoder_cache_blocks: int | None = 0,
        prefix_cache_blocks: int | None = 0,
    ) -> None:
        """``encoder_cache_blocks``: the most device blocks the encoder cache keeps
        (None: as many as the pool has; 0: no cache, only live groups share).
        ``prefix_cache_blocks``: the same for decoder-prompt blocks (0: none are
        registered, shared across groups or kept)."""
        for name, value in (("encoder_cache_blocks", encoder_cache_blocks),
                            ("prefix_cache_blocks", prefix_cache_blocks)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise ValueError(f"{name}={value!r}: must be None or an integer >= 0")
        self.block_size = block_size
        self.pools = {Device.DEVICE: BlockPool(num_device_blocks), Device.HOST: BlockPool(num_host_blocks)}
        self.watermark_blocks = int(watermark * num_device_blocks)
        self._self: dict[int, list[int]] = {}  # seq_id -> self table
        self._owner: dict[int, str] = {}  # seq_id -> request id
        self._cross: dict[str, _CrossTable] = {}  # request id -> its (maybe shared) cross table
        # Entries of ``_cross`` per encoder key: when they are a table's own holders, no
        # other table of its key exists (``_unlist`` then looks no further).
        self._key_holders: dict[Hashable, int] = {}
        # Cross tables that new groups may share: device-resident ones, by
        # encoder ids. A dict keyed by the tuple matches on its hash and then
        # compares the ids, so inputs whose hashes collide never share.
        self._live_cross: dict[tuple[int, ...], _CrossTable] = {}
        self._location: dict[str, Device] = {}  # where each group's self tables live
        bound = num_device_blocks if encoder_cache_blocks is None else min(encoder_cache_blocks, num_device_blocks)
        clock = itertools.count()
        self.encoder_cache = EncoderCache(self.pools[Device.DEVICE], bound, clock)
        bound = num_device_blocks if prefix_cache_blocks is None else min(prefix_cache_blocks, num_device_blocks)
        self.prefix_cache = PrefixCache(self.pools[Device.DEVICE], block_size, bound, clock)
        # Admissions: those that ran the encoder, shared a live table, or took a kept one.
        self.encoder_runs = 0
        self.encoder_live_shares = 0
        self.encoder_cache_hits = 0
        # Decoder prompt tokens of admitted sequences looked up, and those found cached.
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0

    # -- queries -----------------------------------------------------------
    def num_free_blocks(self, device: Device = Device.DEVICE) -> int:
        """Blocks no table holds: free ones, and on the device those the encoder
        cache keeps (any allocation evicts them as it needs)."""
        pool = self.pools[device]
        return pool.num_free + pool.num_kept

    def num_cached_blocks(self) -> int:
        """Device blocks the encoder cache keeps."""
        return self.encoder_cache.num_blocks

    def num_prefix_cached_blocks(self) -> int:
        """Device blocks the prefix cache keeps (no table holds them)."""
        return self.prefix_cache.num_blocks

    def num_total_blocks(self, device: Device = Device.DEVICE) -> int:
        return self.pools[device].num_blocks

    @property
    def usable_blocks(self) -> int:
        """Device blocks one group may ever hold: the pool less the watermark."""
        return self.pools[Device.DEVICE].num_blocks - self.watermark_blocks

    def refcount(self, device: Device, block: int) -> int:
        """Tables holding ``block`` of ``device``; 0 iff the block is free or kept."""
        return self.pools[device].refcount(block)

    def tables(self, device: Device) -> list[list[int]]:
        """Every table holding blocks of ``device``: self tables, and one cross
        table per group holding it (a shared one appears once per holder)."""
        out = [t for sid, t in self._self.items() if self._location[self._owner[sid]] is device]
        out += [t.blocks for t in self._cross.values() if t.device is device]
        return out

    def accounting_errors(self) -> list[str]:
        """Where the pools' accounting breaks its identity (empty: it holds): on each
        device every block's reference count equals the tables listing it, a listed
        block is not kept, the free count is the blocks neither held nor kept, and the
        kept ones are the caches'. For after a fault that may have left a change half
        made; O(blocks)."""
        errors = []
        for device, pool in self.pools.items():
            listed = Counter(b for t in self.tables(device) for b in t)
            wrong = [(b, pool.refcount(b), c) for b in range(pool.num_blocks)
                     if pool.refcount(b) != (c := listed.get(b, 0))]
            if wrong:
                errors.append(f"{device.value}: {len(wrong)} blocks' reference counts differ from the tables "
                              f"listing them (block, count, tables: {wrong[:5]})")
            kept = set(pool.kept_ids())
            if kept & listed.keys():
                errors.append(f"{device.value}: blocks {sorted(kept & listed.keys())[:5]} are kept and listed")
            if pool.num_free != len(pool.free_ids()) or pool.num_kept != len(kept):
                errors.append(f"{device.value}: {pool.num_free} free and {pool.num_kept} kept counted, "
                              f"{len(pool.free_ids())} and {len(kept)} found")
            cached = self.encoder_cache.num_blocks + self.prefix_cache.num_blocks if device is Device.DEVICE else 0
            if len(kept) != cached:
                errors.append(f"{device.value}: {len(kept)} blocks kept but the caches hold {cached}")
        return errors

    def device_of(self, group: SequenceGroup) -> Device | None:
        """Where the group's self tables live; None when it holds nothing."""
        return self._location.get(group.request_id)

    def cross_device(self, group: SequenceGroup) -> Device | None:
        """Where the group's cross table lives (a shared one may stay on the device
        while the group is swapped out); None when it holds none."""
        table = self._cross.get(group.request_id)
        return table.device if table else None

    def has_block_table(self, seq: Sequence) -> bool:
        return seq.seq_id in self._self

    def get_block_table(self, seq: Sequence) -> list[int]:
        return self._self[seq.seq_id]

    def get_cross_block_table(self, group: SequenceGroup) -> list[int]:
        return self._cross[group.request_id].blocks

    def cross_positions(self, group: SequenceGroup) -> int:
        """Encoder positions the group's cross table holds: fewer than the encoder's once
        compressed."""
        positions = self._cross[group.request_id].positions
        return group.encoder_len if positions is None else positions

    def cross_view(self, group: SequenceGroup) -> tuple[int, list[int]]:
        """``cross_positions`` and the cross table (the live list: not to be changed) in
        one call, for the scheduler's per-group step data."""
        table = self._cross[group.request_id]
        return (group.encoder_inputs.num_positions if table.positions is None else table.positions), table.blocks

    def is_cross_compressed(self, group: SequenceGroup) -> bool:
        table = self._cross.get(group.request_id)
        return table is not None and table.positions is not None

    def compress_cross(self, group: SequenceGroup, positions: int) -> tuple[list[int], list[int]] | None:
        """Give the group a cross table of its own holding ``positions`` encoder positions.
        Its sole holder keeps the first blocks of its table and frees the rest (the worker
        re-packs in place: it gathers every kept K/V before writing any); a shared table
        stays with its other holders and the group gets new device blocks. Returns the
        (old, new) blocks, whose K/V the worker re-packs before anything else in the step
        reads or writes them; None when new blocks are needed and do not fit now."""
        rid = group.request_id
        old = self._cross[rid]
        if old.device is not Device.DEVICE or old.positions is not None:
            raise RuntimeError(f"request {rid!r}: only an uncompressed cross table on the device is compressed")
        n = blocks_for(positions, self.block_size)
        src = list(old.blocks)
        if old.holders == {rid}:  # in place: no room needed, so a full pool still compresses
            self._unlist(old)
            self.pools[Device.DEVICE].decref(old.blocks[n:])
            self._drop_holder(old.key)
            old.key, old.blocks, old.positions, old.filled = ("kv_compress", rid), old.blocks[:n], positions, True
            self._key_holders[old.key] = 1
            return src, list(old.blocks)
        if n > self.num_free_blocks():
            return None
        self._make_room(n)
        blocks = self.pools[Device.DEVICE].allocate(n)
        self.free_cross(group)
        self._cross[rid] = _CrossTable(("kv_compress", rid), blocks, Device.DEVICE, {rid}, filled=True,
                                       positions=positions)
        self._key_holders[("kv_compress", rid)] = 1
        self._location.setdefault(rid, Device.DEVICE)
        return src, blocks

    def trim_cross(self, group: SequenceGroup, num_blocks: int) -> int:
        """kv_compress per head: keep the first ``num_blocks`` (>= 1) of the group's
        compressed cross table on the device, free the rest; returns how many were freed."""
        table = self._cross[group.request_id]
        if table.positions is None or table.device is not Device.DEVICE:
            raise RuntimeError(f"request {group.request_id!r}: only a compressed cross table on the device is trimmed")
        n = max(1, num_blocks)
        freed = table.blocks[n:]
        if freed:
            self.pools[Device.DEVICE].decref(freed)
            table.blocks = table.blocks[:n]
            table.positions = min(table.positions, n * self.block_size)
        return len(freed)

    def group_blocks(self, group: SequenceGroup) -> int:
        """Distinct blocks the group holds now (its cross table included, wherever it is)."""
        cross = self._cross.get(group.request_id)
        return len(self._distinct_self(group)) + (len(cross.blocks) if cross else 0)

    def cross_is_live(self, group: SequenceGroup) -> bool:
        """Whether a group on the device holds a cross table of the same encoder
        input, so that allocating the group would share it and not run the encoder."""
        return group.encoder_key in self._live_cross

    def cross_is_cached(self, group: SequenceGroup) -> bool:
        """Whether the encoder cache keeps a table of the same encoder input (and no
        live one exists): allocating the group would take it, not run the encoder."""
        key = group.encoder_key
        return key not in self._live_cross and key in self.encoder_cache

    def has_encoder_output(self, group: SequenceGroup) -> bool:
        """Whether allocating the group now would skip its encoder: a cross table
        of the same input is live or kept on the device."""
        key = group.encoder_key
        return key in self._live_cross or key in self.encoder_cache

    def blocks_needed(self, group: SequenceGroup, extra_tokens: int = 0, share_cross: bool = False) -> int:
        """Device blocks a fresh allocation of the group needs, with ``extra_tokens``
        more per sequence; shared blocks count once. The cross table counts
        unless ``share_cross`` and a live one of the same input exists (a kept
        one counts: taking it uses up blocks counted as free); with
        ``share_cross``, live decoder-prompt blocks it would share do not count."""
        seqs = group.unfinished_seqs()
        shared = self._shared_prompt_blocks(seqs, fresh=extra_tokens == 0)
        cross = 0 if share_cross and self.cross_is_live(group) else blocks_for(group.encoder_len, self.block_size)
        live_prompt = 0
        if share_cross:
            pool = self.pools[Device.DEVICE]
            live_prompt = sum(pool.refcount(b) > 0 for b in self._prefix_hits(group))
        own = sum(blocks_for(len(s) + extra_tokens, self.block_size) - shared for s in seqs)
        return cross - live_prompt + shared + own

    def _prefix_hits(self, group: SequenceGroup) -> list[int]:
        return self.prefix_cache.lookup(group.encoder_key, group.unfinished_seqs())

    def num_prefix_hit_tokens(self, group: SequenceGroup) -> int:
        """Decoder prompt tokens each of the group's sequences would find cached if
        allocated now (it computes that many fewer)."""
        return len(self._prefix_hits(group)) * self.block_size

    def _shared_prompt_blocks(self, seqs: list[Sequence], fresh: bool) -> int:
        """Blocks at the front of the self tables all ``seqs`` share: the full
        blocks of their common decoder prompt, and its partly filled last block
        too while no sequence has gone past the prompt (``fresh``)."""
        if not seqs:
            return 0
        prompt = seqs[0].prompt_token_ids
        if any(s.prompt_token_ids != prompt for s in seqs[1:]):
            return 0
        if fresh and all(len(s) == len(prompt) for s in seqs):
            return blocks_for(len(prompt), self.block_size)
        return len(prompt) // self.block_size

    # -- allocation --------------------------------------------------------
    def admission(self, group: SequenceGroup) -> Admission:
        """What admitting the group now takes (``Admission``), each part found once:
        ``can_allocate``'s answer, ``blocks_needed``'s, whether its encoder runs
        (``has_encoder_output``), its prefix-cache hits; ``allocate`` takes it as made."""
        seqs = group.unfinished_seqs()
        key, bs = group.encoder_key, self.block_size
        live = key in self._live_cross
        hits = self.prefix_cache.lookup(key, seqs) if self.prefix_cache.enabled else []
        n_shared = self._shared_prompt_blocks(seqs, fresh=True)
        own = sum([-(-len(s) // bs) for s in seqs]) - n_shared * len(seqs)
        cross = -(-group.encoder_inputs.num_positions // bs)
        need = (0 if live else cross) + n_shared + own
        if hits:  # live ones are shared, not taken
            refs = self.pools[Device.DEVICE].refcounts
            need -= sum([refs.item(b) > 0 for b in hits])
        # NEVER counts the cross table even when a live one could be shared:
        # the sharers may be gone by the time the group is admitted.
        pool = self.pools[Device.DEVICE]
        if cross + n_shared + own > pool.num_blocks - self.watermark_blocks:  # usable_blocks
            status = AllocStatus.NEVER
        elif pool.num_free + pool.num_kept - need >= self.watermark_blocks:  # num_free_blocks()
            status = AllocStatus.OK
        else:
            status = AllocStatus.LATER
        return Admission(seqs, key, hits, not (live or key in self.encoder_cache), n_shared, own, need, status)

    def can_allocate(self, group: SequenceGroup) -> AllocStatus:
        return self.admission(group).status

    def allocate(self, group: SequenceGroup, admission: Admission | None = None) -> bool:
        """Give the group its cross table and the self tables of its unfinished
        sequences on the device. Returns whether its encoder must run: True if
        it created the cross table, False if it shares a live one (filled in an
        earlier step, or by its creator earlier in the same forward pass) or took
        one the encoder cache kept. Sequences whose decoder prompt begins with
        cached blocks (``prefix_cache.py``) share them and start computed past
        them (``num_computed_tokens``). ``admission``: the group's, made with nothing
        changed since (found now when not given)."""
        rid = group.request_id
        if rid in self._location or rid in self._cross:
            raise RuntimeError(f"request {rid!r} already holds blocks")
        a = self.admission(group) if admission is None else admission
        pool, bs = self.pools[Device.DEVICE], self.block_size
        if a.need > self.num_free_blocks():
            raise RuntimeError(f"not enough free blocks to allocate request {rid!r}")
        # First: kept blocks it takes (prompt blocks, a cross table) are not evicted below.
        hits = a.hits
        if hits:
            self.prefix_cache.acquire(hits)
        run_encoder = self._acquire_cross(group, a.key)
        seqs = a.seqs
        # Every sequence computes its prompt tokens in the first step and writes
        # the same K/V (same tokens, positions and encoder) into the shared slots.
        n_shared = a.n_shared  # >= len(hits): hits are full prompt blocks
        new = n_shared - len(hits)
        if pool.num_free < new + a.own:
            self._make_room(new + a.own)
        tables, owner, caching = self._self, self._owner, self.prefix_cache.enabled
        if len(seqs) == 1:
            # One sequence (``a.own``: its blocks past the shared ones): shared and own
            # blocks in one allocation, the same ids in the same order as two.
            n = new + a.own
            tables[seqs[0].seq_id] = hits + pool.allocate(n) if n else list(hits)
            owner[seqs[0].seq_id] = rid
        elif seqs:
            shared = hits + pool.allocate(new) if new else hits
            pool.incref(shared, times=len(seqs) - 1)
            for seq in seqs:
                own = -(-len(seq.token_ids) // bs) - n_shared
                tables[seq.seq_id] = shared + pool.allocate(own) if own else list(shared)
                owner[seq.seq_id] = rid
        if caching:
            for seq in seqs:
                seq.num_computed_tokens = len(hits) * bs
                self.prefix_queried_tokens += len(seq.prompt_token_ids)
                self.prefix_hit_tokens += seq.num_computed_tokens
        self._location[rid] = Device.DEVICE
        return run_encoder

    def _make_room(self, n: int) -> None:
        """Evict kept blocks, the least recently kept of either cache first, until
        ``n`` device blocks are free (or nothing is kept)."""
        enc, pre, pool = self.encoder_cache, self.prefix_cache, self.pools[Device.DEVICE]
        while pool.num_free < n:
            a, b = enc.oldest_stamp(), pre.oldest_stamp()
            if a is None and b is None:
                return
            if b is None or (a is not None and a < b):
                enc.evict_oldest()
            else:
                pre.evict_oldest()

    def _register_prompt(self, seq: Sequence, table: list[int]) -> None:
        cross = self._cross.get(self._owner[seq.seq_id])
        if self.prefix_cache.enabled and cross is not None:  # the chain's root is its key
            self.prefix_cache.register_computed(seq, table, cross.key)

    def _release(self, device: Device, blocks: list[int]) -> None:
        """Drop a reference per entry of ``blocks``; on the device, the prefix cache
        keeps registered blocks that lose their last one."""
        if device is Device.DEVICE:
            self.prefix_cache.release(blocks)
        else:
            self.pools[device].decref(blocks)

    def _acquire_cross(self, group: SequenceGroup, key: Hashable) -> bool:
        rid = group.request_id
        table = self._live_cross.get(key)
        created = False
        if table is not None:
            self.pools[Device.DEVICE].incref(table.blocks)
            self.encoder_live_shares += 1
        elif (blocks := self.encoder_cache.take(key)) is not None:
            table = self._live_cross[key] = _CrossTable(key, blocks, Device.DEVICE, filled=True)
            self.encoder_cache_hits += 1
        else:
            n = blocks_for(group.encoder_len, self.block_size)
            if self.pools[Device.DEVICE].num_free < n:
                self._make_room(n)
            blocks = self.pools[Device.DEVICE].allocate_run(n)
            table = self._live_cross[key] = _CrossTable(key, blocks, Device.DEVICE)
            self.encoder_runs += 1
            created = True
        table.holders.add(rid)
        self._cross[rid] = table
        self._key_holders[key] = self._key_holders.get(key, 0) + 1
        return created

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Give ``child`` (a sequence of the parent's group) the parent's self
        table, sharing every block; writes copy shared blocks first."""
        if child.seq_id in self._self:
            raise RuntimeError(f"sequence {child.seq_id} already holds blocks")
        table, rid = self._self[parent.seq_id], self._owner[parent.seq_id]
        self.pools[self._location[rid]].incref(table)
        self._self[child.seq_id] = list(table)
        self._owner[child.seq_id] = rid
        self.prefix_cache.fork(parent.seq_id, child.seq_id)

    def take_over(self, pairs: list[tuple[Sequence, Sequence]]) -> tuple[list[tuple[list[int], int]], list[tuple[int, int]]]:
        """Each ``(src, dst)``: ``dst``, a sequence of ``src``'s group on the device (one
        of its tables, or a new one holding none), drops its own table and takes a copy
        of ``src``'s as its last step left it: ``src``'s full computed blocks shared, the
        blocks past them (the partly filled last one) copied into new blocks. A beam that
        continues another beam's hypothesis keeps its sequence this way, and its next
        step writes into a block it alone holds (no copy-on-write then). Sources are not
        destinations; a ``src`` as it was before the call is meant.

        Returns each dst's table (the live list) with the count of its leading blocks
        shared with ``src``'s, and the ``(src, dst)`` device blocks to copy before
        anything else writes or moves a block (``SchedulerOutput.blocks_to_copy_first``:
        their K/V as the last step left them). Blocks are released before the copies are
        allocated, so a dst's own last block makes room for its copy; when the pool has
        no room even so, the blocks past the full ones are shared too (copied on write
        by ``append_slots``, as a fork's). Where dst's table starts with blocks it is to
        share with src (beams of one request share their first blocks), those keep their
        references as they are: only the blocks that differ gain or lose one."""
        pool, bs, tables, owner = self.pools[Device.DEVICE], self.block_size, self._self, self._owner
        location, prefix = self._location, self.prefix_cache
        released: list[int] = []
        shared: list[int] = []
        tails: list[int] = []
        plan = []
        for src, dst in pairs:
            sid, did = src.seq_id, dst.seq_id
            table, rid = tables[sid], owner[sid]
            if location[rid] is not Device.DEVICE:
                raise RuntimeError(f"request {rid!r}: a sequence takes over another only on the device")
            n = min(src.num_computed_tokens // bs, len(table))
            old = tables.get(did)
            same = 0  # leading blocks dst holds already where it is to share src's: no reference moves
            if old is not None:
                if owner[did] != rid:
                    raise RuntimeError(f"sequences {sid} and {did} are not of one request")
                m = min(n, len(old))
                if old[:m] == table[:m]:
                    same = m
                else:
                    while old[same] == table[same]:  # stops before m: they differ there
                        same += 1
                released += old[same:]
            shared += table[same:n]
            tails += table[n:]
            plan.append((sid, did, rid, table, n))
        if prefix.enabled:
            for sid, did, *_ in plan:
                prefix.forget(did)
                prefix.fork(sid, did)
        # The shared blocks gain their references first; the release then frees only
        # blocks no src holds (src's blocks are never freed here). A dst's old table is
        # emptied first: a block its release lets the prefix cache evict is then listed
        # by no table at any moment (the pool's invariant, checked by tests/kv_machine.py).
        for _, did, *_ in plan:
            if did in tables:
                tables[did] = []
        pool.incref(shared)
        self._release(Device.DEVICE, released)
        copies: list[tuple[int, int]] = []
        out = []
        self._make_room(len(tails))
        if len(tails) <= pool.num_free:
            new = pool.allocate(len(tails))
            copies = list(zip(tails, new))
            i = 0
            for sid, did, rid, table, n in plan:
                k = len(table) - n
                t = tables[did] = table[:n] + new[i:i + k]
                i += k
                owner[did] = rid
                out.append((t, n))
        else:
            pool.incref(tails)
            for sid, did, rid, table, n in plan:
                t = tables[did] = table[:]
                owner[did] = rid
                out.append((t, len(t)))
        return out, copies

    def _written(self, seq: Sequence, table: list[int]) -> range:
        """Indices of the existing table blocks the next forward writes into (its
        draft tokens' slots included)."""
        n = len(seq) + len(seq.lookahead_token_ids)
        if seq.num_computed_tokens >= n:
            return range(0)
        end = min(len(table), blocks_for(n, self.block_size))
        return range(seq.num_computed_tokens // self.block_size, end)

    def _append_need(self, group: SequenceGroup, device: Device) -> int:
        """Blocks ``append_slots`` takes for the group's sequences: new blocks,
        plus one copy per writer of a shared block (the last holder that writes
        keeps the original)."""
        # Hot: runs for every running group every step, so plain loops, no Counter.
        pool, need, bs = self.pools[device], 0, self.block_size
        writers: dict[int, int] = {}
        for seq in group.seqs:
            table = self._self.get(seq.seq_id)
            if table is None:
                continue
            n, computed = len(seq) + len(seq.lookahead_token_ids), seq.num_computed_tokens
            full = -(-n // bs)
            if full > len(table):
                need += full - len(table)
            if computed >= n:
                continue
            for i in range(computed // bs, min(len(table), full)):
                b = table[i]
                if pool.refcount(b) > 1:
                    writers[b] = writers.get(b, 0) + 1
        return need + sum(w if pool.refcount(b) > w else w - 1 for b, w in writers.items())

    def can_append_slots(self, group: SequenceGroup) -> bool:
        return self._append_need(group, Device.DEVICE) <= self.num_free_blocks()

    def append_in_place(self, group: SequenceGroup) -> list[Sequence] | None:
        """A decode step's fast path: when each of the group's sequences that holds a
        table is running, computes exactly one token (no drafts) and that token's slot
        lies in a block of its table it alone holds, ``can_append_slots`` holds and
        ``append_slots`` would allocate and copy nothing: register what the prefix cache
        takes (as ``append_slots`` does) and return the running sequences. None when any
        sequence needs more (the caller takes the general path; nothing was done)."""
        hit = self.append_in_place_all([group]).get(group.request_id)
        return None if hit is None else hit[1]

    def append_in_place_all(self, groups: list[SequenceGroup],
                            openers: dict[str, list[Sequence]] | None = None) -> dict[str, tuple]:
        """``append_in_place`` for many groups in one call, with what a step record of
        each needs from here, so the scheduler's usual decode step costs no Python call
        per group: request id -> ``(group, running sequences, their self tables, cross
        positions, cross blocks)`` for each group that passes (tables as live lists, not
        to be changed; the cross fields None when the group holds no cross table). The
        others are left out, nothing done for them. A plain tuple: building a named one
        is a Python call per group.

        ``openers``: when given, a sequence whose one new token opens a block (its table's
        blocks are all full) does not keep its group out: the group passes, and its
        opening sequences are listed under its request id, for the caller to give each a
        block (:meth:`open_blocks`) or to send the group down the general path. Nothing
        is allocated here."""
        refs, bs, tables, cross_of = self.pools[Device.DEVICE].refcounts, self.block_size, self._self, self._cross
        running_status = SequenceStatus.RUNNING
        out: dict[str, tuple] = {}
        registered = self.prefix_cache.max_blocks  # enabled: full prompt blocks to register
        for group in groups:
            running, held, opening = [], [], None
            for seq in group.seqs:
                table = tables.get(seq.seq_id)
                if seq.status is not running_status:
                    if table is not None:
                        break
                    continue
                computed = seq.num_computed_tokens
                if table is None or seq.lookahead_token_ids or len(seq.token_ids) - computed != 1:
                    break
                i = computed // bs
                if i >= len(table):
                    if openers is None or i != len(table):
                        break
                    if opening is None:
                        opening = []
                    opening.append(seq)
                elif refs.item(table[i]) != 1:  # item: a Python int, no numpy scalar made
                    break
                running.append(seq)
                held.append(table)
            else:
                if opening is not None:
                    openers[group.request_id] = opening
                cross = cross_of.get(group.request_id)
                if cross is None:
                    out[group.request_id] = (group, running, held, None, None)
                else:
                    positions = group.encoder_inputs.num_positions if cross.positions is None else cross.positions
                    out[group.request_id] = (group, running, held, positions, cross.blocks)
                if registered:
                    for seq, table in zip(running, held):
                        if seq.num_computed_tokens >= bs and len(seq.prompt_token_ids) >= bs:
                            self._register_prompt(seq, table)
        return out

    def open_blocks(self, seqs: list[Sequence]) -> list[int]:
        """One new device block at the end of each sequence's self table, in order, for
        sequences whose next token opens a block (``append_in_place_all``'s openers):
        what ``append_slots`` would do for them, block for block (a kept block is
        evicted only when none is free). Returns the new blocks."""
        pool, tables, make_room = self.pools[Device.DEVICE], self._self, self._make_room
        new = []
        for seq in seqs:
            make_room(1)
            block = pool.allocate(1)[0]
            tables[seq.seq_id].append(block)
            new.append(block)
        return new

    def reserve_run(self, rows: list[tuple[Sequence, int]], n: int) -> list[list[int]] | None:
        """Blocks for a run of ``n`` decode steps (``core/sched/multi_step.py``): each
        ``(sequence, computed)``'s positions ``computed .. computed + n - 1`` get a
        block of its self table that it alone holds, new ones appended at its end.
        Returns each row's new blocks, or None (nothing taken) when a position falls in
        a block the sequence shares or the free blocks do not cover the new ones."""
        refs, bs, tables = self.pools[Device.DEVICE].refcounts, self.block_size, self._self
        need = []
        for seq, computed in rows:
            table = tables[seq.seq_id]
            last = (computed + n - 1) // bs  # the run's last position's block index
            for i in range(computed // bs + 1, min(last + 1, len(table))):  # the first one: append_in_place_all's
                if refs.item(table[i]) != 1:
                    return None
            need.append(max(0, last + 1 - len(table)))
        if sum(need) > self.num_free_blocks():
            return None
        pool, make_room = self.pools[Device.DEVICE], self._make_room
        new = []
        for (seq, _), k in zip(rows, need):
            blocks = []
            for _ in range(k):
                make_room(1)
                blocks.append(pool.allocate(1)[0])
            tables[seq.seq_id].extend(blocks)
            new.append(blocks)
        return new

    def append_slots(self, seq: Sequence) -> list[tuple[int, int]]:
        """Make the sequence's self table hold all its tokens and its draft tokens
        (``lookahead_token_ids``), copying each shared block its new tokens go into.
        Returns the ``(src, dst)`` device blocks the engine must copy before the
        forward pass."""
        pool, table = self.pools[Device.DEVICE], self._self[seq.seq_id]
        self._register_prompt(seq, table)  # what the last step computed, before new admissions look
        copies: list[tuple[int, int]] = []
        for i in self._written(seq, table):
            old = table[i]
            if pool.refcount(old) > 1:  # never a registered block: those are full and computed
                self._make_room(1)
                table[i] = pool.allocate(1)[0]
                pool.decref([old])
                copies.append((old, table[i]))
        grow = blocks_for(len(seq) + len(seq.lookahead_token_ids), self.block_size) - len(table)
        if grow > 0:
            self._make_room(grow)
            table.extend(pool.allocate(grow))
        return copies

    def rollback_slots(self, seq: Sequence) -> int:
        """Free the self-table blocks past what the sequence's tokens need (after
        rejected draft tokens: blocks that held only those). Returns how many."""
        table = self._self[seq.seq_id]
        keep = blocks_for(len(seq) + len(seq.lookahead_token_ids), self.block_size)
        extra = table[keep:]
        if extra:
            del table[keep:]
            self._release(self._location[self._owner[seq.seq_id]], extra)
        return len(extra)

    # -- swapping ----------------------------------------------------------
    def _distinct_self(self, group: SequenceGroup) -> list[int]:
        return list(dict.fromkeys(b for s in group.seqs for b in self._self.get(s.seq_id, ())))

    def _cross_moves(self, group: SequenceGroup, src: Device) -> bool:
        """Whether the group's cross table moves with it: it leaves the device only
        when no other holder runs there, and comes back with the first holder."""
        table = self._cross.get(group.request_id)
        if table is None or table.device is not src:
            return False
        return src is Device.HOST or all(
            self._location[h] is not Device.DEVICE for h in table.holders if h != group.request_id
        )

    def _blocks_to_move(self, group: SequenceGroup, src: Device) -> int:
        cross = len(self._cross[group.request_id].blocks) if self._cross_moves(group, src) else 0
        return len(self._distinct_self(group)) + cross

    def can_swap_in(self, group: SequenceGroup) -> bool:
        # The group's blocks plus what append_slots takes right after the move
        # (not a flat spare per sequence: that can exceed the whole pool for a
        # group the engine admitted, which would then never come back).
        need = self._blocks_to_move(group, Device.HOST) + self._append_need(group, Device.HOST)
        return self.num_free_blocks() - need >= self.watermark_blocks

    def can_swap_out(self, group: SequenceGroup) -> bool:
        return self._blocks_to_move(group, Device.DEVICE) <= self.pools[Device.HOST].num_free

    def swap_in(self, group: SequenceGroup) -> list[tuple[int, int]]:
        return self._move(group, Device.HOST, Device.DEVICE)

    def swap_out(self, group: SequenceGroup) -> list[tuple[int, int]]:
        return self._move(group, Device.DEVICE, Device.HOST)

    def _move(self, group: SequenceGroup, src: Device, dst: Device) -> list[tuple[int, int]]:
        """Move the group's blocks, each distinct block once (sharing is kept on
        the other pool); returns the ``(src, dst)`` block pairs to copy."""
        rid = group.request_id
        if self._location.get(rid) is not src:
            raise RuntimeError(f"request {rid!r} is not on {src.value}")
        src_pool, dst_pool = self.pools[src], self.pools[dst]
        n_move = self._blocks_to_move(group, src)
        if n_move > self.num_free_blocks(dst):
            raise RuntimeError(f"not enough free {dst.value} blocks to move request {rid!r}")
        if dst is Device.DEVICE:
            self._make_room(n_move)
        mapping: list[tuple[int, int]] = []
        cross = self._cross.get(rid)
        if self._cross_moves(group, src):
            holders = len(cross.holders)
            new = dst_pool.allocate_run(len(cross.blocks))
            dst_pool.incref(new, times=holders - 1)
            src_pool.decref(cross.blocks, times=holders)
            mapping += zip(cross.blocks, new)
            self._unlist(cross)
            cross.blocks, cross.device = new, dst
            if dst is Device.DEVICE and cross.positions is None:  # a compressed one is never shared
                self._live_cross.setdefault(cross.key, cross)
        sids = [s.seq_id for s in group.seqs if s.seq_id in self._self]
        counts = Counter(b for sid in sids for b in self._self[sid])
        new = dst_pool.allocate(len(counts))
        to_new = dict(zip(counts, new))
        dst_pool.incref([to_new[b] for b, c in counts.items() for _ in range(c - 1)])
        for sid in sids:
            self._self[sid] = [to_new[b] for b in self._self[sid]]
            self.prefix_cache.forget(sid)  # its blocks are new: registered again once back on the device
        self._location[rid] = dst
        # Released once no table lists them: registered prompt blocks stay on the device, kept,
        # and keeping one may evict another at once (never a block a table still holds).
        self._release(src, list(counts.elements()))
        mapping += to_new.items()
        return mapping

    # -- freeing -----------------------------------------------------------
    def free(self, seq: Sequence, group: SequenceGroup) -> None:
        """Drop the sequence's self table (a no-op if it holds none)."""
        self._free_table(seq, group)
        self._forget_if_empty(group)

    def _free_table(self, seq: Sequence, group: SequenceGroup) -> None:
        table = self._self.pop(seq.seq_id, None)
        if table is None:
            return
        device = self._location[group.request_id]
        if self.prefix_cache.max_blocks:  # enabled (else it holds nothing of the sequence)
            if device is Device.DEVICE:
                self._register_prompt(seq, table)  # its last step's prompt blocks too
            del self._owner[seq.seq_id]
            self.prefix_cache.forget(seq.seq_id)
            self._release(device, table)
        else:
            del self._owner[seq.seq_id]
            self.pools[device].decref(table)

    def free_cross(self, group: SequenceGroup) -> None:
        """Drop the group's reference to its cross table; the last holder frees it."""
        rid = group.request_id
        table = self._cross.pop(rid, None)
        if table is not None:
            self._drop_holder(table.key)
            table.holders.discard(rid)
            # A group whose step ran holds the encoder's K/V: its own run or its creator's.
            table.filled |= group.encoder_computed
            if table.holders:
                self.pools[table.device].decref(table.blocks)
            else:
                self._unlist(table)
                if (table.filled and table.device is Device.DEVICE and table.positions is None
                        and table.key not in self._live_cross):
                    self.encoder_cache.keep(table.key, table.blocks)  # frees it when over the bound
                else:
                    self.pools[table.device].decref(table.blocks)
        self._forget_if_empty(group)

    def _unlist(self, table: _CrossTable) -> None:
        """Take a cross table out of the share index, handing its place to another
        device-resident table of the same input if there is one."""
        if self._live_cross.get(table.key) is not table:
            return
        del self._live_cross[table.key]
        if self._key_holders.get(table.key, 0) == len(table.holders):
            return  # every holder of its key holds this table: there is no other
        for other in self._cross.values():
            if other is not table and other.device is Device.DEVICE and other.key == table.key:
                self._live_cross[table.key] = other
                break

    def _drop_holder(self, key: Hashable) -> None:
        n = self._key_holders[key] - 1
        if n:
            self._key_holders[key] = n
        else:
            del self._key_holders[key]

    def _forget_if_empty(self, group: SequenceGroup) -> None:
        rid = group.request_id
        if rid not in self._cross and not any(s.seq_id in self._self for s in group.seqs):
            self._location.pop(rid, None)

    def free_group(self, group: SequenceGroup) -> None:
        """Drop every reference the group holds: each self table, then the cross table."""
        for seq in group.seqs:
            self._free_table(seq, group)
        self.free_cross(group)  # and the group is forgotten once it holds nothing

    def clear_encoder_cache(self) -> None:
        """Evict every kept cross table and decoder-prompt block."""
        self.encoder_cache.evict_all()
        self.prefix_cache.evict_all()

    def reset(self) -> None:
        for pool in self.pools.values():
            pool.reset()
        self.encoder_cache.clear()
        self.prefix_cache.clear()
        self._self.clear()
        self._owner.clear()
        self._cross.clear()
        self._key_holders.clear()
        self._live_cross.clear()
        self._location.clear()
