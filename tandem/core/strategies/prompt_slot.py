"""A decoder prompt completed by the model in the request's first step
(Whisper's language detection), then another strategy takes over."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tandem.core.core_outputs import RequestResult
from tandem.core.inputs import PromptSlot
from tandem.core.strategies.base import RequestStrategy, SchedulerOps, StepMode
from tandem.core.strategies.modes import Mode, RequestContext

if TYPE_CHECKING:
    from tandem.core.sampling_params import SamplingParams
    from tandem.core.scheduler_output import ModelRunnerOutput, ScheduledGroup
    from tandem.core.sequence import SequenceGroup


@dataclass(frozen=True)
class SlotStep(StepMode):
    choices: tuple[int, ...]
    probe: int | None = None

    def prepare(self, logits: "torch.Tensor", rows: list[int]) -> tuple[int, float | None]:
        # On the raw logits, before any processor: HF's detect_language and
        # WhisperNoSpeechDetection (a re-run of the model on the prompt) read the same.
        logits_row = logits[rows[0]]  # [vocab] float32
        token = self.choices[int(logits_row[list(self.choices)].argmax())]
        prob = None
        if self.probe is not None:
            prob = float(torch.softmax(logits_row.float(), dim=-1)[self.probe])
        return token, prob

    def select(self, scores: "torch.Tensor", rows: list[int], params: "SamplingParams",
               prepared: tuple[int, float | None], generators=None, default_generator=None) -> tuple[int, float | None]:
        return prepared


class PromptSlotStrategy(RequestStrategy):
    def __init__(self, slot: PromptSlot, then: RequestStrategy) -> None:
        self.slot, self.then = slot, then

    def max_num_seqs(self, group: "SequenceGroup") -> int:
        return self.then.max_num_seqs(group)

    def num_initial_seqs(self, params: "SamplingParams") -> int:
        return self.then.num_initial_seqs(params)

    def blocks_needed_at_most(self, group: "SequenceGroup", full_len: int, block_size: int) -> int | None:
        return self.then.blocks_needed_at_most(group, full_len, block_size)

    def aborted(self, group: "SequenceGroup"):
        return self.then.aborted(group)

    def ready(self, group: "SequenceGroup") -> bool:
        return self.then.ready(group)

    def step_mode(self, group: "SequenceGroup") -> SlotStep:
        return SlotStep(self.slot.choices, self.slot.probe)

    def update(
        self, ops: SchedulerOps, group: "SequenceGroup", sg: "ScheduledGroup", result: "ModelRunnerOutput",
        rows: dict[int, int],
    ) -> RequestResult:
        """The model chose the slot's token: it and ``then`` extend every sequence's
        decoder prompt (computed next step, with the first token)."""
        token, prob = result.mode_outputs[group.request_id]
        extra = [token, *self.slot.then]
        by_id = {s.seq_id: s for s in group.seqs}
        for ss in sg.seqs:
            seq = by_id[ss.seq_id]
            seq.num_computed_tokens = ss.num_computed_tokens + len(ss.token_ids)
            seq.prompt_token_ids = seq.prompt_token_ids + extra
            seq.token_ids = seq.token_ids + extra
        group.strategy = self.then
        return RequestResult(group.request_id, prompt_token_ids=list(group.seqs[0].prompt_token_ids), probe_prob=prob)


class PromptSlotMode(Mode):
    """Requests given a ``prompt_slot`` option: outermost, its step comes first."""

    name = "prompt_slot"
    order = 100

    def applies(self, req: RequestContext) -> bool:
        return req.options.get("prompt_slot") is not None

    def strategy(self, req: RequestContext, inner: RequestStrategy | None) -> RequestStrategy:
        return PromptSlotStrategy(req.options["prompt_slot"], inner)
