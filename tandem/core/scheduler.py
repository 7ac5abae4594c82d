"""Continuous batching over encoder/decoder groups.

Each step: running groups first (each decoder sequence computes its new
tokens), preempting the most recently admitted groups when blocks run out;
then swapped groups come back; then waiting groups are admitted while the
token budget, ``max_num_seqs`` and free blocks allow. A group admitted this
step prefills its decoder prompt and, unless it shares the live cross table
of an identical encoder input, runs its encoder and fills its cross table in
the same step. Sequences about to write into shared blocks get copies first
(``blocks_to_copy``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Literal

from tandem.core.block_manager import AllocStatus, BlockManager
from tandem.core.config import EngineConfig, is_int
from tandem.core.sequence import (
    SchedulerOutputs,
    SequenceGroup,
    SequenceGroupMetadata,
    SequenceStatus,
)

PreemptionMode = Literal["recompute", "swap"]


@dataclass
class SchedulerConfig:
    # Defaults live in EngineConfig, the one home for engine settings.
    max_num_seqs: int = EngineConfig.max_num_seqs
    max_num_batched_tokens: int = EngineConfig.max_num_batched_tokens
    # None: recompute single-sequence groups, swap groups with n > 1.
    preemption_mode: PreemptionMode | None = None

    def __post_init__(self) -> None:
        if not is_int(self.max_num_seqs) or self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={self.max_num_seqs!r}: must be an integer >= 1")
        if not is_int(self.max_num_batched_tokens) or self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens!r}: must be an integer >= 1"
            )
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= "
                f"max_num_seqs={self.max_num_seqs} so every running sequence can decode"
            )
        if self.preemption_mode not in (None, "recompute", "swap"):
            raise ValueError(
                f"preemption_mode={self.preemption_mode!r}: must be None, 'recompute' or 'swap'"
            )


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[SequenceGroup] = deque()
        self.running: deque[SequenceGroup] = deque()
        self.swapped: deque[SequenceGroup] = deque()
        self.num_preemptions = 0
        # Encoder tokens of admitted groups that ran the encoder, and of those
        # that shared a live cross table of the same input instead.
        self.encoder_tokens_computed = 0
        self.encoder_tokens_reused = 0

    # -- queue management --------------------------------------------------
    def add(self, group: SequenceGroup) -> None:
        self.waiting.append(group)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped)

    def abort(self, request_ids: set[str]) -> list[SequenceGroup]:
        """Drop the groups, free their self and cross blocks; returns those found."""
        aborted = []
        for queue in (self.waiting, self.running, self.swapped):
            for group in [g for g in queue if g.request_id in request_ids]:
                queue.remove(group)
                for seq in group.unfinished_seqs():
                    seq.status = SequenceStatus.FINISHED_ABORTED
                self.block_manager.free_group(group)
                aborted.append(group)
        return aborted

    def clear(self) -> None:
        """Forget every queued group (their blocks are the caller's to free)."""
        self.waiting.clear()
        self.running.clear()
        self.swapped.clear()

    def finish(self, group: SequenceGroup) -> None:
        """Remove a finished group from the running queue and free its blocks."""
        self.running.remove(group)
        self.block_manager.free_group(group)

    # -- the step ----------------------------------------------------------
    def schedule(self) -> SchedulerOutputs:
        bm = self.block_manager
        budget = self.config.max_num_batched_tokens
        num_seqs = 0
        scheduled: list[SequenceGroupMetadata] = []
        swap_in: list[tuple[int, int]] = []
        swap_out: list[tuple[int, int]] = []
        copies: list[tuple[int, int]] = []
        preempted = 0

        # 1. Running groups, oldest first; evict from the back when short of blocks.
        queue, self.running = self.running, deque()
        while queue:
            group = queue.popleft()
            while not bm.can_append_slots(group):
                victim = queue.pop() if queue else group
                self._preempt(victim, swap_out)
                preempted += 1
                if victim is group:
                    break
            else:
                seqs = group.get_seqs(SequenceStatus.RUNNING)
                for seq in seqs:
                    copies += bm.append_slots(seq)
                budget -= sum(s.num_new_tokens for s in seqs)
                num_seqs += len(seqs)
                self.running.append(group)
                scheduled.append(self._metadata(group, run_encoder=False))

        # 2. Swapped groups come back only when nothing was evicted this step.
        while self.swapped and not preempted:
            group = self.swapped[0]
            seqs = group.get_seqs(SequenceStatus.SWAPPED)
            tokens = sum(s.num_new_tokens for s in seqs)
            if num_seqs + len(seqs) > self.config.max_num_seqs or tokens > budget:
                break
            if not bm.can_swap_in(group):
                break
            self.swapped.popleft()
            swap_in.extend(bm.swap_in(group))
            for seq in seqs:
                seq.status = SequenceStatus.RUNNING
                copies += bm.append_slots(seq)
            budget -= tokens
            num_seqs += len(seqs)
            self.running.append(group)
            scheduled.append(self._metadata(group, run_encoder=False))

        # 3. Waiting groups: run the encoder (unless shared) and prefill the decoder prompt.
        while self.waiting and not self.swapped and not preempted:
            group = self.waiting[0]
            seqs = group.unfinished_seqs()
            run_encoder = not bm.cross_is_live(group)
            tokens = (group.encoder_len if run_encoder else 0) + sum(len(s) for s in seqs)
            if num_seqs + len(seqs) > self.config.max_num_seqs or tokens > budget:
                break
            status = bm.can_allocate(group)
            if status is not AllocStatus.OK:
                # NEVER cannot happen for requests the engine validated on entry.
                break
            self.waiting.popleft()
            if bm.allocate(group) != run_encoder:
                raise RuntimeError(f"request {group.request_id!r}: cross table sharing changed while admitting")
            for seq in seqs:
                seq.status = SequenceStatus.RUNNING
            if run_encoder:
                self.encoder_tokens_computed += group.encoder_len
            else:
                self.encoder_tokens_reused += group.encoder_len
            budget -= tokens
            num_seqs += len(seqs)
            self.running.append(group)
            scheduled.append(self._metadata(group, run_encoder))

        self.num_preemptions += preempted
        return SchedulerOutputs(
            scheduled=scheduled,
            num_batched_tokens=self.config.max_num_batched_tokens - budget,
            blocks_to_swap_in=swap_in,
            blocks_to_swap_out=swap_out,
            preempted=preempted,
            blocks_to_copy=copies,
        )

    def _metadata(self, group: SequenceGroup, run_encoder: bool) -> SequenceGroupMetadata:
        bm = self.block_manager
        seqs = group.get_seqs(SequenceStatus.RUNNING)
        return SequenceGroupMetadata(
            request_id=group.request_id,
            run_encoder=run_encoder,
            seqs=seqs,
            block_tables={s.seq_id: bm.get_block_table(s) for s in seqs},
            encoder_token_ids=group.encoder_seq.token_ids,
            cross_block_table=bm.get_cross_block_table(group),
            group=group,
        )

    def _preempt(self, group: SequenceGroup, swap_out: list[tuple[int, int]]) -> None:
        bm = self.block_manager
        mode = self.config.preemption_mode
        if mode is None:
            mode = "recompute" if len(group.unfinished_seqs()) == 1 else "swap"
        if mode == "swap" and bm.can_swap_out(group):
            swap_out.extend(bm.swap_out(group))
            for seq in group.get_seqs(SequenceStatus.RUNNING):
                seq.status = SequenceStatus.SWAPPED
            self.swapped.append(group)
            return
        # Recompute: drop the group's references; its decoder tokens run again
        # later, its encoder too unless a sharer keeps the cross table alive.
        bm.free_group(group)
        group.reset_for_recompute()
        self.waiting.appendleft(group)
