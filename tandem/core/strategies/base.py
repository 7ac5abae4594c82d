"""The narrow interface a per-request mode implements.

A request runs under one *strategy* at a time (plain sampling by default; beam
search; a prompt slot the model fills first, then another strategy). The
scheduler asks it how many sequences the request may run, what plain data the
worker needs this step (a ``StepMode``) and how to apply the step's result; the
worker hands the rows of a group with a mode to that mode. Neither the
scheduler, the worker nor the sampler branches on which mode it is.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Protocol

from tandem.core.core_outputs import CompletionDelta

if TYPE_CHECKING:
    from collections.abc import Iterable

    import torch

    from tandem.core.core_outputs import RequestResult
    from tandem.core.sampling_params import SamplingParams
    from tandem.core.scheduler_output import ModelRunnerOutput, ScheduledGroup
    from tandem.core.sequence import Sequence, SequenceGroup


class RequestFailed(Exception):
    """Raised by a strategy's ``update`` when its request cannot go on: the engine fails
    that request alone, with this message as its ``error`` as it is (any other exception
    there is reported as a failed update). Sequence statuses set before raising are
    kept; the request's unfinished sequences end ``abort``."""


def update_failure(e: Exception) -> str:
    """A request's error when its strategy's update raised ``e``."""
    if isinstance(e, RequestFailed):  # the strategy says why
        return str(e)
    return f"updating it after the step failed: {type(e).__name__}: {e}"


class SchedulerOps(Protocol):
    """What a strategy may ask of the scheduler while it applies a step."""

    eos_token_ids: frozenset[int]

    def new_sequence(self, group: "SequenceGroup", prompt_token_ids: list[int]) -> "Sequence": ...

    def fork(self, group: "SequenceGroup", parent: "Sequence") -> "Sequence":
        """A copy of ``parent`` sharing its blocks (copy-on-write)."""
        ...

    def drop(self, group: "SequenceGroup", seq: "Sequence") -> None:
        """Free a sequence's blocks (it leaves the group)."""
        ...

    def take_over(self, pairs: "list[tuple[Sequence, Sequence]]") -> None:
        """Each ``(src, dst)``, ``dst`` a sequence of ``src``'s group (or a new one for
        it): ``dst`` becomes a copy of ``src`` under its own id, blocks shared (the partly
        filled one copied), the worker's state of it copied from ``src``'s, nothing sent
        again whole. Sources are not destinations."""
        ...

    def check_stop(self, seq: "Sequence", group: "SequenceGroup") -> None:
        """Finish ``seq`` on EOS, a stop token id or its length."""
        ...

    def release_finished(self, group: "SequenceGroup") -> None:
        """Free the finished sequences' blocks; retire the group once all are."""
        ...

    def rollback(self, group: "SequenceGroup", seq: "Sequence") -> None:
        """Free the blocks past what ``seq``'s tokens need (rejected lookahead tokens')."""
        ...


class LogitsTransform(ABC):
    """A mode's change to the step's logits, plain data sent beside the scheduler
    output (``SamplingInputs``), applied by the worker to the raw logits before any
    mode or processor reads them (a grammar's mask, forced tokens)."""

    # The sequences whose rows it changes; the worker finds their rows.
    seq_ids: list[int]

    @abstractmethod
    def apply(self, logits: "torch.Tensor", rows: list[int], owners: list[int], num_output_tokens: list[int]) -> None:
        """Change ``logits`` (float32 ``[S, vocab]``) in place at ``rows``: row ``rows[i]``
        is a row of sequence ``seq_ids[owners[i]]``, predicting its output token number
        ``num_output_tokens[i]`` (several rows of one sequence when it verifies
        lookahead tokens)."""


class StepMode(ABC):
    """Worker side of a mode: plain data sent with a scheduled group (so it can
    cross to another process), told which logits rows are its group's."""

    # True where the group's rows are alternatives of one continuation (beams): a
    # row-wise fallback of the processors then applies on the request's first step only.
    joint_rows = False

    @abstractmethod
    def prepare(self, logits: "torch.Tensor", rows: list[int]) -> Any:
        """Before the logits processors: may rewrite its rows of ``logits`` (float32
        ``[S, vocab]``) in place; returns what :meth:`select` needs."""

    @abstractmethod
    def select(self, scores: "torch.Tensor", rows: list[int], params: "SamplingParams", prepared: Any,
               generators: "list[torch.Generator | None] | None" = None,
               default_generator: "torch.Generator | None" = None) -> Any:
        """After the processors: the group's result for this step (plain data).
        ``generators``: each row's seeded stream, its sequence's (None: the request has
        no seed), ``default_generator`` the engine's, for modes that draw."""

    # The worker hands a step's groups of one StepMode class to these together, so a
    # mode may batch its tensor work over requests; by default they loop.
    @classmethod
    def prepare_all(cls, logits: "torch.Tensor", items: "list[tuple[StepMode, list[int]]]") -> list[Any]:
        """:meth:`prepare` of each ``(mode, rows)`` in ``items``, in order."""
        return [mode.prepare(logits, rows) for mode, rows in items]

    @classmethod
    def select_all(cls, scores: "torch.Tensor", items: "list[tuple[StepMode, list[int], SamplingParams, Any, Any]]",
                   default_generator: "torch.Generator | None" = None) -> list[Any]:
        """:meth:`select` of each ``(mode, rows, params, prepared, generators)`` in ``items``,
        in order."""
        return [mode.select(scores, rows, params, prep, gen, default_generator)
                for mode, rows, params, prep, gen in items]


