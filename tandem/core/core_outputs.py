"""What the engine core reports after a step: plain data per request.

The core (scheduler, block manager, worker) keeps no output state. Each step it
returns, for every request that advanced, the tokens each of its sequences
gained (possibly several per step), their logprobs and finish reasons. The
frontend's ``OutputProcessor`` keeps its own per-request state (the whole
token lists, the text) and builds ``RequestOutput``s from these.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

from tandem.core.sampling_params import SamplingParams


@dataclass(frozen=True)
class OutputShape:
    """How a request's outputs are shaped, as its modes declare it
    (``Mode.output_shape``): plain data the frontend's ``OutputProcessor`` follows,
    so it needs no knowledge of the modes."""

    # Completions the request shows from its start (results may add more by index).
    num_completions: int
    # Whether outputs come before the end; False: nothing shows until the request
    # finishes, when its completions arrive whole (beam search's best hypotheses).
    streams: bool = True
    # Whether the frontend looks for the params' stop strings in the text.
    stop_strings: bool = True


@dataclass(frozen=True)
class RequestInfo:
    """A request as the engine accepted it: what an output repeats about its prompt,
    and how its outputs are shaped (None: ``params.n`` streamed completions)."""

    request_id: str
    params: SamplingParams
    encoder_prompt: str | None
    encoder_prompt_token_ids: list[int]
    prompt: str | None  # the decoder prompt
    prompt_token_ids: list[int]
    # Tokens the text leaves out (Whisper's timestamps): the model's non_text_token_ids.
    non_text_token_ids: Collection[int] = ()
    shape: OutputShape | None = None


@dataclass(slots=True)
class CompletionDelta:
    """One completion's progress in a step."""

    index: int
    new_token_ids: list[int]
    # One dict per new token (token -> logprob) when the request asked for logprobs.
    new_logprobs: list[dict[int, float]] | None
    cumulative_logprob: float | None
    finish_reason: str | None = None  # "stop", "length", "abort", "no_allowed_token"
    stop_reason: int | str | None = None
    # The new tokens are the whole output, replacing what came before (beam search's
    # finished hypotheses, known only at the end).
    replace: bool = False


@dataclass(slots=True)
class RequestResult:
    """A request's progress in a step, or its end (finished, aborted or failed)."""

    request_id: str
    completions: list[CompletionDelta] = field(default_factory=list)
    finished: bool = False
    # Set when the decoder prompt grew (a prompt slot was filled): the whole new prompt.
    prompt_token_ids: list[int] | None = None
    # With the filled slot's prompt_token_ids when the slot has a probe: its probability there.
    probe_prob: float | None = None
    # Set when the request failed; it is finished and has no more output.
    error: str | None = None
