"""Continuous batching over encoder/decoder groups.

``schedule()`` decides one step and returns plain data (``SchedulerOutput``);
the worker runs it; ``update_from_output()`` appends the sampled tokens, stops
sequences on EOS, stop token ids and length, and frees what finished.

Each step: running groups first (each decoder sequence computes its new
tokens), preempting the most recently admitted groups when blocks run out;
then swapped groups come back; then waiting groups are admitted while the
token budget, ``max_num_seqs``, free blocks and the LoRA adapter slots
(``max_loras`` distinct adapters per step: ``lora_slots.py``) allow. A group admitted this
step prefills its decoder prompt and, unless it shares the live cross table
of an identical encoder input or takes one the encoder cache kept, runs its
encoder and fills its cross table in the same step. Sequences about to write into shared blocks get copies first
(``blocks_to_copy``).
"""

from __future__ import annotations

import itertools
import logging
import operator
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

from tandem.core.kv.block_manager import AllocStatus, BlockManager
from tandem.core.config import SchedulerConfig  # noqa: F401 - also imported from here
from tandem.core.core_outputs import RequestResult
from tandem.core.scheduler_output import (
    ModelRunnerOutput,
    NewRequestData,
    ScheduledGroup,
    ScheduledSequence,
    SchedulerOutput,
    table_update,
)
from tandem.core.sched.lora_slots import LoRASlots
from tandem.core.sched.multi_step import plan_run
from tandem.core.sequence import Sequence, SequenceGroup, SequenceStatus
from tandem.core.strategies.base import RequestStrategy, update_failure

if TYPE_CHECKING:
    from tandem.core.sched.cross_compress import CrossCompressor
    from tandem.core.strategies.modes import Modes

logger = logging.getLogger(__name__)

_index = operator.attrgetter("index")

