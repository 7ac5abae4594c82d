"""Beam search as a mode: HF ``generate``'s beam search, in the engine, with
shared blocks.

Worker side (``BeamStep``): the group's rows become log-probabilities before the
processors; after them, each beam's running score is added and the best
``beams_to_keep`` (beam, token) continuations over all its beams are the step's
result. Scheduler side (``BeamSearchStrategy``): ``BeamSearchState`` picks the
next running beams and the finished hypotheses from those. The request's
``num_beams`` sequences keep their ids from step to step: a beam's first
continuation stays in its sequence, and a further one takes the place of a beam
that was not continued (``SchedulerOps.take_over``: the parent's full blocks
shared, its partly filled one copied, the worker's row copied), so no ``Sequence``
is forked and no table or history is sent again whole. Only the first step, where
one sequence stood for every beam, makes the others. A finished search leaves the
best ``n`` hypotheses as the request's completions.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from operator import attrgetter, ne
from typing import TYPE_CHECKING

import torch

from tandem.core.core_outputs import CompletionDelta, OutputShape, RequestResult
from tandem.core.kv.block_pool import blocks_for
from tandem.core.sequence import SequenceStatus
from tandem.core.strategies.base import RequestStrategy, SchedulerOps, StepMode, update_failure
from tandem.core.strategies.beam.search import BeamCandidates, BeamSearchState, Hypothesis, NextBeams
from tandem.core.strategies.beam.topk import beam_topk, chunk_size
from tandem.core.strategies.modes import Mode, RequestContext

# Attribute readers for map(): no Python call per sequence.
_seq_id, _output_ids, _output_logprobs = (attrgetter("seq_id"), attrgetter("output_token_ids"),
                                          attrgetter("output_logprobs"))

if TYPE_CHECKING:
    from tandem.core.sampling_params import SamplingParams
    from tandem.core.scheduler_output import ModelRunnerOutput, ScheduledGroup
    from tandem.core.sequence import SequenceGroup


@dataclass(frozen=True)
class BeamStep(StepMode):
    """``scores``: the num_beams running beam scores (float32 values). On the first
    step the group runs one sequence standing for all its beams."""

    scores: list[float]
    num_beams: int
    beams_to_keep: int
    joint_rows = True  # the rows are one request's beams

    def prepare(self, logits: torch.Tensor, rows: list[int]) -> None:
        self.prepare_all(logits, [(self, rows)])

    @classmethod
    def prepare_all(cls, logits: torch.Tensor, items: list[tuple["BeamStep", list[int]]]) -> list[None]:
        """Every beam row becomes log-probabilities (HF's log-softmax, row by row, so
        the values are those of one call per request), in one call for the step."""
        rows = [r for _, group_rows in items for r in group_rows]
        if rows == list(range(logits.shape[0])):  # a step of beams only: no gather
            if logits.device.type == "cpu" and logits.is_contiguous():
                # In place, no copy: torch's CPU kernel reads a row before it writes it
                # (test_beam_step.py holds the values to the out-of-place ones).
                torch.log_softmax(logits, dim=-1, out=logits)
            else:
                logits.copy_(torch.log_softmax(logits, dim=-1))
        elif rows:
            r = torch.tensor(rows, device=logits.device)
            logits.index_copy_(0, r, torch.log_softmax(logits.index_select(0, r), dim=-1))
        return [None] * len(items)

    def select(self, scores: torch.Tensor, rows: list[int], params: "SamplingParams", prepared, generators=None,
               default_generator=None) -> BeamCandidates:
        """HF's top-k continuations: processed log-probs plus each beam's running
        score, flattened over (beam, token), the best ``beams_to_keep``."""
        return self.select_all(scores, [(self, rows, params, prepared, generators)], default_generator)[0]

    @classmethod
    def select_all(cls, scores: torch.Tensor, items: list, default_generator=None) -> list[BeamCandidates]:
        """:meth:`select` for many requests, batched over those with the same beam
        count, ``beams_to_keep`` and step kind: one top-k over ``[G, beams * vocab]``
        (row by row the same arithmetic and the same answer as HF's ``[1, beams *
        vocab]``; ``topk.beam_topk`` adds and ranks only the values that can win)."""
        buckets: dict[tuple[int, int, bool], list[int]] = {}
        for j, (mode, rows, *_) in enumerate(items):
            # First step: HF runs num_beams copies of the prompt, all but the first
            # scored -1e9; one row stands for all of them.
            first = len(rows) == 1 and mode.num_beams > 1
            if not first and len(rows) != mode.num_beams:
                raise ValueError(f"beam step with {len(rows)} rows for {mode.num_beams} beams")
            buckets.setdefault((mode.num_beams, mode.beams_to_keep, first), []).append(j)
        results: list = [None] * len(items)
        for (num_beams, keep, first), idx in buckets.items():
            row_ids = [r for j in idx for r in items[j][1]]
            if row_ids == list(range(scores.shape[0])):
                logp = scores
            else:
                logp = scores.index_select(0, torch.tensor(row_ids, device=scores.device))
            g, vocab = len(idx), logp.shape[1]  # logp: [g * rows, vocab]
            running = torch.tensor([items[j][0].scores for j in idx], dtype=torch.float32, device=scores.device)
            values, flat = beam_topk(logp, running, keep, first, chunk_size(vocab, num_beams, keep))  # [g, keep]
            token = flat % vocab
            if first:
                token_logprob = logp.gather(1, token)
                parent = torch.zeros_like(token)
            else:
                token_logprob = logp.reshape(g, num_beams * vocab).gather(1, flat)  # reshape: TP logits are a slice of a padded vocab
                parent = flat // vocab
            values, parent, token, token_logprob = (t.tolist() for t in (values, parent, token, token_logprob))
            new = tuple.__new__  # BeamCandidates(fields) without a Python call
            for n, j in enumerate(idx):
                params = items[j][2]
                top = None
                if params.logprobs is not None:
                    k = params.logprobs
                    nrows = 1 if first else num_beams
                    top = [{} for _ in range(nrows)]
                    if k:
                        vals, ids = logp[n * nrows: (n + 1) * nrows].topk(k, dim=-1)
                        top = [dict(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]
                results[j] = new(BeamCandidates, (values[n], parent[n], token[n], token_logprob[n], top))
        return results


class BeamSearchStrategy(RequestStrategy):
    steady_step_mode = True  # step_mode reads the search's state, nothing else

    def __init__(self, params: "SamplingParams", prompt_len: int, stop_ids: frozenset[int],
                 eos_ids: frozenset[int] = frozenset()) -> None:
        self.state = BeamSearchState(params, prompt_len, stop_ids)
        self.eos_ids = eos_ids  # a hypothesis ended on one of these has no stop_reason
        # HF keeps (1 + number of EOS ids, at least 2) x num_beams candidates.
        self.beams_to_keep = max(2, 1 + len(stop_ids)) * params.num_beams

    def max_num_seqs(self, group: "SequenceGroup") -> int:
        return group.sampling_params.num_beams

    def num_initial_seqs(self, params: "SamplingParams") -> int:
        return 1  # one sequence stands for every beam until the first step forks them

    def blocks_needed_at_most(self, group: "SequenceGroup", full_len: int, block_size: int) -> int:
        # Every beam at full length, sharing nothing but the cross table.
        return blocks_for(group.encoder_len, block_size) + group.sampling_params.num_beams * blocks_for(
            full_len, block_size
        )

    def step_mode(self, group: "SequenceGroup") -> BeamStep:
        state = self.state
        return BeamStep(state.running, state.num_beams, self.beams_to_keep)  # running_scores(), inline

    def update(
        self, ops: SchedulerOps, group: "SequenceGroup", sg: "ScheduledGroup", result: "ModelRunnerOutput",
        rows: dict[int, int],
    ) -> RequestResult | None:
        """One beam step: each next running beam continues in its parent's sequence, or
        in a sequence whose beam was not continued, which takes its parent's place
        (``SchedulerOps.take_over``); a finished search leaves the best hypotheses as
        the group's sequences."""
        running, step = self._step_input(group, sg, result)
        beams = BeamSearchState.step_all([step])[0]
        if self.state.done:
            return self._finish(ops, group, running)
        seqs, moves = self._place(ops, group, running, beams)
        if moves:
            ops.take_over(moves)
        self._advance(group, seqs, beams)
        return None

    @classmethod
    def update_all(
        cls, ops: SchedulerOps, items: "list[tuple[SequenceGroup, ScheduledGroup]]", result: "ModelRunnerOutput",
        rows: dict[int, int],
    ) -> list[RequestResult | None]:
        """:meth:`update` for a run of beam requests: their search steps stacked into
        one set of tensor ops (``BeamSearchState.step_all``), the places their beams
        take found per request, one ``take_over`` for every request's moved beams, then
        each request's tokens appended. A request whose update raises fails alone; a
        fault in the stacked arithmetic, or in the stacked ``take_over``, fails the
        requests stacked in it."""
        out: list[RequestResult | None] = [None] * len(items)
        ready, steps = [], []
        for n, (group, sg) in enumerate(items):
            try:
                running, step = group.strategy._step_input(group, sg, result)
            except Exception as e:  # noqa: BLE001 - this request's own update
                result.failed_requests[sg.request_id] = update_failure(e)
                continue
            ready.append((n, group, sg, running))
            steps.append(step)
        try:
            next_beams = BeamSearchState.step_all(steps)
        except Exception as e:  # noqa: BLE001 - the stacked search step: the requests in it fail
            for _, _, sg, _ in ready:
                result.failed_requests[sg.request_id] = update_failure(e)
            return out
        placed, moves, moved = [], [], []
        for (n, group, sg, running), beams in zip(ready, next_beams):
            strategy = group.strategy
            try:
                if strategy.state.done:
                    out[n] = strategy._finish(ops, group, running)
                    continue
                seqs, own = strategy._place(ops, group, running, beams)
            except Exception as e:  # noqa: BLE001 - this request's own places and drops
                result.failed_requests[sg.request_id] = update_failure(e)
                continue
            if own:
                moves += own
                moved.append((group, running, seqs))
            placed.append((group, seqs, beams))
        if moves:
            try:
                ops.take_over(moves)
            except Exception as e:  # noqa: BLE001 - the stacked block work: the requests in it fail
                why = update_failure(e)
                for group, running, seqs in moved:
                    result.failed_requests[group.request_id] = why
                    # Every sequence that may hold blocks now, so the abort frees them all.
                    group.seqs = running + [s for s in seqs if s not in running]
        failed = result.failed_requests
        for group, seqs, beams in placed:
            if group.request_id not in failed:
                cls._advance(group, seqs, beams)
        return out

    def _step_input(self, group: "SequenceGroup", sg: "ScheduledGroup", result: "ModelRunnerOutput"):
        """The group's running beams (their computed tokens counted) and its search
        step's input (``BeamSearchState.step_all``)."""
        cands = result.mode_outputs[group.request_id]
        running = group.seqs  # the usual case: the rows ran in the group's order (_place's)
        if len(running) != len(sg.seqs) or any(map(ne, map(_seq_id, running), map(_seq_id, sg.seqs))):
            by_id = {s.seq_id: s for s in group.seqs}
            running = [by_id[ss.seq_id] for ss in sg.seqs]
        for ss, seq in zip(sg.seqs, running):
            seq.num_computed_tokens = ss.num_computed_tokens + len(ss.token_ids)
        num_out = len(running[0].output_token_ids)
        return running, (self.state, cands, list(map(_output_ids, running)), list(map(_output_logprobs, running)),
                         num_out)

    @staticmethod
    def _place(ops: SchedulerOps, group: "SequenceGroup", running: list, beams: NextBeams) -> tuple[list, list]:
        """The sequence each next beam continues in, in the beams' order: a parent's own
        for its first continuation, else one whose beam was not continued (or, on the
        first step, when one sequence stood for every beam, a new one), which is to take
        the parent's place; and those moves, ``(parent, sequence)`` pairs for
        ``take_over``. No ``Sequence`` forks and no new ids after the first step: the
        worker keeps each row's table and history, and only a moved beam's is copied."""
        parents = beams.parents
        continued = set(parents)
        free = []
        for j, seq in enumerate(running):
            if j not in continued:
                free.append(seq)
        seqs, seen, moves = [], set(), []
        for p in parents:
            if p in seen:
                seq = free.pop() if free else ops.new_sequence(group, group.seqs[0].prompt_token_ids)
                moves.append((running[p], seq))
            else:
                seen.add(p)
                seq = running[p]
            seqs.append(seq)
        for seq in free:  # more sequences than beams: none, unless beams were dropped
            ops.drop(group, seq)
        return seqs, moves

    @staticmethod
    def _advance(group: "SequenceGroup", seqs: list, beams: NextBeams) -> None:
        """Append each beam's token to its sequence (``Sequence.append_token`` written
        out, the score its cumulative log-probability); the beams become the group's
        sequences, in order."""
        tops = beams.top_logprobs
        for seq, token, score in zip(seqs, beams.token_ids, beams.scores):
            seq.output_token_ids.append(token)
            seq.token_ids.append(token)
            seq.cumulative_logprob = score
        if tops is not None:
            for seq, top in zip(seqs, tops):
                seq.output_logprobs.append(top)
        group.seqs = seqs

    def _finish(self, ops: SchedulerOps, group: "SequenceGroup", running: list) -> RequestResult:
        for seq in running:
            ops.drop(group, seq)
        p = group.sampling_params
        finished, deltas = [], []
        for index, (hyp, score) in enumerate(self.state.best(p.n)):
            seq = ops.new_sequence(group, group.seqs[0].prompt_token_ids)
            seq.index = index
            seq.status, seq.stop_reason = SequenceStatus.FINISHED_LENGTH, None
            if hyp is not None:
                seq.output_token_ids = list(hyp.output_token_ids)
                seq.token_ids = seq.prompt_token_ids + seq.output_token_ids
                seq.output_logprobs = list(hyp.output_logprobs)
                seq.status, seq.stop_reason = _hypothesis_end(hyp, ops.eos_token_ids)
            seq.cumulative_logprob = score
            finished.append(seq)
            deltas.append(CompletionDelta(
                index, list(seq.output_token_ids), list(seq.output_logprobs) if p.logprobs is not None else None,
                score, seq.status.value, seq.stop_reason, replace=True,
            ))
        group.seqs = finished
        ops.release_finished(group)
        return RequestResult(group.request_id, deltas, True)

    def aborted(self, group: "SequenceGroup") -> list[CompletionDelta]:
        """Ended mid-search: the best ``n`` so far of the finished hypotheses and the
        running beams (``group.seqs``, already marked ``abort``), a running beam scored
        as the search scores a beam that ends: its log-probability over its length to
        the ``length_penalty`` (float32, as ``BeamSearchState.step_all``). That is what
        HF's search cut at this length returns. A hypothesis keeps its finish (``stop``,
        ``length``), a running beam ends ``abort``: as an aborted request's finished and
        unfinished samples do. Before the first step, the one empty sequence."""
        p, st = group.sampling_params, self.state
        want = p.logprobs is not None
        # (score, tokens, logprobs, finish reason, stop reason), finished hypotheses first:
        # HF's merge puts them first too, and a stable sort keeps them ahead on a tie.
        found = []
        for hyp, score, done in zip(st.hyps, st.scores, st.is_finished):  # lists of float32 values, bools
            if done and hyp is not None:
                status, stop_reason = _hypothesis_end(hyp, self.eos_ids)
                found.append((score, hyp.output_token_ids, hyp.output_logprobs, status.value, stop_reason))
        beams = [s for s in group.seqs if s.cumulative_logprob is not None]
        if beams:
            lengths = [len(s.output_token_ids) for s in beams]
            summed = torch.tensor([s.cumulative_logprob for s in beams], dtype=torch.float32)
            scale = torch.tensor([n ** p.length_penalty if n else 1.0 for n in lengths], dtype=torch.float32)
            for seq, score in zip(beams, (summed / scale).tolist()):
                found.append((score, seq.output_token_ids, seq.output_logprobs, seq.status.value, seq.stop_reason))
        found.sort(key=lambda f: -f[0])
        return [CompletionDelta(index, list(tokens), list(logprobs) if want else None, score, reason, stop_reason,
                                replace=True)
                for index, (score, tokens, logprobs, reason, stop_reason) in enumerate(found[:p.n])]


