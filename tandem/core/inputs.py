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
from tandem.core.vllm_prompts import normalize_prompt

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase


_INT = {int}  # the type of a prompt's ids in the usual case


class TextPrompt(TypedDict):
    prompt: str
    # vLLM's keys (core/vllm_prompts.py): {"audio": (samples, rate)}; an empty mm_processor_kwargs
    multi_modal_data: NotRequired[dict[str, Any]]
    mm_processor_kwargs: NotRequired[dict[str, Any]]


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
    prompt: NotRequired[str]
    multi_modal_data: NotRequired[dict[str, Any]]
    mm_processor_kwargs: NotRequired[dict[str, Any]]


class AudioPrompt(TypedDict):
    """An encoder prompt for audio models: samples (array or tensor, 1-D or
    channels x samples, with their ``sampling_rate``) or a file path."""

    audio: Any
    sampling_rate: NotRequired[int]


SingletonPrompt = Union[str, TextPrompt, TokensPrompt]


class ExplicitEncoderDecoderPrompt(TypedDict):
    encoder_prompt: SingletonPrompt | AudioPrompt
    decoder_prompt: NotRequired[SingletonPrompt | None]
    mm_processor_kwargs: NotRequired[dict[str, Any]]


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


@dataclass(frozen=True)
class PromptSlot:
    """A decoder prompt completed by the model: after the prompt's first step, the
    token among ``choices`` the model scores highest (argmax over just those, as
    HF's Whisper language detection) joins the prompt, followed by ``then``;
    generation proper starts after them. The whole prompt is known before the
    first token is generated, so processors and lengths count it as prompt.
    ``probe``: a token whose probability at the slot position (softmax of the raw
    logits, before any processor) the request reports as ``RequestOutput.probe_prob``
    (Whisper's no-speech probability, as HF's ``WhisperNoSpeechDetection`` reads it).
    A slot with one choice forces that token: a prompt split there just to probe."""

    choices: tuple[int, ...]
    then: tuple[int, ...] = ()
    probe: int | None = None


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
        # Most tokens a text prompt may have: a text encoder takes one position per token
        # (EncoderDecoderModel.get_encoder_inputs); a decoder prompt must leave a position free.
        self.max_tokens = {True: model_cls.max_encoder_len(hf_config), False: model_cls.max_decoder_len(hf_config)}

    def process(self, prompt: Any) -> EncoderDecoderInputs:
        prompt = normalize_prompt(prompt)
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
                # Plain ints (the usual case) checked in C, without a generator step per id.
                if not isinstance(ids, (list, tuple)) or not (set(map(type, ids)) <= _INT or all(
                    isinstance(t, int) and not isinstance(t, bool) for t in ids
                )):
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
        self._refuse_long_text(text, is_encoder)
        # verbose=False: no transformers warning that an over-long prompt "will result in
        # indexing errors"; the engine checks every prompt's length and refuses it naming both.
        # A decoder prompt that opens with a special token spells its own prefix
        # ("<|startoftranscript|>", "<s>"): the tokenizer's would double it (vLLM's rule for Whisper).
        add = is_encoder or not text.startswith(self._special_tokens)
        ids = list(self.tokenizer(text, add_special_tokens=add, verbose=False)["input_ids"])
        eos = self.tokenizer.eos_token_id
        # A decoder prompt is a prefix to continue, never a finished sequence.
        if not is_encoder and ids and eos is not None and ids[-1] == eos:
            ids.pop()
        return ids

    @functools.cached_property
    def _special_tokens(self) -> tuple[str, ...]:
        tok = self.tokenizer
        added = getattr(tok, "added_tokens_decoder", {}) or {}
        names = {t.content for t in added.values() if getattr(t, "special", False)}
        return tuple(sorted(names | set(tok.all_special_tokens)))

    def _refuse_long_text(self, text: str, is_encoder: bool) -> None:
        """Refuse a text far longer than the model takes after tokenizing only a prefix
        of it, so a prompt of megabytes costs what a prompt of kilobytes does.

        Why a prefix and not a character count alone: no count of characters per token
        is safe. Normalizers collapse whitespace runs (T5's), SentencePiece makes one
        <unk> of a run of unknown characters, so a text of millions of characters may
        be a few tokens. A prefix's tokens are a lower bound on the whole text's
        instead: tokenizers split text into pieces at whitespace before their model
        runs on each piece, so where a single space stands between two non-space
        characters the pieces (and tokens) left of it are the same in the prefix as in
        the whole. The cut is made there when the window has such a space, and
        ``PREFIX_SLACK`` tokens are not counted in case it falls inside a piece (or in
        a tokenizer that splits otherwise), where only the tokens near the cut can
        differ. Special tokens only add to the whole. So the refusal never refuses a
        prompt that fits; a prompt whose prefix does fit is tokenized whole, as
        before."""
        limit = self.max_tokens[is_encoder]
        window = PREFIX_CHARS_PER_TOKEN * (limit + PREFIX_SLACK)
        if len(text) <= window:
            return
        cut = _space_between_words(text, window // 2, window) or window
        n = len(self.tokenizer(text[:cut], add_special_tokens=False, verbose=False)["input_ids"])
        if n - PREFIX_SLACK <= limit:
            return
        what = "encoder prompt" if is_encoder else "decoder prompt"
        at_most = f"the model accepts at most {limit}" if is_encoder else f"the model has {limit} decoder positions"
        raise ValueError(
            f"{what} has more than {limit} tokens: {len(text)} characters, of which the first {cut} are "
            f"already {n} tokens; {at_most}"
        )


# A text prompt longer than PREFIX_CHARS_PER_TOKEN characters for each token the model
# takes (plus PREFIX_SLACK) is measured by a prefix of that many characters first. Natural
# text has 3-6 characters per token, so an over-long prompt is refused from its prefix;
# the slack covers a cut inside a word (see InputProcessor._refuse_long_text).
PREFIX_CHARS_PER_TOKEN = 16
PREFIX_SLACK = 64


def _space_between_words(text: str, lo: int, hi: int) -> int | None:
    """The last index in [lo, hi) of a single space between two non-space characters."""
    i = text.rfind(" ", lo, hi)
    while i > lo:
        if not text[i - 1].isspace() and i + 1 < len(text) and not text[i + 1].isspace():
            return i
        i = text.rfind(" ", lo, i)
    return None


def preview(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
