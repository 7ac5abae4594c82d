"""What a finished request returns."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None
    # "stop", "length", "abort"; "no_allowed_token": no token was left to sample (docs/generation.md)
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    encoder_prompt: str | None
    encoder_prompt_token_ids: list[int]
    prompt: str | None  # the decoder prompt
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True
    # Set when the request was rejected (outputs is then empty) or failed while being
    # served (outputs hold what it had generated).
    error: str | None = None
    # The probability of the prompt slot's probe token at the slot position
    # (tandem.core.inputs.PromptSlot.probe); None without one.
    probe_prob: float | None = None
