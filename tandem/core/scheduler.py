"""Continuous batching over encoder/decoder groups.

``schedule()`` decides one step and returns plain data (``SchedulerOutput``);
the worker runs it; ``update_from_output()`` appends the sampled tokens, stops
sequences on EOS, stop token ids and length, and frees what finished.

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

import itertools
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Literal

from tandem.core.block_manager import AllocStatus, BlockManager
from tandem.core.config import EngineConfig, is_int
from tandem.core.scheduler_output import (
    BeamCandidates,
    ModelRunnerOutput,
    NewRequestData,
    ScheduledGroup,
    ScheduledSequence,
    SchedulerOutput,
)
from tandem.core.sequence import Sequence, SequenceGroup, SequenceStatus

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
    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        eos_token_ids: Iterable[int] = (),
        seq_ids: Iterator[int] | None = None,
    ) -> None:
        self.config = config
        # Ids for sequences made here (beams forked from beams, finished hypotheses).
        self.seq_ids = seq_ids if seq_ids is not None else itertools.count(1 << 40)
        self.block_manager = block_manager
        self.waiting: deque[SequenceGroup] = deque()
        self.running: deque[SequenceGroup] = deque()
        self.swapped: deque[SequenceGroup] = deque()
        self.num_preemptions = 0
        # Encoder tokens of admitted groups that ran the encoder, and of those
        # that shared a live cross table of the same input instead.
        self.encoder_tokens_computed = 0
        self.encoder_tokens_reused = 0
        self.eos_token_ids = frozenset(eos_token_ids)
        self.groups: dict[str, SequenceGroup] = {}  # live groups by request id
        # What the worker was last told, to send it only what changed.
        self._sent_tables: dict[int, list[int]] = {}
        self._announced: set[str] = set()
        self._finished_requests: list[str] = []
        self._finished_seqs: list[int] = []

    # -- queue management --------------------------------------------------
    def add(self, group: SequenceGroup) -> None:
        if group.request_id in self.groups:
            raise ValueError(f"request id {group.request_id!r} is already in use")
        self.groups[group.request_id] = group
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
                self._forget(group)
                aborted.append(group)
        # A group caught between queues (an exception or interrupt inside
        # schedule()) is in none of them: free it through the id map.
        for rid in request_ids & self.groups.keys():
            group = self.groups[rid]
            for seq in group.unfinished_seqs():
                seq.status = SequenceStatus.FINISHED_ABORTED
            self._forget(group)
            aborted.append(group)
        return aborted

    def clear(self) -> None:
        """Forget every queued group (their blocks are the caller's to free); the
        worker is told to forget those it knows on the next step."""
        self._finished_requests.extend(self._announced)
        self.waiting.clear()
        self.running.clear()
        self.swapped.clear()
        self.groups.clear()
        self._sent_tables.clear()
        self._announced.clear()

    def finish(self, group: SequenceGroup) -> None:
        """Remove a finished group from the running queue and free its blocks."""
        self.running.remove(group)
        self._forget(group)

    def _forget(self, group: SequenceGroup) -> None:
        self.block_manager.free_group(group)
        self.groups.pop(group.request_id, None)
        for seq in group.seqs:
            if self._sent_tables.pop(seq.seq_id, None) is not None:
                self._finished_seqs.append(seq.seq_id)  # the worker forgets its table
        if group.request_id in self._announced:
            self._announced.discard(group.request_id)
            self._finished_requests.append(group.request_id)

    # -- the step ----------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        bm = self.block_manager
        budget = self.config.max_num_batched_tokens
        num_seqs = 0
        scheduled: list[ScheduledGroup] = []
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
            if num_seqs + group.max_num_seqs > self.config.max_num_seqs or tokens > budget:
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
            num_seqs += group.max_num_seqs
            self.running.append(group)
            scheduled.append(self._metadata(group, run_encoder))

        self.num_preemptions += preempted
        new_requests = []
        for g in scheduled:
            if g.request_id not in self._announced:
                self._announced.add(g.request_id)
                new_requests.append(NewRequestData(g.request_id, self.groups[g.request_id].sampling_params))
        finished_requests, self._finished_requests = self._finished_requests, []
        finished_seqs, self._finished_seqs = self._finished_seqs, []
        return SchedulerOutput(
            scheduled=scheduled,
            num_batched_tokens=self.config.max_num_batched_tokens - budget,
            blocks_to_swap_in=swap_in,
            blocks_to_swap_out=swap_out,
            blocks_to_copy=copies,
            preempted=preempted,
            new_requests=new_requests,
            finished_request_ids=finished_requests,
            finished_seq_ids=finished_seqs,
        )

    def _metadata(self, group: SequenceGroup, run_encoder: bool) -> ScheduledGroup:
        bm = self.block_manager
        seqs = []
        for seq in group.get_seqs(SequenceStatus.RUNNING):
            table = bm.get_block_table(seq)
            sent = self._sent_tables.get(seq.seq_id)
            if sent is not None and len(table) >= len(sent) and table[: len(sent)] == sent:
                block_ids, replace = table[len(sent) :], False
            else:
                block_ids, replace = list(table), True
            # A sequence the worker has not seen but with computed tokens is a forked beam.
            prefix = seq.token_ids[: seq.num_computed_tokens] if sent is None and seq.num_computed_tokens else None
            self._sent_tables[seq.seq_id] = list(table)
            seqs.append(
                ScheduledSequence(
                    seq_id=seq.seq_id,
                    token_ids=seq.token_ids[seq.num_computed_tokens :],
                    num_computed_tokens=seq.num_computed_tokens,
                    block_ids=block_ids,
                    replace_blocks=replace,
                    num_output_tokens=len(seq.output_token_ids),
                    prefix_token_ids=prefix,
                )
            )
        return ScheduledGroup(
            request_id=group.request_id,
            seqs=seqs,
            encoder_inputs=group.encoder_inputs if run_encoder else None,
            num_encoder_positions=group.encoder_len,
            cross_block_table=list(bm.get_cross_block_table(group)),
            beam_scores=(
                group.beam_state.running_scores()
                if group.beam_state is not None and group.prompt_slot is None
                else None
            ),
            slot_choices=group.prompt_slot.choices if group.prompt_slot is not None else None,
        )

    # -- after the forward pass ----------------------------------------------
    def update_from_output(self, output: SchedulerOutput, result: ModelRunnerOutput) -> list[SequenceGroup]:
        """Append each sequence's sampled token, stop it on EOS, a stop token id or
        its length, and free what finished. Returns the groups that advanced, in
        schedule order (a group aborted since ``schedule()`` is skipped). A group
        whose update raises is added to ``result.failed_requests`` (the engine
        fails it alone) and the others go on."""
        row = {seq_id: i for i, seq_id in enumerate(result.seq_ids)}
        advanced = []
        for sg in output.scheduled:
            group = self.groups.get(sg.request_id)
            if group is None or sg.request_id in result.failed_requests:
                continue  # gone, or failed in the worker (the engine aborts it)
            try:
                if self._update_group(group, sg, result, row):
                    advanced.append(group)
            except Exception as e:  # noqa: BLE001 - this request's own update (its beams, its lengths)
                result.failed_requests[sg.request_id] = f"updating it after the step failed: {type(e).__name__}: {e}"
        return advanced

    def _update_group(self, group: SequenceGroup, sg: ScheduledGroup, result: ModelRunnerOutput, row) -> bool:
        # Sharers too: their cross table was filled by now, in this step or an earlier one.
        group.encoder_computed = True
        if group.prompt_slot is not None:
            self._fill_prompt_slot(group, sg, result.token_ids[row[sg.seqs[0].seq_id]])
            return False
        if group.beam_state is not None:
            self._update_beams(group, sg, result.beams[sg.request_id])
            return True
        any_finished = False
        by_id = {s.seq_id: s for s in group.seqs} if len(group.seqs) > 1 else None
        for ss in sg.seqs:
            seq = by_id[ss.seq_id] if by_id is not None else group.seqs[0]
            if seq.finished:
                continue
            i = row[ss.seq_id]
            seq.num_computed_tokens = ss.num_computed_tokens + len(ss.token_ids)
            if ss.seq_id in result.no_token_seq_ids:  # every token banned: nothing to append
                seq.status = SequenceStatus.FINISHED_NO_TOKEN
                any_finished = True
                continue
            seq.append_token(result.token_ids[i], result.logprobs[i], result.top_logprobs[i])
            self._check_stop(seq, group)
            if seq.status.finished:
                any_finished = True
        if any_finished:
            self.release_finished(group)
        return True

    def _update_beams(self, group: SequenceGroup, sg: ScheduledGroup, cands: BeamCandidates) -> None:
        """One beam step: the next running beams reuse, fork or drop this step's
        (a beam continued more than once forks: its blocks are shared, copied on
        write); a finished search leaves the best hypotheses as the group's sequences."""
        bm, state = self.block_manager, group.beam_state
        by_id = {s.seq_id: s for s in group.seqs}
        running = [by_id[ss.seq_id] for ss in sg.seqs]
        for ss, seq in zip(sg.seqs, running):
            seq.num_computed_tokens = ss.num_computed_tokens + len(ss.token_ids)
        num_out = len(running[0].output_token_ids)
        next_beams = state.step(
            cands, [s.output_token_ids for s in running], [s.output_logprobs for s in running], num_out
        )
        if state.done:
            for seq in running:
                self._drop_seq(seq, group)
            p = group.sampling_params
            finished = []
            for hyp, score in state.best(p.n):
                seq = Sequence(next(self.seq_ids), group.seqs[0].prompt_token_ids)
                if hyp is not None:
                    seq.output_token_ids = list(hyp.output_token_ids)
                    seq.token_ids = seq.prompt_token_ids + seq.output_token_ids
                    seq.output_logprobs = list(hyp.output_logprobs)
                    stopped = hyp.finished_by_stop
                    if stopped and hyp.output_token_ids[-1] not in self.eos_token_ids:
                        seq.stop_reason = hyp.output_token_ids[-1]
                else:
                    stopped = False
                seq.cumulative_logprob = score
                seq.status = SequenceStatus.FINISHED_STOPPED if stopped else SequenceStatus.FINISHED_LENGTH
                finished.append(seq)
            group.seqs = finished
            self.release_finished(group)
            return
        claimed: set[int] = set()
        plan = []
        for nb in next_beams:  # forks first, from the parents as they are
            parent = running[nb.parent]
            if nb.parent in claimed:
                child = parent.fork(next(self.seq_ids))
                bm.fork(parent, child)
                plan.append((child, nb))
            else:
                claimed.add(nb.parent)
                plan.append((parent, nb))
        for j, seq in enumerate(running):
            if j not in claimed:
                self._drop_seq(seq, group)
        for seq, nb in plan:
            seq.append_token(nb.token_id, nb.token_logprob, nb.top_logprobs)
            seq.cumulative_logprob = nb.score
        group.seqs = [seq for seq, _ in plan]

    def _fill_prompt_slot(self, group: SequenceGroup, sg: ScheduledGroup, token: int) -> None:
        """The model chose the slot's token: it and the slot's ``then`` tokens extend
        every sequence's decoder prompt (computed next step, with the first token)."""
        slot, group.prompt_slot = group.prompt_slot, None
        extra = [token, *slot.then]
        by_id = {s.seq_id: s for s in group.seqs}
        for ss in sg.seqs:
            seq = by_id[ss.seq_id]
            seq.num_computed_tokens = ss.num_computed_tokens + len(ss.token_ids)
            seq.prompt_token_ids = seq.prompt_token_ids + extra
            seq.token_ids = seq.token_ids + extra

    def _drop_seq(self, seq: Sequence, group: SequenceGroup) -> None:
        """Free a running beam the search left behind."""
        self.block_manager.free(seq, group)
        if self._sent_tables.pop(seq.seq_id, None) is not None:
            self._finished_seqs.append(seq.seq_id)

    def _check_stop(self, seq: Sequence, group: SequenceGroup) -> None:
        """Stops on token ids and length; stop strings are the output processor's."""
        p = group.sampling_params
        token = seq.output_token_ids[-1]
        num_out = len(seq.output_token_ids)
        if num_out >= p.min_tokens:
            if not p.ignore_eos and token in self.eos_token_ids:
                seq.status = SequenceStatus.FINISHED_STOPPED
                return
            if token in p.stop_token_ids:
                seq.status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, token
                return
        if num_out >= p.max_tokens:
            seq.status = SequenceStatus.FINISHED_LENGTH

    def release_finished(self, group: SequenceGroup) -> None:
        """Free the blocks of the group's finished sequences (stopped here or, by a
        stop string, by the output processor); retire the group once all are."""
        bm = self.block_manager
        for seq in group.seqs:
            if seq.finished and bm.has_block_table(seq):
                bm.free(seq, group)
                self._sent_tables.pop(seq.seq_id, None)
                self._finished_seqs.append(seq.seq_id)
        if group.is_finished and group.request_id in self.groups:
            self.finish(group)

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
