"""A decoder prompt completed by the model in the request's first step."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PromptSlot:
    """A decoder prompt completed by the model: after the prompt's first step, the
    token among ``choices`` the model scores highest (argmax over just those, as
    HF's Whisper language detection) joins the prompt, followed by ``then``;
    generation proper starts after them. The whole prompt is known before the
    first token is generated, so processors and lengths count it as prompt."""

    choices: tuple[int, ...]
    then: tuple[int, ...] = ()
