"""Beam search as a mode: HF ``generate``'s beam search, in the engine, with
copy-on-write blocks.

Worker side (``BeamStep``): the group's rows become log-probabilities before the
processors; after them, each beam's running score is added and the best
``beams_to_keep`` (beam, token) continuations over all its beams are the step's
result. Scheduler side (``BeamSearchStrategy``): ``BeamSearchState`` picks the
next running beams and the finished hypotheses from those; a beam continued more
than once forks (its blocks shared, copied on write), a beam not continued is
freed, and a finished search leaves the best ``n`` hypotheses as the request's
completions.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from tandem.core.core_outputs import CompletionDelta, OutputShape, RequestResult
from tandem.core.kv.block_pool import blocks_for
from tandem.core.sequence import SequenceStatus
from tandem.core.strategies.base import RequestStrategy, SchedulerOps, StepMode, update_failure
from tandem.core.strategies.beam.search import BeamCandidates, BeamSearchState
from tandem.core.strategies.modes import Mode, RequestContext

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
            logits.copy_(torch.log_softmax(logits, dim=-1))
        elif rows:
            r = torch.tensor(rows, device=logits.device)
            logits.index_copy_(0, r, torch.log_softmax(logits.index_select(0, r), dim=-1))
        return [None] * len(items)

    def select(self, scores: torch.Tensor, rows: list[int], params: "SamplingParams", prepared, generator=None,
               default_generator=None) -> BeamCandidates:
        """HF's top-k continuations: processed log-probs plus each beam's running
        score, flattened over (beam, token), the best ``beams_to_keep``."""
        return self.select_all(scores, [(self, rows, params, prepared, generator)], default_generator)[0]

    @classmethod
    def select_all(cls, scores: torch.Tensor, items: list, default_generator=None) -> list[BeamCandidates]:
        """:meth:`select` for many requests, batched over those with the same beam
        count, ``beams_to_keep`` and step kind: one add and one top-k over ``[G,
        beams * vocab]`` (row by row the same arithmetic as HF's ``[1, beams * vocab]``)."""
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
            per_beam = logp[:, None, :] if first else logp.view(g, num_beams, vocab)
            accumulated = (per_beam + running[:, :, None]).view(g, num_beams * vocab)
            values, flat = torch.topk(accumulated, k=keep)  # [g, keep]
            token = flat % vocab
            if first:
                token_logprob = logp.gather(1, token)
                parent = torch.zeros_like(token)
            else:
                token_logprob = logp.reshape(g, num_beams * vocab).gather(1, flat)  # reshape: TP logits are a slice of a padded vocab
                parent = flat // vocab
            values, parent, token, token_logprob = (t.tolist() for t in (values, parent, token, token_logprob))
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
                results[j] = BeamCandidates(
                    scores=values[n], parents=parent[n], token_ids=token[n],
                    token_logprobs=token_logprob[n], top_logprobs=top,
                )
        return results


class BeamSearchStrategy(RequestStrategy):
    def __init__(self, params: "SamplingParams", prompt_len: int, stop_ids: frozenset[int]) -> None:
        self.state = BeamSearchState(params, prompt_len, stop_ids)
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
        return BeamStep(self.state.running_scores(), self.state.num_beams, self.beams_to_keep)

    def update(
        self, ops: SchedulerOps, group: "SequenceGroup", sg: "ScheduledGroup", result: "ModelRunnerOutput",
        rows: dict[int, int],
    ) -> RequestResult | None:
        """One beam step: the next running beams reuse, fork or drop this step's;
        a finished search leaves the best hypotheses as the group's sequences."""
        running, step = self._step_input(group, sg, result)
        return self._apply(ops, group, running, self.state.step_all([step])[0])

    @classmethod
    def update_all(
        cls, ops: SchedulerOps, items: "list[tuple[SequenceGroup, ScheduledGroup]]", result: "ModelRunnerOutput",
        rows: dict[int, int],
    ) -> list[RequestResult | None]:
        """:meth:`update` for a run of beam requests: their search steps stacked into
        one set of tensor ops (``BeamSearchState.step_all``), then each request's forks
        and drops. A request whose update raises fails alone; a fault in the stacked
        arithmetic fails the requests stacked with it."""
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
        for (n, group, sg, running), beams in zip(ready, next_beams):
            try:
                out[n] = group.strategy._apply(ops, group, running, beams)
            except Exception as e:  # noqa: BLE001 - this request's own forks and drops
                result.failed_requests[sg.request_id] = update_failure(e)
        return out

    def _step_input(self, group: "SequenceGroup", sg: "ScheduledGroup", result: "ModelRunnerOutput"):
        """The group's running beams (their computed tokens counted) and its search
        step's input (``BeamSearchState.step_all``)."""
        cands = result.mode_outputs[group.request_id]
        by_id = {s.seq_id: s for s in group.seqs}
        running = [by_id[ss.seq_id] for ss in sg.seqs]
        for ss, seq in zip(sg.seqs, running):
            seq.num_computed_tokens = ss.num_computed_tokens + len(ss.token_ids)
        num_out = len(running[0].output_token_ids)
        return running, (self.state, cands, [s.output_token_ids for s in running],
                         [s.output_logprobs for s in running], num_out)

    def _apply(self, ops: SchedulerOps, group: "SequenceGroup", running: list, next_beams: list) -> RequestResult | None:
        if self.state.done:
            return self._finish(ops, group, running)
        claimed: set[int] = set()
        plan = []
        for nb in next_beams:  # forks first, from the parents as they are
            parent = running[nb.parent]
            if nb.parent in claimed:
                plan.append((ops.fork(group, parent), nb))
            else:
                claimed.add(nb.parent)
                plan.append((parent, nb))
        for j, seq in enumerate(running):
            if j not in claimed:
                ops.drop(group, seq)
        for seq, nb in plan:
            seq.append_token(nb.token_id, nb.token_logprob, nb.top_logprobs)
            seq.cumulative_logprob = nb.score
        group.seqs = [seq for seq, _ in plan]
        return None  # beams change until the end: nothing to show (the frontend does nothing)

    def _finish(self, ops: SchedulerOps, group: "SequenceGroup", running: list) -> RequestResult:
        for seq in running:
            ops.drop(group, seq)
        p = group.sampling_params
        finished, deltas = [], []
        for index, (hyp, score) in enumerate(self.state.best(p.n)):
            seq = ops.new_sequence(group, group.seqs[0].prompt_token_ids)
            seq.index = index
            stopped = False
            if hyp is not None:
                seq.output_token_ids = list(hyp.output_token_ids)
                seq.token_ids = seq.prompt_token_ids + seq.output_token_ids
                seq.output_logprobs = list(hyp.output_logprobs)
                stopped = hyp.finished_by_stop
                if stopped and hyp.output_token_ids[-1] not in ops.eos_token_ids:
                    seq.stop_reason = hyp.output_token_ids[-1]
            seq.cumulative_logprob = score
            seq.status = SequenceStatus.FINISHED_STOPPED if stopped else SequenceStatus.FINISHED_LENGTH
            finished.append(seq)
            deltas.append(CompletionDelta(
                index, list(seq.output_token_ids), list(seq.output_logprobs) if p.logprobs is not None else None,
                score, seq.status.value, seq.stop_reason, replace=True,
            ))
        group.seqs = finished
        ops.release_finished(group)
        return RequestResult(group.request_id, deltas, True)


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
        return BeamSearchStrategy(p, req.prompt_len, frozenset(stops))
