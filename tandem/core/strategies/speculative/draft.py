"""The draft-model proposer: a smaller encoder/decoder model proposes ``k`` tokens
greedily for every decoding sequence of the batch at once.

It is a second copy of tandem's own machinery, not a second engine: a
``Worker`` (the draft's model, its KV pool, runner and sampler) and a
``BlockManager`` over that pool, driven with ``SchedulerOutput``s this module
builds. Per request it keeps a draft ``SequenceGroup`` mirroring the target's
decoding sequences:

- admission (the first step a request speculates): the draft's cross table is
  allocated and its encoder runs in that step's first draft forward, once for
  the request's life (again only if the request is preempted and resumes:
  preemption, abort and finish release the draft's state, ``release``);
- each step, ``propose`` syncs every draft sequence with its target sequence:
  the draft's cached tokens that are still a prefix of the target's tokens
  (the accepted drafts) are kept, the rest is rolled back
  (``BlockManager.rollback_slots`` frees blocks that held only rejected
  tokens). Then ``k`` draft forwards run, each over every proposing sequence:
  the first computes what the draft has not seen yet (the target's new token,
  usually one or two tokens; the whole decoder prompt after admission), each
  later one the previous draft token, and each takes its argmax as the next
  proposal. The draft never recomputes its decoder history.

A greedy draft is a deterministic proposal, so the target's verification
(``verify.py``: rejection sampling with a point-mass ``q``) needs no draft
probabilities and keeps sampled outputs distributed as the target's.

Proposals are optional: a request the draft pool cannot hold this step, or a
draft forward that fails (logged), leaves requests without drafts for the step;
the target's decoding goes on as without speculation.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tandem.core.kv.block_manager import AllocStatus, BlockManager
from tandem.core.faults import describe
from tandem.core.sampling_params import SamplingParams
from tandem.core.scheduler_output import NewRequestData, ScheduledGroup, ScheduledSequence, SchedulerOutput, table_update
from tandem.core.sequence import Sequence, SequenceGroup

if TYPE_CHECKING:
    from tandem.core.strategies.speculative import SpeculativeStrategy
    from tandem.core.worker.worker import Worker

logger = logging.getLogger(__name__)
_GREEDY = SamplingParams(temperature=0)


@dataclass
class _DraftRequest:
    group: SequenceGroup  # the draft's own: its sequences mirror the target's
    seqs: dict[int, Sequence]  # target seq id -> draft sequence
    # Target tokens the draft sequence was last synced to: positions before it are
    # the target's accepted tokens, equal in both (target tokens only ever append).
    synced: dict[int, int] = field(default_factory=dict)
    run_encoder: bool = True  # its encoder runs in the next draft forward
    fresh: bool = True  # its self tables are as allocate() made them


class DraftProposer:
    def __init__(self, worker: "Worker", block_manager: BlockManager, max_decoder_len: int,
                 max_encoder_len: int) -> None:
        self.worker = worker
        self.block_manager = block_manager
        self.max_decoder_len = max_decoder_len
        self.max_encoder_len = max_encoder_len
        self.requests: dict[str, _DraftRequest] = {}
        self._seq_ids = itertools.count()
        self._sent: dict[int, list[int]] = {}  # draft seq id -> the block table the worker has
        self._announced: set[str] = set()
        self._finished_requests: list[str] = []
        self._finished_seqs: list[int] = []
        self.failures = 0  # draft forwards that raised (each logged; the step went on without drafts)

    # -- the scheduler's calls -------------------------------------------------------
    def propose(self, items: Iterable[tuple[SequenceGroup, "SpeculativeStrategy"]]) -> None:
        """Drafts for the running requests the speculative mode gave, each with its
        strategy (which says how many each sequence may get)."""
        jobs = []
        for group, strategy in items:
            for seq in group.seqs:
                seq.lookahead_token_ids = []
            lengths = strategy.draft_lengths(group)
            if lengths:
                job = self._prepare(group, lengths)
                if job:
                    jobs.append(job)
        if not jobs:
            return
        try:
            proposals = self._run(jobs)
        except Exception as e:  # noqa: BLE001 - the draft's own fault: the step goes on without drafts
            self.failures += 1
            logger.warning("the draft model's forward failed; this step runs without drafts: %s", describe(e),
                           exc_info=e)
            for _, items in jobs:
                for t, _, _ in items:
                    t.lookahead_token_ids = []
            self.reset()
            return
        for _, items in jobs:
            for t, d, _ in items:
                t.lookahead_token_ids = proposals[d.seq_id]

    def release(self, group: SequenceGroup) -> None:
        """Free the request's draft state (blocks, the worker's tables)."""
        st = self.requests.pop(group.request_id, None)
        if st is None:
            return
        self.block_manager.free_group(st.group)
        for d in st.group.seqs:
            if self._sent.pop(d.seq_id, None) is not None:
                self._finished_seqs.append(d.seq_id)
        if group.request_id in self._announced:
            self._announced.discard(group.request_id)
            self._finished_requests.append(group.request_id)
        self._flush()

    def _flush(self) -> None:
        """Tell the draft worker now which requests and sequences to forget (no forward
        runs), so it holds state only for the requests the draft serves."""
        if not (self._finished_requests or self._finished_seqs):
            return
        out = SchedulerOutput([], 0, [], [], finished_request_ids=self._finished_requests,
                              finished_seq_ids=self._finished_seqs)
        self._finished_requests, self._finished_seqs = [], []
        try:
            self.worker.execute_model(out)
        except Exception as e:  # noqa: BLE001 - called from the scheduler's cleanup, which must go on
            logger.warning("the draft worker could not forget finished requests: %s", describe(e))

    def reset(self) -> None:
        """Drop every request's draft state (after a failed draft forward: its cache
        may be half written)."""
        for st in list(self.requests.values()):
            self.release(st.group)

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    # -- before the draft forwards ----------------------------------------------------
    def _prepare(self, group: SequenceGroup, lengths: list[tuple[Sequence, int]]):
        """The request's draft state synced to its target sequences; ``(state, [(target
        seq, draft seq, k)])``, or None when it gets no drafts this step."""
        if group.encoder_len > self.max_encoder_len:
            return None
        st = self.requests.get(group.request_id)
        if st is None:
            st = self._admit(group)
            if st is None:
                return None
        bm = self.block_manager
        live = {s.seq_id for s in group.seqs if not s.finished}
        for tid in [tid for tid in st.seqs if tid not in live]:  # target sequences that finished
            d = st.seqs.pop(tid)
            bm.free(d, st.group)
            st.group.seqs.remove(d)
            if self._sent.pop(d.seq_id, None) is not None:
                self._finished_seqs.append(d.seq_id)
        items = []
        for t, k in lengths:
            d = st.seqs.get(t.seq_id)
            if d is None:
                continue
            self._sync(st, t, d)
            k = min(k, self.max_decoder_len - len(t))
            if k > 0:
                items.append((t, d, k))
        return (st, items) if items else None

    def _admit(self, group: SequenceGroup) -> _DraftRequest | None:
        seqs = {}
        for t in group.seqs:
            if t.finished:
                continue
            d = Sequence(next(self._seq_ids), t.prompt_token_ids, t.index)
            d.token_ids = list(t.token_ids)
            seqs[t.seq_id] = d
        dgroup = SequenceGroup(group.request_id, group.encoder_inputs, list(seqs.values()), _GREEDY, time.monotonic())
        if self.block_manager.can_allocate(dgroup) is not AllocStatus.OK:
            return None
        run_encoder = self.block_manager.allocate(dgroup)
        st = _DraftRequest(dgroup, seqs, {tid: len(d) for tid, d in seqs.items()}, run_encoder)
        self.requests[group.request_id] = st
        return st

    def _sync(self, st: _DraftRequest, t: Sequence, d: Sequence) -> None:
        """Keep the draft's computed tokens that the target accepted; roll back the rest."""
        base = st.synced[t.seq_id]
        keep = base
        stop = min(d.num_computed_tokens, len(t.token_ids))
        while keep < stop and d.token_ids[keep] == t.token_ids[keep]:
            keep += 1
        keep = min(keep, d.num_computed_tokens)
        del d.token_ids[keep:]
        d.token_ids.extend(t.token_ids[keep:])
        d.num_computed_tokens = keep
        st.synced[t.seq_id] = len(t.token_ids)
        if not st.fresh:
            self.block_manager.rollback_slots(d)

    # -- the draft forwards -----------------------------------------------------------
    def _run(self, jobs) -> dict[int, list[int]]:
        """``k`` greedy draft forwards over every proposing sequence; the proposals by
        draft seq id."""
        bm = self.block_manager
        proposals = {d.seq_id: [] for _, items in jobs for _, d, _ in items}
        for step in range(max(k for _, items in jobs for *_, k in items)):
            scheduled, copies, new = [], [], []
            for st, items in jobs:
                live = [d for _, d, k in items if k > step and len(proposals[d.seq_id]) == step]
                if not live:
                    continue
                if not st.fresh:
                    if not bm.can_append_slots(st.group):
                        continue  # the draft pool is full: this request proposes no further
                    for d in live:
                        copies += bm.append_slots(d)
                st.fresh = False
                scheduled.append(self._scheduled_group(st, live))
                if st.group.request_id not in self._announced:
                    self._announced.add(st.group.request_id)
                    new.append(NewRequestData(st.group.request_id, _GREEDY))
            if not scheduled:
                break
            finished_requests, self._finished_requests = self._finished_requests, []
            finished_seqs, self._finished_seqs = self._finished_seqs, []
            out = SchedulerOutput(
                scheduled=scheduled, num_batched_tokens=sum(len(s.token_ids) for g in scheduled for s in g.seqs),
                blocks_to_swap_in=[], blocks_to_swap_out=[], blocks_to_copy=copies, new_requests=new,
                finished_request_ids=finished_requests, finished_seq_ids=finished_seqs,
            )
            result = self.worker.execute_model(out)
            tokens = dict(zip(result.seq_ids, result.token_ids))
            for st, items in jobs:
                for _, d, _ in items:
                    token = tokens.get(d.seq_id)
                    if token is None:
                        continue
                    d.num_computed_tokens = len(d.token_ids)
                    d.token_ids.append(token)
                    proposals[d.seq_id].append(token)
        return proposals

    def _scheduled_group(self, st: _DraftRequest, live: list[Sequence]) -> ScheduledGroup:
        bm, seqs = self.block_manager, []
        for d in live:
            table = bm.get_block_table(d)
            sent = self._sent.get(d.seq_id)
            block_ids, replace = table_update(table, sent)
            self._sent[d.seq_id] = list(table)
            seqs.append(ScheduledSequence(
                seq_id=d.seq_id, token_ids=d.token_ids[d.num_computed_tokens:],
                num_computed_tokens=d.num_computed_tokens, block_ids=block_ids, replace_blocks=replace,
                num_output_tokens=0,
            ))
        g = st.group
        run_encoder, st.run_encoder = st.run_encoder, False
        g.encoder_computed = True
        return ScheduledGroup(
            request_id=g.request_id, seqs=seqs, encoder_inputs=g.encoder_inputs if run_encoder else None,
            num_encoder_positions=g.encoder_len, cross_block_table=list(bm.get_cross_block_table(g)),
        )

