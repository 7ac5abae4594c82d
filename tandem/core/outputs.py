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
    # "stop", "length", "abort"; "no_allowed_token": no token was left to sample (docs/generation.md);
    # "error": its request was refused or failed (``error`` says why)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None  # why, with finish_reason "error" (the request's ``error``)

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
    # Set when the request was rejected or failed while being served; ``outputs`` then hold
    # one entry per requested output all the same (``with_error``), so ``outputs[0].text``
    # reads as vLLM's loops read it.
    error: str | None = None
    # The probability of the prompt slot's probe token at the slot position
    # (tandem.core.inputs.PromptSlot.probe); None without one.
    probe_prob: float | None = None


def with_error(outputs: list[CompletionOutput], n: int, error: str) -> list[CompletionOutput]:
    """A refused or failed request's outputs: one per requested output (``n``, or more
    where there are more), so ``outputs[0]`` exists. Each that had not finished (or was
    aborted by the failure) gets finish_reason ``"error"`` and ``error``, keeping what it had
    generated; one that finished before the failure keeps its own reason; the missing ones
    are empty (text ``""``)."""
    outs = list(outputs)
    for c in outs:
        if c.finish_reason is None or c.finish_reason == "abort":
            c.finish_reason, c.error = "error", error
    outs += [CompletionOutput(index=i, text="", token_ids=[], cumulative_logprob=None, logprobs=None,
                              finish_reason="error", error=error) for i in range(len(outs), n)]
    return outs


def rejected_output(rid: str, prompt, error: Exception, params) -> RequestOutput:
    """The output of a prompt refused before it was queued (or lost with the process that
    held it): ``error`` says why, one empty "error" completion per requested one."""
    text = prompt if isinstance(prompt, str) else None
    why = str(error) if isinstance(error, (ValueError, TypeError)) else f"{type(error).__name__}: {error}"
    n = getattr(params, "n", None) or getattr(params, "beam_width", None) or 1
    return RequestOutput(
        request_id=rid,
        encoder_prompt=text,
        encoder_prompt_token_ids=[],
        prompt=None,
        prompt_token_ids=[],
        outputs=with_error([], n, why),  # one empty "error" output per requested one, as vLLM's loops read
        finished=True,
        error=why,
    )
