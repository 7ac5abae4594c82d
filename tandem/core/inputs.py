"""Prompt formats and their processing into encoder + decoder token ids.

A singleton prompt (``str``, :class:`TextPrompt`, :class:`TokensPrompt`) is the
encoder prompt and the decoder gets the model's default decoder prompt. An
:class:`ExplicitEncoderDecoderPrompt` names both; either slot takes any
singleton. The model class decides the default decoder prompt and how a given
one is completed (BART: ``[decoder_start, bos]``, and ``decoder_start`` is
prepended unless already present).
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypedDict, Union

import torch

from typing_extensions import NotRequired

from tandem.core.text_checks import check_unicode

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase


class TextPrompt(TypedDict):
    prompt: str


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
    prompt: NotRequired[str]


class AudioPrompt(TypedDict):
    """An encoder prompt for audio models: samples (array or tensor, 1-D or
    channels x samples, with their ``sampling_rate``) or a file path."""

    audio: Any
    sampling_rate: NotRequired[int]


SingletonPrompt = Union[str, TextPrompt, TokensPrompt]


class ExplicitEncoderDecoderPrompt(TypedDict):
    encoder_prompt: SingletonPrompt | AudioPrompt
    decoder_prompt: NotRequired[SingletonPrompt | None]


PromptType = Union[SingletonPrompt, AudioPrompt, ExplicitEncoderDecoderPrompt]


@dataclass(frozen=True, eq=False)
class EncoderInputs:
    """What a model's encoder consumes for one request, as the model class made it
    (:meth:`tandem.core.model.EncoderDecoderModel.get_encoder_inputs`).

    ``num_positions`` is how many encoder positions the encoder produces: the
    length of the cross-attention K/V every decoder token reads, which sizes the
    request's cross block table. For a text encoder it is the number of tokens;
    an audio encoder that downsamples frames produces fewer positions than it
    reads frames. ``token_ids`` is set for token inputs (and only token inputs
    are checked against the vocabulary); ``features`` for anything else.
    """

    num_positions: int
    token_ids: tuple[int, ...] | None = None
    features: "torch.Tensor | None" = None

    @classmethod
    def from_token_ids(cls, token_ids: list[int] | tuple[int, ...]) -> "EncoderInputs":
        return cls(num_positions=len(token_ids), token_ids=tuple(token_ids))

    @functools.cached_property
    def cache_key(self) -> Hashable:
        """Equal for equal inputs: requests with equal keys share one encoder run and
        one cross table. Token inputs key by their ids, features by a content hash."""
        if self.token_ids is not None:
            return ("tokens", self.token_ids)
        if self.features is not None:
            t = self.features.detach().contiguous().cpu()
            digest = hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest()
            return ("features", str(t.dtype), tuple(t.shape), digest)
        return ("positions", self.num_positions)


@dataclass
class EncoderDecoderInputs:
    encoder_prompt_token_ids: list[int]  # what the request gave (or tokenized to)
    prompt_token_ids: list[int]  # the decoder prompt, after completion
    encoder_prompt: str | None = None
    prompt: str | None = None
    encoder_inputs: EncoderInputs | None = None  # what the encoder runs on
    decoder_prompt_is_default: bool = False  # the request gave no decoder prompt


class InputProcessor:
    def __init__(
        self,
        hf_config: "PretrainedConfig",
        model_cls: type,  # an EncoderDecoderModel subclass (core/model.py imports this module)
        tokenizer: "PreTrainedTokenizerBase | None",
    ) -> None:
        self.hf_config = hf_config
        self.model_cls = model_cls
        self.tokenizer = tokenizer

    def process(self, prompt: Any) -> EncoderDecoderInputs:
        if isinstance(prompt, dict) and "encoder_prompt" in prompt:
            unknown = set(prompt) - {"encoder_prompt", "decoder_prompt"}
            if unknown:
                raise ValueError(f"unknown keys {sorted(unknown)} in encoder/decoder prompt")
            encoder, decoder = prompt["encoder_prompt"], prompt.get("decoder_prompt")
        else:
            encoder, decoder = prompt, None
        audio = ready = None
        if isinstance(encoder, EncoderInputs):  # made by the caller (long-form audio windows)
            ready, enc_ids, enc_text = encoder, [], None
        elif isinstance(encoder, dict) and "audio" in encoder:
            audio = self._audio(encoder)
            enc_ids, enc_text = [], None
        else:
            where = "encoder_prompt" if encoder is not prompt else "prompt"
            enc_ids, enc_text = self._singleton(encoder, where, True)
            if not enc_ids:
                raise ValueError("the encoder prompt is empty: it must have at least one token")
        if decoder is None:
            dec_ids, dec_text = self.model_cls.get_default_decoder_prompt(self.hf_config), None
        else:
            ids, dec_text = self._singleton(decoder, "decoder_prompt", False)
            dec_ids = self.model_cls.process_decoder_prompt(self.hf_config, ids)
        if ready is not None:
            encoder_inputs = ready
        elif audio is not None:
            encoder_inputs = self.model_cls.get_audio_encoder_inputs(self.hf_config, *audio)
        else:
            encoder_inputs = self.model_cls.get_encoder_inputs(self.hf_config, enc_ids)
        return EncoderDecoderInputs(enc_ids, dec_ids, enc_text, dec_text, encoder_inputs, decoder is None)

    @staticmethod
    def _audio(prompt: dict) -> tuple[Any, int | None]:
        """An audio prompt, ``{"audio": array | tensor | path, "sampling_rate": int}``, as the
        model class's ``get_audio_encoder_inputs`` takes it (the model reads the audio)."""
        unknown = set(prompt) - {"audio", "sampling_rate"}
        if unknown:
            raise ValueError(f"unknown keys {sorted(unknown)} in audio prompt (has 'audio', 'sampling_rate')")
        return prompt["audio"], prompt.get("sampling_rate")

    def _singleton(self, prompt: Any, where: str, is_encoder: bool) -> tuple[list[int], str | None]:
        if isinstance(prompt, str):
            return self._tokenize(prompt, where, is_encoder), prompt
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, (list, tuple)) or not all(
                    isinstance(t, int) and not isinstance(t, bool) for t in ids
                ):
                    raise ValueError(f"{where}.prompt_token_ids must be a list of ints, got {ids!r}")
                return list(ids), prompt.get("prompt")
            if "prompt" in prompt:
                text = prompt["prompt"]
                if not isinstance(text, str):
                    raise ValueError(f"{where}.prompt must be a string, got {type(text).__name__}")
                return self._tokenize(text, where, is_encoder), text
            raise ValueError(f"{where} dict needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")
        hint = ""
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            hint = f"; token ids go in a dict: {{'prompt_token_ids': {list(prompt)!r}}}"
        elif isinstance(prompt, (bytes, bytearray)):
            hint = "; decode bytes to str first"
        raise TypeError(
            f"{where} must be a str, {{'prompt': str}} or {{'prompt_token_ids': [int, ...]}}, "
            f"got {type(prompt).__name__} {preview(prompt)}{hint}"
        )

    def _tokenize(self, text: str, where: str, is_encoder: bool) -> list[int]:
        if not text:
            raise ValueError(f"{where} text is empty")
        if self.tokenizer is None:
            raise ValueError(f"{where} is text but the model has no tokenizer; pass token ids")
        check_unicode(text, where)
        # verbose=False: no transformers warning that an over-long prompt "will result in
        # indexing errors"; the engine checks every prompt's length and refuses it naming both.
        ids = list(self.tokenizer(text, add_special_tokens=True, verbose=False)["input_ids"])
        eos = self.tokenizer.eos_token_id
        # A decoder prompt is a prefix to continue, never a finished sequence.
        if not is_encoder and ids and eos is not None and ids[-1] == eos:
            ids.pop()
        return ids


def preview(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
