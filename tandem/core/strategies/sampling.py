"""The default mode: every sequence samples its next token by the request's params
(greedy, random, ``n`` independent samples)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tandem.core.core_outputs import CompletionDelta, RequestResult
from tandem.core.sampling_params import RequestOutputKind
from tandem.core.sequence import FINISH_REASON, SequenceStatus
from tandem.core.strategies.base import RequestStrategy, SchedulerOps, update_failure
from tandem.core.strategies.modes import Mode, RequestContext

if TYPE_CHECKING:
    from tandem.core.scheduler_output import ModelRunnerOutput, ScheduledGroup
    from tandem.core.sequence import SequenceGroup


def finish_reason(seq) -> str | None:
    return FINISH_REASON[seq.status]


class SamplingStrategy(RequestStrategy):
    multi_step = True  # update / update_all take a run's tokens (_append_run)

    def max_num_seqs(self, group: "SequenceGroup") -> int:
        return len(group.unfinished_seqs())

    def update(
        self, ops: SchedulerOps, group: "SequenceGroup", sg: "ScheduledGroup", result: "ModelRunnerOutput",
        rows: dict[int, int],
    ) -> RequestResult | None:
        """Append each sequence's sampled token and check its stops. A request that
        wants only its final output (``FINAL_ONLY``, no stop strings for the frontend
        to look for) reports nothing until a sequence finishes, and then that
        sequence's whole output at once (``replace``): the frontend does no work for
        it per step. Only where this strategy is the request's outermost: a wrapping
        strategy reads each step's deltas."""
        p = group.sampling_params
        quiet = p.output_kind is RequestOutputKind.FINAL_ONLY and not p.stop_strings and group.strategy is self
        deltas = []
        any_finished = going = False
        by_id = {s.seq_id: s for s in group.seqs} if len(group.seqs) > 1 else None
        want_logprobs = p.logprobs is not None
        check_stop = ops.check_stop
        no_token = result.no_token_seq_ids
        for ss in sg.seqs:
            seq = by_id[ss.seq_id] if by_id is not None else group.seqs[0]
            if FINISH_REASON[seq.status] is not None:
                continue
            seq.num_computed_tokens = ss.num_computed_tokens + len(ss.token_ids)
            if no_token and ss.seq_id in no_token:  # every token banned: nothing to append
                seq.status = SequenceStatus.FINISHED_NO_TOKEN
                any_finished = True
                if quiet:
                    deltas.append(_whole(seq, want_logprobs))
                else:
                    deltas.append(CompletionDelta(seq.index, [], [] if want_logprobs else None,
                                                  seq.cumulative_logprob, finish_reason(seq)))
                continue
            i = rows[ss.seq_id]
            token, top = result.token_ids[i], result.top_logprobs[i]
            seq.append_token(token, result.logprobs[i], top)
            check_stop(seq, group)
            emitted = [token]
            if result.run_token_ids and seq.status is SequenceStatus.RUNNING:
                emitted += _append_run(ops, group, seq, result.run_token_ids, i)
            reason = FINISH_REASON[seq.status]
            if reason is None:
                going = True
                if quiet:
                    continue
            else:
                any_finished = True
                if quiet:
                    deltas.append(_whole(seq, want_logprobs))
                    continue
            deltas.append(CompletionDelta(
                seq.index, emitted, [top] if top is not None else None, seq.cumulative_logprob,
                reason, seq.stop_reason,
            ))
        if any_finished:
            ops.release_finished(group)
        if quiet and not deltas:
            return None
        # A sequence that goes on keeps the group going (no need to look at the others).
        return RequestResult(group.request_id, deltas, False if going else group.is_finished)

    @classmethod
    def update_all(
        cls, ops: SchedulerOps, items: "list[tuple[SequenceGroup, ScheduledGroup]]", result: "ModelRunnerOutput",
        rows: dict[int, int],
    ) -> list[RequestResult | None]:
        """``update`` for a run of plain groups. The usual case, a running group of one
        sequence that sampled a token, is done here inline, with no Python call per
        group: ``Sequence.append_token`` and ``Scheduler.check_stop`` written out (the
        two must stay alike: ``tests/core/test_steady_records.py`` runs both on random
        stops). Any other goes to ``update``."""
        out: list[RequestResult | None] = []
        tokens, logprobs, tops, no_token = result.token_ids, result.logprobs, result.top_logprobs, result.no_token_seq_ids
        run_steps = result.run_token_ids
        eos, final_only, running = ops.eos_token_ids, RequestOutputKind.FINAL_ONLY, SequenceStatus.RUNNING
        stopped, length = SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH
        for group, sg in items:
            try:
                seqs, scheduled = group.seqs, sg.seqs
                if len(seqs) != 1 or len(scheduled) != 1 or no_token or seqs[0].status is not running:
                    out.append(group.strategy.update(ops, group, sg, result, rows))
                    continue
                seq, ss, p = seqs[0], scheduled[0], group.sampling_params
                seq.num_computed_tokens = ss.num_computed_tokens + len(ss.token_ids)
                i = rows[ss.seq_id]
                token, lp, top = tokens[i], logprobs[i], tops[i]
                # Sequence.append_token
                seq.output_token_ids.append(token)
                seq.token_ids.append(token)
                if lp is None or seq.cumulative_logprob is None:
                    seq.cumulative_logprob = None
                else:
                    seq.cumulative_logprob += lp
                if top is not None:
                    seq.output_logprobs.append(top)
                # Scheduler.check_stop
                num_out = len(seq.output_token_ids)
                if num_out >= p.min_tokens and not p.ignore_eos and token in eos:
                    seq.status = stopped
                elif num_out >= p.min_tokens and token in p.stop_token_ids:
                    seq.status, seq.stop_reason = stopped, token
                elif num_out >= p.max_tokens:
                    seq.status = length
                emitted = [token]
                if run_steps and seq.status is running:
                    emitted += _append_run(ops, group, seq, run_steps, i)
                quiet = p.output_kind is final_only and not p.stop_strings
                if seq.status is running:
                    out.append(None if quiet else RequestResult(group.request_id, [CompletionDelta(
                        seq.index, emitted, [top] if top is not None else None, seq.cumulative_logprob)], False))
                    continue
                ops.release_finished(group)
                delta = _whole(seq, p.logprobs is not None) if quiet else CompletionDelta(
                    seq.index, emitted, [top] if top is not None else None, seq.cumulative_logprob,
                    FINISH_REASON[seq.status], seq.stop_reason)
                out.append(RequestResult(group.request_id, [delta], group.is_finished))
            except Exception as e:  # noqa: BLE001 - this request's own update (its lengths, its blocks)
                result.failed_requests[sg.request_id] = update_failure(e)
                out.append(None)
        return out