# The base hooks (no drafts, no step mode: plain sampling), which a strategy that keeps
# them is not called for: once per running group every step.
_NO_LOOKAHEAD, _NO_STEP_MODE = RequestStrategy.lookahead, RequestStrategy.step_mode


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        eos_token_ids: Iterable[int] = (),
        seq_ids: Iterator[int] | None = None,
        modes: "Modes | None" = None,
        cross_compress: "CrossCompressor | None" = None,
        adapter_ready: "Callable[[SequenceGroup], bool] | None" = None,
    ) -> None:
        self.config = config
        # Whether a group's LoRA adapter is in the workers' CPU caches (the engine reads
        # adapters off the step: tandem/lora/loader.py); None: every group's is.
        self.adapter_ready = adapter_ready
        # kv_compress (``cross_compress.py``): None when off.
        self.cross_compress = cross_compress
        # The engine's modes: their batch hooks run before each step over the running
        # groups, and are told when a group stops running.
        self.modes = modes
        # Ids for sequences made here (forks, and what strategies make).
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
        # The last step's steady records of one sequence, by request id: the next step
        # advances them in place (``_steady``) rather than building new ones.
        self._singles: dict[str, ScheduledGroup] = {}
        self._finished_requests: list[str] = []
        self._finished_seqs: list[int] = []
        # Sequences that took another's place since the last step (``take_over``): what
        # the worker copies first (``SchedulerOutput.seq_copies``, ``blocks_to_copy_first``).
        self._seq_copies: list[tuple[int, int, int, list[int]]] = []
        self._copies_first: list[tuple[int, int]] = []
        self._failures: dict[str, str] = {}  # request id -> why it cannot run
        # Set when the block manager raised while scheduling: the engine checks the
        # pool's accounting once the failed requests are freed (and clears it).
        self.block_fault = False
        # At most max_loras distinct LoRA adapters per step (lora_slots.py).
        self.lora_slots = LoRASlots(config.max_loras)

    # -- queue management --------------------------------------------------
    def add(self, group: SequenceGroup) -> None:
        if group.request_id in self.groups:
            raise ValueError(f"request id {group.request_id!r} is already in use")
        if group.strategy is None:
            # The engine gives every request the strategy its modes stack (Modes.plan).
            raise ValueError(f"request {group.request_id!r} has no strategy: give it one before adding it")
        self.groups[group.request_id] = group
        self.waiting.append(group)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped)

    def abort(self, request_ids: set[str]) -> list[RequestResult]:
        """Drop the groups, free their self and cross blocks; returns the final
        result of each one found (its unfinished sequences ``abort``-ed)."""
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
        return [self._aborted_result(g) for g in aborted]

    @staticmethod
    def _aborted_result(group: SequenceGroup) -> RequestResult:
        try:
            deltas = group.strategy.aborted(group)
        except Exception:  # noqa: BLE001 - a strategy left inconsistent by a failed update: its sequences as they are
            logger.exception("request %r: its strategy's aborted() raised; returning its sequences as they are",
                             group.request_id)
            deltas = RequestStrategy.aborted(group.strategy, group)
        return RequestResult(group.request_id, deltas, True)

    def stop_seqs(self, request_id: str, stops: dict[int, str]) -> bool:
        """Finish the request's sequences ``stops`` names by completion index (the
        frontend found a stop string in their text) and free their blocks. A request or
        sequence that already finished is left as it is. True if the request ended."""
        group = self.groups.get(request_id)
        if group is None:
            return False
        for seq in group.seqs:
            if seq.index in stops and not seq.finished:
                seq.status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, stops[seq.index]
        if group in self.running:
            self.release_finished(group)
        elif group.is_finished:  # waiting or swapped: it never runs again
            for queue in (self.waiting, self.swapped):
                if group in queue:
                    queue.remove(group)
            self._forget(group)
        return group.is_finished

    def clear(self) -> None:
        """Forget every queued group (their blocks are the caller's to free); the
        worker is told to forget those it knows on the next step."""
        self._finished_requests.extend(self._announced)
        self.waiting.clear()
        self.running.clear()
        self.swapped.clear()
        self.groups.clear()
        self._sent_tables.clear()
        self._singles.clear()
        self._announced.clear()
        self._seq_copies.clear()
        self._copies_first.clear()

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
        if self.modes is not None:
            try:
                self.modes.release(group)
            except Exception:  # noqa: BLE001 - the request is gone already; other requests are not its
                logger.error("request %r: a mode's release raised (its state for the request may be left)",
                             group.request_id, exc_info=True)

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
        # A fault in a group's strategy or in the block manager's work for it fails
        # that group alone (``_fail_group``); the step goes on without it.
        queue, self.running = self.running, deque()
        if self.modes is not None:
            for group, e in self.modes.before_schedule(queue):
                queue.remove(group)
                self._fail_group(group, e)
        repacks = self._compress(queue) if self.cross_compress is not None else []
        # The usual decode step of the groups without drafts or a step mode, found and
        # recorded for all of them at once (``_steady``): no Python call per group. What
        # the loop below then does for others (preempting from the back, allocating,
        # copying) only frees blocks or takes free ones, never a block these hold, so it
        # leaves their records true.
        try:
            records, in_place, opening = self._steady(queue)
        except Exception:  # noqa: BLE001 - a fault of one group's: the loop below finds and isolates it
            records, in_place, opening = {}, {}, set()
        # The groups whose tables the worker must look at (SchedulerOutput.table_updates):
        # all but the steady records that open no block.
        updates: list[int] = []
        all_steady = bool(queue) and len(records) == len(queue)
        if all_steady:
            # Every running group is a steady record, recorded in the queue's order: what
            # the loop below does for each, done for all at once.
            scheduled = list(records.values())
            n = sum([len(g.seqs) for g in scheduled])
            budget -= n
            num_seqs += n
            self.running, queue = queue, deque()
            if opening:
                updates = [i for i, rid in enumerate(records) if rid in opening]
        while queue:
            group = queue.popleft()
            record = records.get(group.request_id)
            if record is not None:
                n = len(record.seqs)
                budget -= n
                num_seqs += n
                self.running.append(group)
                if opening and group.request_id in opening:
                    updates.append(len(scheduled))
                scheduled.append(record)
                continue
            seqs = in_place.get(group.request_id)
            if seqs is None:
                # Lookahead tokens only where they fit: never preempt for them.
                try:
                    if (type(group.strategy).lookahead is not _NO_LOOKAHEAD and group.strategy.lookahead(group)
                            and not bm.can_append_slots(group)):
                        self._drop_lookahead(group)
                except Exception as e:  # noqa: BLE001 - this request's strategy or blocks: it fails alone
                    self._fail_group(group, e)
                    continue
                # The usual decode step: each sequence's one new token goes into a block it
                # alone holds, so there is nothing to allocate, copy or preempt for.
                try:
                    seqs = bm.append_in_place(group)
                except Exception as e:  # noqa: BLE001 - the block manager's work for this request
                    self._fail_group(group, e, blocks=True)
                    continue
            if seqs is not None:
                n = len(seqs)
                budget -= n
                num_seqs += n
                self.running.append(group)
                try:  # _schedule_group, inline: once per running group every step
                    scheduled.append(self._metadata(group, False, seqs))
                    updates.append(len(scheduled) - 1)
                except Exception as e:  # noqa: BLE001 - its strategy's step data: it fails alone
                    self._fail_group(group, e)
                continue
            fits = True
            while fits:
                try:
                    if bm.can_append_slots(group):
                        break
                except Exception as e:  # noqa: BLE001 - the block manager's work for this request
                    self._fail_group(group, e, blocks=True)
                    fits = None
                    break
                victim = queue.pop() if queue else group
                try:
                    self._preempt(victim, swap_out)
                    preempted += 1
                except Exception as e:  # noqa: BLE001 - preempting it failed: the victim fails alone
                    self._fail_group(victim, e, blocks=True)
                if victim is group:
                    fits = False
            if not fits:
                continue
            seqs = group.get_seqs(SequenceStatus.RUNNING)
            tokens = sum(s.num_new_tokens for s in seqs)
            extra = sum(len(s.lookahead_token_ids) for s in seqs)
            if extra and tokens + extra > budget:
                self._drop_lookahead(group)
                extra = 0
            try:
                copies += [c for seq in seqs for c in bm.append_slots(seq)]
            except Exception as e:  # noqa: BLE001 - the block manager's work for this request
                self._fail_group(group, e, blocks=True)
                continue
            budget -= tokens + extra
            num_seqs += len(seqs)
            self.running.append(group)
            if self._schedule_group(scheduled, group, run_encoder=False):
                updates.append(len(scheduled) - 1)

        # Every group scheduled from here on (swapped in, admitted) is sent what changed.
        first_unsteady = len(scheduled)

        # 2. Swapped groups come back only when nothing was evicted this step.
        self.lora_slots.start_step(self.running)
        while self.swapped and not preempted:
            group = self.swapped[0]
            seqs = group.get_seqs(SequenceStatus.SWAPPED)
            tokens = sum(s.num_new_tokens for s in seqs)
            if num_seqs + len(seqs) > self.config.max_num_seqs or tokens > budget:
                break
            if not self.lora_slots.admits(group):
                break
            try:
                if not bm.can_swap_in(group):
                    break
                self.swapped.popleft()
                swap_in.extend(bm.swap_in(group))
                for seq in seqs:
                    seq.status = SequenceStatus.RUNNING
                copies += [c for seq in seqs for c in bm.append_slots(seq)]
            except Exception as e:  # noqa: BLE001 - the block manager's work for this request
                if self.swapped and self.swapped[0] is group:
                    self.swapped.popleft()
                self._fail_group(group, e, blocks=True)
                continue
            budget -= tokens
            num_seqs += len(seqs)
            self.running.append(group)
            self.lora_slots.add(group)
            self._schedule_group(scheduled, group, run_encoder=False)

        # 3. Waiting groups: run the encoder (unless shared) and prefill the decoder prompt.
        while self.waiting and not self.swapped and not preempted:
            group = self._first_ready()
            if group is None:
                break
            try:
                admitted = self._admit(group, num_seqs, budget)
            except Exception as e:  # noqa: BLE001 - the block manager's work for this request
                if group in self.waiting:
                    self.waiting.remove(group)
                self._fail_group(group, e, blocks=True)
                continue
            if admitted is None:
                break
            run_encoder, tokens = admitted
            budget -= tokens
            num_seqs += group.max_num_seqs
            self.running.append(group)
            self.lora_slots.add(group)
            self._schedule_group(scheduled, group, run_encoder)

        self.num_preemptions += preempted
        num_steps = 1
        if (self.config.num_scheduler_steps > 1 and all_steady and len(scheduled) == first_unsteady
                and not preempted and not self.swapped and not copies
                # Waiting requests could not be admitted in the run: only when no sequence slot is free.
                and (not self.waiting or num_seqs >= self.config.max_num_seqs)):
            try:
                num_steps, extended = plan_run(self.config.num_scheduler_steps, scheduled, self.groups,
                                               self.block_manager, self._sent_tables)
            except Exception as e:  # noqa: BLE001 - the block manager's work: a fault, checked as any other
                logger.warning("a run of decode steps could not be planned (%s: %s): one step", type(e).__name__, e)
                self.block_fault = True
                num_steps, extended = 1, []
            if extended:
                updates = sorted(set(updates).union(extended))
        updates += range(first_unsteady, len(scheduled))
        # A steady record's request was scheduled before, so announced: only the others are looked at.
        new_requests = []
        for i in updates:
            g = scheduled[i]
            if g.request_id not in self._announced:
                self._announced.add(g.request_id)
                group = self.groups[g.request_id]
                p = group.sampling_params
                seq_ids = () if p.seed is None else tuple(s.seq_id for s in sorted(group.seqs, key=_index))
                new_requests.append(NewRequestData(g.request_id, p, seq_ids))
        finished_requests, self._finished_requests = self._finished_requests, []
        finished_seqs, self._finished_seqs = self._finished_seqs, []
        seq_copies, self._seq_copies = self._seq_copies, []
        copies_first, self._copies_first = self._copies_first, []
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
            cross_repacks=repacks,
            seq_copies=seq_copies,
            blocks_to_copy_first=copies_first,
            table_updates=updates,
            num_steps=num_steps,
        )

    def _steady(self, queue: deque[SequenceGroup]
                ) -> tuple[dict[str, ScheduledGroup], dict[str, list[Sequence]], set[str]]:
        """The running groups whose step is the usual decode step (``append_in_place``
        holds, or a sequence's token opens a block and the step can give it one without
        changing what else the step does: see below) and that have no drafts and no
        step mode: request id -> the group's step record, for those whose tables the
        worker holds as they are (or less the block just opened); request id -> its
        running sequences, for the others (``_metadata`` records them). Built inline,
        as ``_metadata`` would build them (``tests/core/test_steady_records.py`` checks
        that they are equal): this runs for every running row every step. A group of one
        sequence gets its record of the last step back, advanced in place (the fields
        a decode step changes), so the records of a step are valid until the next
        ``schedule()``. Third: the request ids of the records that send a block they
        open (the worker's table changes); the other records' tables the worker holds
        as they are."""
        if self.cross_compress is not None:  # the observation window is per group: _metadata's
            return {}, {}, set()
        # A step mode that only reads its request's state (``steady_step_mode``: beams)
        # is asked for here, and does not keep a group of several sequences off this path
        # (the one-sequence branch below reuses records, which carry no mode).
        candidates = [g for g in queue if type(g.strategy).lookahead is _NO_LOOKAHEAD and (
            type(g.strategy).step_mode is _NO_STEP_MODE or (g.strategy.steady_step_mode and len(g.seqs) > 1))]
        bm, openers = self.block_manager, {}
        found = bm.append_in_place_all(candidates, openers)
        opened: dict[int, int] = {}  # seq id -> the block its token opens
        if openers:
            # Sequences whose token opens a block get it here only when every running group
            # is on this path and the free blocks cover them all: then nothing of the step
            # can preempt, and the general loop would allocate the same blocks in the same
            # (queue) order. Otherwise their groups take the general path.
            if (len(found) == len(queue) and sum([len(v) for v in openers.values()]) <= bm.num_free_blocks()):
                for seqs in openers.values():
                    opened.update(zip([s.seq_id for s in seqs], bm.open_blocks(seqs)))
            else:
                for rid in openers:
                    del found[rid]
        new, sent_tables = object.__new__, self._sent_tables
        records, in_place, opening = {}, {}, set()
        # Last step's records of one sequence, which this step's advance in place.
        last, singles = self._singles, {}
        self._singles = {}
        for rid, (group, seqs, tables, positions, cross_blocks) in found.items():
            if cross_blocks is None:
                in_place[rid] = seqs
                continue
            if len(seqs) == 1:  # the usual row; the loop below, for several sequences, does the same
                seq, table = seqs[0], tables[0]
                sent = sent_tables.get(seq.seq_id)
                block = opened.get(seq.seq_id) if opened else None
                if block is None:
                    if sent != table:  # the worker's table differs: _metadata sends it
                        in_place[rid] = seqs
                        continue
                    block_ids = []
                else:  # the worker's table is this one less the opened block: send that block
                    if sent is None or len(sent) + 1 != len(table) or sent != table[:-1]:
                        in_place[rid] = seqs
                        continue
                    block_ids = [block]
                    sent.append(block)  # the group is recorded here: the worker will hold it
                    opening.add(rid)
                computed = seq.num_computed_tokens
                sg = last.get(rid)
                if sg is not None and sg.seqs[0].seq_id == seq.seq_id:
                    # Its record of the last step, advanced: the fields a decode step changes
                    # (the others are as this branch or the one below set them).
                    ss = sg.seqs[0]
                    ss.token_ids, ss.num_computed_tokens = seq.token_ids[computed:], computed
                    ss.block_ids, ss.num_output_tokens = block_ids, len(seq.output_token_ids)
                    sg.num_encoder_positions, sg.lora_request = positions, group.lora_request
                    if sg.cross_block_table != cross_blocks:
                        sg.cross_block_table = list(cross_blocks)
                else:
                    ss = new(ScheduledSequence)
                    ss.seq_id, ss.token_ids, ss.num_computed_tokens = seq.seq_id, seq.token_ids[computed:], computed
                    ss.block_ids, ss.replace_blocks, ss.num_output_tokens = block_ids, False, len(seq.output_token_ids)
                    ss.prefix_token_ids, ss.num_logits = None, 1
                    sg = new(ScheduledGroup)
                    sg.request_id, sg.seqs, sg.encoder_inputs, sg.num_encoder_positions = rid, [ss], None, positions
                    sg.cross_block_table, sg.mode, sg.lora_request = list(cross_blocks), None, group.lora_request
                    sg.cross_observe_until, sg.cross_compressed = 0, False
                records[rid] = singles[rid] = sg
                continue
            rows, sent_opened = [], None
            for seq, table in zip(seqs, tables):
                sent = sent_tables.get(seq.seq_id)
                block = opened.get(seq.seq_id) if opened else None
                if block is None:
                    if sent != table:  # the worker's table differs: _metadata sends it
                        in_place[rid] = seqs
                        break
                    block_ids = []
                else:  # the worker's table is this one less the opened block: send that block
                    if sent is None or len(sent) + 1 != len(table) or sent != table[:-1]:
                        in_place[rid] = seqs
                        break
                    block_ids = [block]
                    sent_opened = [(sent, block)] if sent_opened is None else sent_opened + [(sent, block)]
                computed = seq.num_computed_tokens
                ss = new(ScheduledSequence)
                ss.seq_id, ss.token_ids, ss.num_computed_tokens = seq.seq_id, seq.token_ids[computed:], computed
                ss.block_ids, ss.replace_blocks, ss.num_output_tokens = block_ids, False, len(seq.output_token_ids)
                ss.prefix_token_ids, ss.num_logits = None, 1
                rows.append(ss)
            else:
                if sent_opened is not None:  # the group is recorded here: the worker will hold them
                    for sent, block in sent_opened:
                        sent.append(block)
                    opening.add(rid)
                sg = new(ScheduledGroup)
                sg.request_id, sg.seqs, sg.encoder_inputs, sg.num_encoder_positions = rid, rows, None, positions
                sg.cross_block_table, sg.lora_request = list(cross_blocks), group.lora_request
                sg.mode = None if type(group.strategy).step_mode is _NO_STEP_MODE else group.strategy.step_mode(group)
                sg.cross_observe_until, sg.cross_compressed = 0, False
                records[rid] = sg
        self._singles = singles
        return records, in_place, opening

    def _compress(self, queue: deque[SequenceGroup]) -> list:
        """kv_compress: the running groups whose observation window is over get their
        compressed cross tables, before anything else of the step allocates blocks."""
        repacks = []
        for group in list(queue):
            try:
                repack = self.cross_compress.plan(group)
            except Exception as e:  # noqa: BLE001 - the block manager's work for this request
                queue.remove(group)
                self._fail_group(group, e, blocks=True)
                continue
            if repack is not None:
                repacks.append(repack)
        return repacks

    def _admit(self, group: SequenceGroup, num_seqs: int, budget: int) -> tuple[bool, int] | None:
        """Admit a waiting group if the step's sequences, tokens and the free blocks
        allow: whether it runs its encoder, and the tokens it computes; None if not."""
        bm = self.block_manager
        admission = bm.admission(group)  # what the checks and the allocation read, found once
        seqs, run_encoder = admission.seqs, admission.run_encoder  # a live or kept cross table: no encoder
        cached = len(admission.hits) * bm.block_size  # decoder prompt tokens each sequence skips
        tokens = (group.encoder_len if run_encoder else 0) + sum([len(s.token_ids) - cached for s in seqs])
        if num_seqs + group.max_num_seqs > self.config.max_num_seqs or tokens > budget:
            return None
        if admission.status is not AllocStatus.OK:
            # NEVER cannot happen for requests the engine validated on entry.
            return None
        if self.waiting[0] is group:
            self.waiting.popleft()
        else:
            self.waiting.remove(group)
        if bm.allocate(group, admission) != run_encoder:
            raise RuntimeError(f"request {group.request_id!r}: cross table sharing changed while admitting")
        for seq in seqs:
            seq.status = SequenceStatus.RUNNING
        if run_encoder:
            self.encoder_tokens_computed += group.encoder_len
        else:
            self.encoder_tokens_reused += group.encoder_len
        return run_encoder, tokens

    @staticmethod
    def _drop_lookahead(group: SequenceGroup) -> None:
        for seq in group.seqs:
            seq.lookahead_token_ids = []

    def _first_ready(self) -> SequenceGroup | None:
        """The oldest waiting group its strategy says may run, whose LoRA adapter is
        loaded and finds a slot in the step (one that is not ready, or has no slot,
        waits; the others go past it as ``lora_slots.py`` allows). A group whose
        readiness check raises leaves the queue: its failure is kept for ``take_failures``."""
        waiting, i = self.waiting, 0
        adapter_ready = self.adapter_ready
        while i < len(waiting):
            group = waiting[i]
            try:
                if (group.strategy.ready(group) and (adapter_ready is None or adapter_ready(group))
                        and self.lora_slots.admits(group)):
                    return group
            except Exception as e:  # noqa: BLE001 - this request's own (its strategy could not get ready)
                del waiting[i]
                self._failures[group.request_id] = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
                continue
            i += 1
        return None

    def _schedule_group(self, scheduled: list[ScheduledGroup], group: SequenceGroup, run_encoder: bool,
                        seqs: list[Sequence] | None = None) -> bool:
        """Append the group's record; False (and the group failed) if building it raised."""
        try:
            scheduled.append(self._metadata(group, run_encoder, seqs))
        except Exception as e:  # noqa: BLE001 - its strategy's step data: it fails alone
            self._fail_group(group, e)
            return False
        return True

    def _fail_group(self, group: SequenceGroup, e: Exception, blocks: bool = False) -> None:
        """A request whose strategy (or, ``blocks``, the block manager's work for it)
        raised while scheduling: kept for ``take_failures`` (the engine aborts it,
        which frees its blocks from whichever queue holds it)."""
        why = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
        if blocks:
            # Its blocks may be half moved or half allocated: the engine checks the pool.
            self.block_fault = True
            why = f"scheduling it failed in the KV block manager: {why}"
        self._failures.setdefault(group.request_id, why)

    def take_failures(self) -> dict[str, str]:
        """Requests found unable to run since the last call, with why (the engine fails
        them; each is out of the queues but still known by id, so ``abort`` frees it)."""
        failures, self._failures = self._failures, {}
        return failures

    def _metadata(self, group: SequenceGroup, run_encoder: bool, running: list[Sequence] | None = None) -> ScheduledGroup:
        """The group's step as plain data; ``running``: its running sequences, when the
        caller has them."""
        bm = self.block_manager
        sent_tables = self._sent_tables
        seqs = []
        for seq in group.get_seqs(SequenceStatus.RUNNING) if running is None else running:
            sid, computed, lookahead = seq.seq_id, seq.num_computed_tokens, seq.lookahead_token_ids
            table = bm.get_block_table(seq)
            sent = sent_tables.get(sid)
            prefix = None
            if sent is not None and sent == table:  # the usual decode step: the worker has it all
                block_ids, replace = [], False
            else:
                block_ids, replace = table_update(table, sent)
                # A sequence the worker has not seen but with computed tokens was forked.
                if sent is None and computed:
                    prefix = seq.token_ids[:computed]
                sent_tables[sid] = list(table)
            tokens = seq.token_ids[computed:]
            # Positional: once per running row every step (ScheduledSequence's field order).
            seqs.append(ScheduledSequence(
                sid, tokens + lookahead if lookahead else tokens, computed, block_ids, replace,
                len(seq.output_token_ids), prefix, 1 + len(lookahead)))
        positions, cross_table = bm.cross_view(group)
        compress = self.cross_compress
        # ScheduledGroup's field order: request, seqs, encoder inputs, positions, cross table,
        # mode, adapter, observation window, compressed.
        return ScheduledGroup(
            group.request_id, seqs, group.encoder_inputs if run_encoder else None, positions, list(cross_table),
            None if type(group.strategy).step_mode is _NO_STEP_MODE else group.strategy.step_mode(group),
            group.lora_request,
            compress.observe_until(group) if compress is not None else 0,
            compress is not None and bm.is_cross_compressed(group),
        )

    # -- after the forward pass ----------------------------------------------
    def update_from_output(self, output: SchedulerOutput, result: ModelRunnerOutput) -> list[RequestResult]:
        """Apply the step to each scheduled group through its strategy (append the
        sampled tokens, stop on EOS, a stop token id or the length, free what
        finished). Returns the progress of the groups that advanced, in schedule
        order (a group aborted since ``schedule()`` is skipped). A group whose update
        raises is added to ``result.failed_requests`` (the engine fails it alone)
        and the others go on."""
        row = {seq_id: i for i, seq_id in enumerate(result.seq_ids)}
        if result.cross_blocks_needed and self.cross_compress is not None:
            self.cross_compress.trim(self.groups, result.cross_blocks_needed)
        # Runs of consecutive groups of one strategy class go to the class's update_all
        # in one call (plain sampling's does its rows without a Python call per group).
        results, run, run_cls = [], [], None
        groups, failed = self.groups, result.failed_requests
        for sg in output.scheduled:
            group = groups.get(sg.request_id)
            if group is None or sg.request_id in failed:
                continue  # gone, or failed in the worker (the engine aborts it)
            # Sharers too: their cross table was filled by now, in this step or an earlier one.
            group.encoder_computed = True
            cls = type(group.strategy)
            if cls is not run_cls and run:
                results += self._update_run(run_cls, run, result, row)
                run = []
            run_cls = cls
            run.append((group, sg))
        if run:
            results += self._update_run(run_cls, run, result, row)
        return results

    def _update_run(self, cls: type, run: list, result: ModelRunnerOutput, row: dict[int, int]) -> list[RequestResult]:
        """A run's ``update_all``. It fails a request alone itself; should it raise all
        the same (a strategy breaking that contract), the run's requests fail with why,
        and the step's other requests go on."""
        try:
            return [r for r in cls.update_all(self, run, result, row) if r is not None]
        except Exception as e:  # noqa: BLE001 - a strategy class's batch update: its run's requests fail
            why = update_failure(e)
            for _, sg in run:
                result.failed_requests.setdefault(sg.request_id, why)
            return []

    # -- what strategies may ask (strategies.base.SchedulerOps) ----------------------
    def new_sequence(self, group: SequenceGroup, prompt_token_ids: list[int]) -> Sequence:
        return Sequence(next(self.seq_ids), prompt_token_ids)

    def fork(self, group: SequenceGroup, parent: Sequence) -> Sequence:
        child = parent.fork(next(self.seq_ids))
        self.block_manager.fork(parent, child)
        return child

    def take_over(self, pairs: list[tuple[Sequence, Sequence]]) -> None:
        """Each ``(src, dst)`` (``dst`` a running sequence of ``src``'s group, or a new
        one of it): ``dst`` becomes a copy of ``src`` as the step left it, under its own
        id: tokens, logprobs, computed count and status; its blocks
        (``BlockManager.take_over``: shared, the partly filled last one copied); and the
        worker's state of it (its block table and token history), which the worker
        copies from ``src``'s before the next step (``SchedulerOutput.seq_copies``), so
        nothing is sent again whole. Sources are not destinations. A fault in the block
        manager's work marks the pool for a check (``block_fault``) and raises."""
        sent, seq_copies = self._sent_tables, self._seq_copies
        for src, _ in pairs:
            if src.seq_id not in sent:  # cannot happen for a sequence that ran the step
                raise RuntimeError(f"sequence {src.seq_id}: the worker holds no table to copy from")
        try:
            tables, copies = self.block_manager.take_over(pairs)
        except Exception:
            self.block_fault = True
            raise
        self._copies_first += copies
        for (src, dst), (table, n) in zip(pairs, tables):
            sid, did = src.seq_id, dst.seq_id
            # The worker's copy: the first n ids of src's row (as it was sent them), then the rest.
            if sent[sid][:n] != table[:n]:
                n = 0
            seq_copies.append((sid, did, n, table[n:]))
            sent[did] = table[:]
            dst.token_ids = src.token_ids[:]
            dst.output_token_ids = src.output_token_ids[:]
            dst.output_logprobs = src.output_logprobs[:]
            dst.num_computed_tokens = src.num_computed_tokens
            dst.cumulative_logprob = src.cumulative_logprob
            dst.status = src.status
            dst.lookahead_token_ids = []

    def drop(self, group: SequenceGroup, seq: Sequence) -> None:
        self.block_manager.free(seq, group)
        if self._sent_tables.pop(seq.seq_id, None) is not None:
            self._finished_seqs.append(seq.seq_id)

    def rollback(self, group: SequenceGroup, seq: Sequence) -> None:
        # The table may now be shorter than the one the worker was sent: _metadata
        # then sends it whole (the worker's row still lists the freed ids).
        self.block_manager.rollback_slots(seq)

    def check_stop(self, seq: Sequence, group: SequenceGroup) -> None:
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
        stop string, by the frontend); retire the group once all are."""
        bm = self.block_manager
        if group.request_id in self.groups and group.is_finished:
            # All of it at once: finish() frees every table (free_group) as the loop below
            # and finish() after it would, in the same order.
            for seq in group.seqs:
                if bm.has_block_table(seq):
                    self._sent_tables.pop(seq.seq_id, None)
                    self._finished_seqs.append(seq.seq_id)
            self.finish(group)
            return
        for seq in group.seqs:
            if seq.finished and bm.has_block_table(seq):
                bm.free(seq, group)
                self._sent_tables.pop(seq.seq_id, None)
                self._finished_seqs.append(seq.seq_id)
        if group.is_finished and group.request_id in self.groups:
            self.finish(group)

    def _preempt(self, group: SequenceGroup, swap_out: list[tuple[int, int]]) -> None:
        bm = self.block_manager
        self._drop_lookahead(group)
        if self.modes is not None:
            self.modes.release(group)
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