def _hypothesis_end(hyp: Hypothesis, eos_ids: frozenset[int]) -> tuple[SequenceStatus, int | None]:
    """How a finished hypothesis ended: on EOS (no stop reason), on a stop token id (that
    id), or on its length."""
    if not hyp.finished_by_stop:
        return SequenceStatus.FINISHED_LENGTH, None
    last = hyp.output_token_ids[-1]
    return SequenceStatus.FINISHED_STOPPED, (None if last in eos_ids else last)


class BeamSearchMode(Mode):
    """Requests with ``num_beams > 1``: a base mode (it picks the tokens)."""

    name = "beam_search"
    order = 0
    base = True

    def applies(self, req: RequestContext) -> bool:
        return req.params.use_beam_search

    def output_shape(self, req: RequestContext, shape: OutputShape) -> OutputShape:
        # The best n hypotheses are known only at the end: nothing streams, and their
        # text is whole (stop strings do not cut a hypothesis).
        return replace(shape, num_completions=0, streams=False, stop_strings=False)

    def strategy(self, req: RequestContext, inner: RequestStrategy | None) -> RequestStrategy:
        p = req.params
        stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.ctx.eos_token_ids))
        return BeamSearchStrategy(p, req.prompt_len, frozenset(stops), frozenset(self.ctx.eos_token_ids))
