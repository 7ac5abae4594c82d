"""Speculative decoding as a mode: each step a sequence may compute its last token
and up to ``k`` draft tokens in one forward, and keep the accepted prefix.

Scheduler side (``SpeculativeStrategy``): before the step, the n-gram proposer
(``tandem/core/strategies/speculative/ngram.py``), or the draft model for every running
request at once (``tandem/core/strategies/speculative/draft.py``, through the mode's
``before_schedule`` batch hook), gives each decoding sequence its drafts
(``Sequence.lookahead_token_ids``, which get slots and run as a chunk after its
last token); after it, the accepted tokens are appended with the usual stops
(EOS, stop token ids, ``max_tokens``: the first stop truncates what follows),
the rejected drafts' slots are rolled back (``BlockManager.rollback_slots``)
and the sequence's computed length counts only what was accepted. A step in
which no sequence of the request has a draft is a plain step (``inner``).

Worker side (``VerifyStep``): the group's rows are its sequences' ``k_i + 1``
positions, each processed with the history it would have had
(``tandem/core/strategies/speculative/verify.py`` accepts and samples from them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from tandem.core.core_outputs import CompletionDelta, RequestResult
from tandem.core.sequence import SequenceStatus
from tandem.core.speculative_config import SpeculativeConfig
from tandem.core.strategies.base import RequestStrategy, SchedulerOps, StepMode
from tandem.core.strategies.modes import EngineContext, Mode, RequestContext
from tandem.core.strategies.sampling import SamplingStrategy, finish_reason
from tandem.core.strategies.speculative import ngram

if TYPE_CHECKING:
    import torch

    from tandem.core.sequence import Sequence

    from tandem.core.sampling_params import SamplingParams
    from tandem.core.scheduler_output import ModelRunnerOutput, ScheduledGroup
    from tandem.core.sequence import SequenceGroup


@dataclass(frozen=True)
class VerifyStep(StepMode):
    """``drafts``: each scheduled sequence's draft tokens, in the group's order."""

    drafts: tuple[tuple[int, ...], ...]

    def prepare(self, logits: "torch.Tensor", rows: list[int]) -> None:
        return None

    def select(self, scores, rows, params, prepared, generators=None, default_generator=None) -> list:
        from tandem.core.strategies.speculative.verify import verify

        return verify(scores, rows, [list(d) for d in self.drafts], params, generators, default_generator)


@dataclass
class SpeculationCounters:
    """Since the engine started: draft tokens proposed and accepted, and sequence
    steps that verified at least one draft."""

    proposed: int = 0
    accepted: int = 0
    verify_steps: int = 0


class SpeculativeStrategy(RequestStrategy):
    def __init__(self, config: SpeculativeConfig, encoder_token_ids: list[int] | None,
                 counters: SpeculationCounters, inner: RequestStrategy | None = None,
                 draft: Any = None) -> None:
        """``draft``: the engine's draft model, which proposes for this request (None:
        the n-gram proposer)."""
        self.config = config
        self.draft = draft
        self.encoder = None if encoder_token_ids is None else np.asarray(encoder_token_ids, dtype=np.int64)
        self.counters = counters
        self.inner = inner if inner is not None else SamplingStrategy()

    def max_num_seqs(self, group: "SequenceGroup") -> int:
        return self.inner.max_num_seqs(group)

    def num_initial_seqs(self, params: "SamplingParams") -> int:
        return self.inner.num_initial_seqs(params)

    def blocks_needed_at_most(self, group: "SequenceGroup", full_len: int, block_size: int) -> int | None:
        return self.inner.blocks_needed_at_most(group, full_len, block_size)

    def aborted(self, group: "SequenceGroup"):
        return self.inner.aborted(group)

    def batch_items(self, group: "SequenceGroup", sg: "ScheduledGroup | None"):
        yield from self.inner.batch_items(group, sg)
        if sg is None and self.draft is not None:
            yield SpeculativeMode.name, self

    def draft_lengths(self, group: "SequenceGroup") -> list[tuple["Sequence", int]]:
        """The sequences that may get drafts this step, each with how many at most:
        only a decoding sequence (its prompt computed) speculates, and never past
        ``max_tokens`` (the step emits up to k + 1 tokens)."""
        c, p = self.config, group.sampling_params
        out = []
        for seq in group.seqs:
            if seq.status is not SequenceStatus.RUNNING or seq.num_new_tokens != 1:
                continue
            k = min(c.num_speculative_tokens, p.max_tokens - len(seq.output_token_ids) - 1)
            if k > 0:
                out.append((seq, k))
        return out

    def lookahead(self, group: "SequenceGroup") -> bool:
        if self.draft is not None:  # the draft model proposed for every running group already
            return any(s.lookahead_token_ids for s in group.seqs)
        c = self.config
        for seq in group.seqs:
            seq.lookahead_token_ids = []
        any_draft = False
        for seq, k in self.draft_lengths(group):
            decoder = np.asarray(seq.token_ids, dtype=np.int64)
            seq.lookahead_token_ids = ngram.propose(decoder, self.encoder, k, c.prompt_lookup_max, c.prompt_lookup_min)
            any_draft |= bool(seq.lookahead_token_ids)
        return any_draft

    def step_mode(self, group: "SequenceGroup") -> StepMode | None:
        seqs = group.get_seqs(SequenceStatus.RUNNING)
        if not any(s.lookahead_token_ids for s in seqs):
            return self.inner.step_mode(group)
        return VerifyStep(tuple(tuple(s.lookahead_token_ids) for s in seqs))

    def update(
        self, ops: SchedulerOps, group: "SequenceGroup", sg: "ScheduledGroup", result: "ModelRunnerOutput",
        rows: dict[int, int],
    ) -> RequestResult:
        verified = result.mode_outputs.get(group.request_id)
        if verified is None:  # no drafts this step: a plain step
            return self.inner.update(ops, group, sg, result, rows)
        by_id = {s.seq_id: s for s in group.seqs}
        want_logprobs = group.sampling_params.logprobs is not None
        deltas, any_finished, counters = [], False, self.counters
        for ss, v in zip(sg.seqs, verified):
            seq = by_id[ss.seq_id]
            num_drafts = len(seq.lookahead_token_ids)
            seq.lookahead_token_ids = []
            if seq.finished:
                continue
            if v.error is not None:
                raise ValueError(v.error)
            counters.proposed += num_drafts
            counters.accepted += v.accepted
            counters.verify_steps += bool(num_drafts)
            # Keys and values are valid for the last token and the accepted drafts.
            seq.num_computed_tokens = ss.num_computed_tokens + len(ss.token_ids) - num_drafts + v.accepted
            emitted, tops = [], []
            for j, token in enumerate(v.token_ids):
                top = v.top_logprobs[j] if v.top_logprobs is not None else None
                seq.append_token(token, v.logprobs[j], top)
                emitted.append(token)
                if top is not None:
                    tops.append(top)
                ops.check_stop(seq, group)
                if seq.finished:
                    break
            if v.no_token and not seq.finished:
                seq.status = SequenceStatus.FINISHED_NO_TOKEN
            if not seq.finished:
                ops.rollback(group, seq)
            reason = finish_reason(seq)
            any_finished |= reason is not None
            deltas.append(CompletionDelta(
                seq.index, emitted, tops if want_logprobs else None, seq.cumulative_logprob, reason, seq.stop_reason,
            ))
        if any_finished:
            ops.release_finished(group)
        return RequestResult(group.request_id, deltas, group.is_finished)


def verification_stats(c: SpeculationCounters) -> dict[str, Any]:
    """The counters and what they mean: the share of draft tokens accepted, and the
    tokens a verifying sequence step emits on average (accepted drafts + 1)."""
    return {
        "spec_draft_tokens": c.proposed,
        "spec_accepted_tokens": c.accepted,
        "spec_verify_steps": c.verify_steps,
        "spec_acceptance_rate": c.accepted / c.proposed if c.proposed else 0.0,
        "spec_mean_accepted_length": 1 + c.accepted / c.verify_steps if c.verify_steps else 0.0,
    }


class SpeculativeMode(Mode):
    """Requests of an engine with ``speculative_config``, unless they use user logits
    processors (user code, possibly stateful, would be called for positions that are
    then rejected). It steps aside for modes whose draft positions would differ from
    plain decoding or cannot be verified per position: beam search (its beams are not
    one sequence's continuation) and structured output (its grammar matcher advances
    one accepted token at a time). The draft model, when there is one, is the engine's
    ``services["draft"]``."""

    name = "speculative"
    order = 10
    yields_to = frozenset({"beam_search", "structured_output"})

    def __init__(self, ctx: EngineContext) -> None:
        super().__init__(ctx)
        self.config: SpeculativeConfig | None = ctx.config.speculative
        self.draft = ctx.services.get("draft")
        self.counters = SpeculationCounters()

    def applies(self, req: RequestContext) -> bool:
        return self.config is not None and not req.params.logits_processors

    def strategy(self, req: RequestContext, inner: RequestStrategy | None) -> RequestStrategy:
        return SpeculativeStrategy(self.config, req.encoder_token_ids, self.counters, inner, draft=self.draft)

    def before_schedule(self, items: list) -> None:
        if self.draft is not None:
            self.draft.propose(items)

    def release(self, group: "SequenceGroup") -> None:
        if self.draft is not None:
            self.draft.release(group)

    def stats(self) -> dict[str, Any]:
        return verification_stats(self.counters)
