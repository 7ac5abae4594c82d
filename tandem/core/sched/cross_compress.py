"""kv_compress, the scheduler's half: when a request's cross table is compressed, and
to how many positions.

A running group whose every running sequence has computed its decoder prompt plus
the observation window (``KVCompressConfig.window`` positions) gets a cross table of
its own holding ``kept_positions`` slots (``BlockManager.compress_cross``); the worker
chooses which encoder position each (layer, KV head) keeps there, from the attention
it observed (``tandem/core/worker/cross_compress.py``). This runs first in
``schedule()``, so the re-pack happens before anything else of the step touches the
blocks it reads or writes.
"""

from __future__ import annotations

from tandem.core.kv.block_manager import BlockManager
from tandem.core.kv.block_pool import Device, blocks_for
from tandem.core.kv_compress_config import KVCompressConfig
from tandem.core.scheduler_output import CrossRepack
from tandem.core.sequence import SequenceGroup, SequenceStatus


class CrossCompressor:
    def __init__(self, config: KVCompressConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.num_compressed = 0  # requests compressed so far
        self.blocks_freed = 0  # device blocks their compression released (shared ones included)

    def _kept(self, group: SequenceGroup) -> int | None:
        """Positions the group keeps, None when compressing frees no block."""
        n, bs = group.encoder_len, self.block_manager.block_size
        kept = self.config.kept_positions(n, bs)
        return kept if blocks_for(kept, bs) < blocks_for(n, bs) else None

    def observe_until(self, group: SequenceGroup) -> int:
        """Decoder positions below this are observed this step (0: none: it is compressed,
        or compressing it would free nothing)."""
        if self.block_manager.is_cross_compressed(group) or self._kept(group) is None:
            return 0
        return max(len(s.prompt_token_ids) for s in group.seqs) + self.config.window

    def plan(self, group: SequenceGroup) -> CrossRepack | None:
        """Compress the running group's cross table if its window is over and the new
        blocks fit; the re-pack the worker does, or None."""
        bm = self.block_manager
        if bm.cross_device(group) is not Device.DEVICE or bm.is_cross_compressed(group):
            return None
        kept = self._kept(group)
        seqs = group.get_seqs(SequenceStatus.RUNNING)
        if kept is None or not seqs:
            return None
        end = self.observe_until(group)
        if any(s.num_computed_tokens < end for s in seqs):
            return None
        moved = bm.compress_cross(group, kept)
        if moved is None:  # no room now: tried again next step
            return None
        src, dst = moved
        self.num_compressed += 1
        self.blocks_freed += len(src) - len(dst)
        return CrossRepack(group.request_id, src, group.encoder_len, dst, kept)

    def trim(self, groups: dict[str, SequenceGroup], needed: dict[str, int]) -> None:
        """Per head: free the blocks past what each re-packed table still needs (the
        worker's count, ``ModelRunnerOutput.cross_blocks_needed``)."""
        for rid, n in needed.items():
            group = groups.get(rid)
            # (a table preempted since the re-pack keeps its blocks: swapped out, or dropped)
            bm = self.block_manager
            if group is not None and bm.is_cross_compressed(group) and bm.cross_device(group) is Device.DEVICE:
                self.blocks_freed += bm.trim_cross(group, n)
