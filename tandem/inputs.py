"""vLLM's ``vllm.inputs``: prompt types and helpers (``from tandem.inputs import ...``).

The types are tandem's own (``tandem.core.inputs``); the engine's input processing
takes every shape listed there, and vLLM's ``multi_modal_data`` audio forms
(``tandem.core.vllm_prompts``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from tandem.core.inputs import (
    AudioPrompt,
    ExplicitEncoderDecoderPrompt,
    PromptType,
    SingletonPrompt,
    TextPrompt,
    TokensPrompt,
)


def build_explicit_enc_dec_prompt(encoder_prompt: Any, decoder_prompt: Any,
                                  mm_processor_kwargs: dict[str, Any] | None = None) -> ExplicitEncoderDecoderPrompt:
    """One ``ExplicitEncoderDecoderPrompt``; ``mm_processor_kwargs`` only when given (the
    engine refuses non-empty ones)."""
    prompt = ExplicitEncoderDecoderPrompt(encoder_prompt=encoder_prompt, decoder_prompt=decoder_prompt)
    if mm_processor_kwargs:
        prompt["mm_processor_kwargs"] = mm_processor_kwargs
    return prompt


def zip_enc_dec_prompts(enc_prompts: Iterable[Any], dec_prompts: Iterable[Any],
                        mm_processor_kwargs: Iterable[dict[str, Any]] | dict[str, Any] | None = None,
                        ) -> list[ExplicitEncoderDecoderPrompt]:
    """Pairs encoder and decoder prompts into ``ExplicitEncoderDecoderPrompt``s, in order
    (as ``zip``: the shorter list ends it). ``mm_processor_kwargs``: one dict for every
    pair, or one per pair."""
    if mm_processor_kwargs is None or isinstance(mm_processor_kwargs, dict):
        return [build_explicit_enc_dec_prompt(e, d, mm_processor_kwargs) for e, d in zip(enc_prompts, dec_prompts)]
    return [build_explicit_enc_dec_prompt(e, d, k) for e, d, k in zip(enc_prompts, dec_prompts, mm_processor_kwargs)]


def to_enc_dec_tuple_list(enc_dec_prompts: Iterable[ExplicitEncoderDecoderPrompt]) -> list[tuple[Any, Any]]:
    """``[(encoder_prompt, decoder_prompt), ...]``: the inverse of ``zip_enc_dec_prompts``
    (a prompt without ``decoder_prompt`` gives None)."""
    return [(p["encoder_prompt"], p.get("decoder_prompt")) for p in enc_dec_prompts]


__all__ = [
    "AudioPrompt",
    "ExplicitEncoderDecoderPrompt",
    "PromptType",
    "SingletonPrompt",
    "TextPrompt",
    "TokensPrompt",
    "build_explicit_enc_dec_prompt",
    "to_enc_dec_tuple_list",
    "zip_enc_dec_prompts",
]