def _append_run(ops: SchedulerOps, group: "SequenceGroup", seq, run_steps: list[list[int]], row: int) -> list[int]:
    """A running sequence's tokens of a run's later steps (``ModelRunnerOutput.run_token_ids``),
    appended in order up to its first stop, each step's K/V counted as computed (the
    tokens after a stop are dropped). Returns the tokens appended."""
    appended = []
    for step_tokens in run_steps:
        token = step_tokens[row]
        seq.num_computed_tokens += 1
        seq.append_token(token, None, None)
        appended.append(token)
        ops.check_stop(seq, group)
        if seq.status is not SequenceStatus.RUNNING:
            break
    return appended


def _whole(seq, want_logprobs: bool) -> CompletionDelta:
    """A finished sequence's whole output, replacing what the frontend holds."""
    return CompletionDelta(seq.index, list(seq.output_token_ids),
                           list(seq.output_logprobs) if want_logprobs else None, seq.cumulative_logprob,
                           FINISH_REASON[seq.status], seq.stop_reason, replace=True)


class SamplingMode(Mode):
    """Every request: the base mode where no other applies."""

    name = "sampling"
    order = 1
    base = True

    def applies(self, req: RequestContext) -> bool:
        return True

    def strategy(self, req: RequestContext, inner: RequestStrategy | None) -> RequestStrategy:
        return SamplingStrategy()