class RequestStrategy(ABC):
    """Scheduler side of a mode, one object per request."""

    @abstractmethod
    def max_num_seqs(self, group: "SequenceGroup") -> int:
        """Sequences the request may run at once (reserved at admission)."""

    def ready(self, group: "SequenceGroup") -> bool:
        """Whether the request may be admitted now; False: it waits while requests
        behind it are admitted (its grammar still compiling). Raising fails the
        request alone, with the exception as its ``error``."""
        return True

    def num_initial_seqs(self, params: "SamplingParams") -> int:
        """Sequences the request starts with (its sequences may fork later)."""
        return params.n

    def lookahead(self, group: "SequenceGroup") -> bool:
        """Before the step: give running sequences tokens to compute beyond their
        next one (``Sequence.lookahead_token_ids``: draft tokens to verify); True if
        any got some. They run only where they fit the blocks and the token budget.
        Default: none."""
        return False

    def batch_items(self, group: "SequenceGroup", sg: "ScheduledGroup | None") -> "Iterable[tuple[str, Any]]":
        """What the request gives its modes' batch hooks (``modes.Mode``), as
        ``(mode name, item)`` pairs: before scheduling (``sg`` None) for
        ``before_schedule``, and for its ``ScheduledGroup`` for ``logits_transform``.
        A wrapping strategy adds its own to its inner strategy's."""
        return ()

    # True where step_mode never raises for a running group and asks nothing of the
    # step but its data, and a group of several sequences holds running ones only
    # (beam search: its running beams): the scheduler then records such a group's
    # usual decode step with the plain groups' (``Scheduler._steady``), not through
    # the general path.
    steady_step_mode = False

    # True where ``update`` / ``update_all`` take the tokens of a run of decode steps
    # (``ModelRunnerOutput.run_token_ids``: the steps after the first, when the
    # scheduler ran several per schedule, ``num_scheduler_steps``), appending them in
    # order and ending a sequence at its first stop. Read from the class's own namespace
    # (``core/sched/multi_step.py``): a subclass that changes ``update`` is in runs only
    # if it says so again.
    multi_step = False

    def step_mode(self, group: "SequenceGroup") -> StepMode | None:
        """What the worker needs this step; None: sample each row by its params."""
        return None

    @abstractmethod
    def update(
        self, ops: SchedulerOps, group: "SequenceGroup", sg: "ScheduledGroup", result: "ModelRunnerOutput",
        rows: dict[int, int],
    ) -> "RequestResult | None":
        """Apply the step to the group (``rows``: seq id -> index into the result's
        plain rows); returns its progress, or None when nothing is visible yet."""

    @classmethod
    def update_all(
        cls, ops: SchedulerOps, items: "list[tuple[SequenceGroup, ScheduledGroup]]", result: "ModelRunnerOutput",
        rows: dict[int, int],
    ) -> "list[RequestResult | None]":
        """``update`` for consecutive groups whose strategies are all of this class, in
        one call (a strategy that runs on most rows may do them without a Python call
        per group). Never raises for a request: one whose update failed is put in
        ``result.failed_requests`` with why (``RequestFailed``'s message as it is), and
        gets None here. One result per item, in order."""
        out: "list[RequestResult | None]" = []
        for group, sg in items:
            try:
                out.append(group.strategy.update(ops, group, sg, result, rows))
            except Exception as e:  # noqa: BLE001 - this request's own update (its strategy, its lengths)
                result.failed_requests[sg.request_id] = update_failure(e)
                out.append(None)
        return out

    def blocks_needed_at_most(self, group: "SequenceGroup", full_len: int, block_size: int) -> int | None:
        """Blocks the request may hold at once with its decoder sequences ``full_len``
        tokens long, when more than its sequences sharing their prompt need (None)."""
        return None

    def aborted(self, group: "SequenceGroup") -> "list[CompletionDelta]":
        """The request's completions when it ends from outside (aborted, or failed),
        each replacing what the frontend holds. Called after the scheduler marked its
        unfinished sequences ``abort``; it must not raise for a strategy whose update
        failed (the scheduler then falls back to this default). Default: every
        sequence's output so far, with its own finish reason."""
        want = group.sampling_params.logprobs is not None
        return [
            CompletionDelta(i, list(seq.output_token_ids), list(seq.output_logprobs) if want else None,
                            seq.cumulative_logprob, seq.status.value, seq.stop_reason, replace=True)
            for i, seq in enumerate(group.seqs)
        ]
