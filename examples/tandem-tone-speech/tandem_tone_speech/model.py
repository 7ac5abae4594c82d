"""Tone speech: a speech model family of its own, served by tandem through its
transcription interface (``tandem.core.transcription``) with no change in tandem.

The transformer is Whisper's (tandem's Whisper encoder and decoder layers, HF
Whisper's weight names), but the rest is this package's: the features
(``features.py``: log band energies, not a log-mel), the window (``2 *
max_source_positions`` frames of 10 ms), the decoder prompt (the start token
alone: one language, one task) and the long-form rule: audio is cut into
consecutive windows, each decoded on its own, and each window's text is one
segment timed by its window.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from tandem import EncoderDecoderModel, KVCacheSpec, RequestOutputKind, SamplingParams
from tandem.core.inputs import EncoderInputs
from tandem.core.transcription import (
    Transcription,
    TranscriptionContext,
    TranscriptionOptions,
    TranscriptionSession,
    WindowOutcome,
    WindowRequest,
)
from tandem.core.weight_loading import load_checkpoint
from tandem.model_zoo.whisper.model import WhisperModel
from tandem_tone_speech.features import SAMPLE_RATE, band_energies, window_samples


def _load(source: Any, sampling_rate: int | None, max_seconds: float | None = None) -> torch.Tensor:
    from tandem.audio import load_audio  # 16 kHz mono float32, every failure a ValueError naming it

    return load_audio(source, sampling_rate, max_seconds=max_seconds)


class ToneSpeechForConditionalGeneration(EncoderDecoderModel):
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "kv_proj": ["k_proj", "v_proj"]}

    def __init__(self, config, ctx) -> None:
        super().__init__(config, ctx)
        self.model = WhisperModel(config, ctx)

    @classmethod
    def check_config(cls, config) -> None:
        if 80 % config.num_mel_bins:
            raise ValueError(f"config.json: num_mel_bins={config.num_mel_bins} must divide 80 (the 80 FFT bins)")

    @classmethod
    def kv_cache_spec(cls, config) -> KVCacheSpec:
        heads = config.decoder_attention_heads
        return KVCacheSpec(config.decoder_layers, heads, config.d_model // heads)

    @classmethod
    def max_encoder_len(cls, config) -> int:
        return int(config.max_source_positions)

    @classmethod
    def max_decoder_len(cls, config) -> int:
        return int(config.max_target_positions)

    @classmethod
    def get_encoder_inputs(cls, config, token_ids: list[int]) -> EncoderInputs:
        raise ValueError("tone speech takes audio: {'audio': array | path, 'sampling_rate': int}")

    @classmethod
    def get_audio_encoder_inputs(cls, config, audio: Any, sampling_rate: int | None) -> EncoderInputs:
        waveform = _load(audio, sampling_rate)
        n = window_samples(config)
        if waveform.numel() > n:
            raise ValueError(f"audio of {waveform.numel() / SAMPLE_RATE:.2f} s is longer than this model's "
                             f"{n / SAMPLE_RATE:g} s window; use LLM.transcribe")
        return cls.window_inputs(config, waveform)

    @classmethod
    def window_inputs(cls, config, waveform: torch.Tensor) -> EncoderInputs:
        """One window of samples (at most the window), zero-padded: its band energies."""
        padded = torch.zeros(window_samples(config))
        padded[: waveform.numel()] = waveform.float()
        features = band_energies(padded, int(config.num_mel_bins))
        return EncoderInputs(num_positions=int(config.max_source_positions), features=features)

    @classmethod
    def get_default_decoder_prompt(cls, config) -> list[int]:
        return [cls.decoder_start_token_id(config)]

    # -- transcription (tandem.core.transcription.SupportsTranscription) ----------------
    supports_transcription = True
    transcription_tasks = ("transcribe",)
    transcription_sample_rate = SAMPLE_RATE

    @classmethod
    def transcription_languages(cls, ctx: TranscriptionContext) -> tuple[str, ...]:
        return ("en",)

    @classmethod
    def transcription_window_seconds(cls, config) -> float:
        return window_samples(config) / SAMPLE_RATE

    @classmethod
    def check_audio_support(cls) -> None:
        from tandem.audio import require_audio_extra

        require_audio_extra()

    @classmethod
    def load_transcription_audio(cls, source: Any, sampling_rate: int | None = None, *,
                                 max_seconds: float | None = None) -> torch.Tensor:
        return _load(source, sampling_rate, max_seconds)

    @classmethod
    def transcription_session(cls, ctx: TranscriptionContext, options: TranscriptionOptions) -> TranscriptionSession:
        return ToneSpeechSession(cls, ctx, options)

    # -- the forward pass -----------------------------------------------------------
    def forward(self, input_ids, positions, encoder_input_ids, encoder_positions, kv_caches, attn_metadata):
        """``encoder_input_ids``: the band energies ``[G, n_bands, frames]`` of the groups
        whose encoder runs this step, or empty."""
        encoder_hidden = None
        if isinstance(encoder_input_ids, list) or encoder_input_ids.numel():
            encoder_hidden = self.model.encoder(encoder_input_ids, attn_metadata)
        return self.model.decoder(input_ids, positions, encoder_hidden, kv_caches, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.model.decoder.embed_tokens.logits(hidden_states)

    # -- weights (HF Whisper's names) -------------------------------------------------
    def hf_to_tandem_name(self, name: str) -> str | None:
        if name == "proj_out.weight":
            return None  # tied to the token embedding
        if name.startswith(("encoder.", "decoder.")):
            return "model." + name
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        c = self.config
        zeros = torch.zeros(c.d_model)  # Whisper's K projections have no bias: the fused ones get zeros
        k_biases = [(f"model.encoder.layers.{i}.self_attn.k_proj.bias", zeros) for i in range(c.encoder_layers)]
        for i in range(c.decoder_layers):
            k_biases += [(f"model.decoder.layers.{i}.{m}.k_proj.bias", zeros) for m in ("self_attn", "encoder_attn")]
        return load_checkpoint(self, itertools.chain(weights, k_biases))


@dataclass
class _Input:
    waveform: torch.Tensor
    next: int = 0  # the next window's index
    segments: list[dict] = field(default_factory=list)


class ToneSpeechSession(TranscriptionSession):
    """Consecutive windows, each decoded on its own; one segment per window."""

    def __init__(self, model_cls, ctx: TranscriptionContext, options: TranscriptionOptions) -> None:
        o = options
        if o.task not in model_cls.transcription_tasks:
            raise ValueError(f"task={o.task!r}: tone speech only transcribes (task='transcribe')")
        if o.language not in (None, "en", "english"):
            raise ValueError(f"language={o.language!r}: tone speech is English (language='en' or None)")
        unsupported = [name for name, off in (("condition_on_previous_text", False), ("compression_ratio_threshold", None),
                                             ("logprob_threshold", None), ("prompt_ids", ()))
                       if getattr(o, name) != off]
        if unsupported or isinstance(o.sampling.get("temperature"), (list, tuple)):
            raise ValueError(f"tone speech does not support {', '.join(unsupported) or 'a temperature sequence'}")
        self.ctx, self.timestamps = ctx, o.timestamps
        self.model_cls, self.config = model_cls, ctx.hf_config
        self.window = window_samples(ctx.hf_config)
        self.params = SamplingParams(**o.sampling).replace(output_kind=RequestOutputKind.FINAL_ONLY)
        self.eos = ctx.hf_config.eos_token_id

    def start(self, waveform: torch.Tensor) -> _Input:
        if waveform.numel() == 0:
            raise ValueError("the audio has no samples")
        return _Input(waveform)

    def next_window(self, inp: _Input) -> WindowRequest:
        piece = inp.waveform[inp.next * self.window : (inp.next + 1) * self.window]
        prompt = {"encoder_prompt": self.model_cls.window_inputs(self.config, piece),
                  "decoder_prompt": {"prompt_token_ids": self.model_cls.get_default_decoder_prompt(self.config)}}
        return WindowRequest(prompt, self.params)

    def take(self, inp: _Input, out) -> WindowOutcome:
        tokens = list(out.outputs[0].token_ids)
        if tokens and tokens[-1] == self.eos:
            tokens.pop()
        start = inp.next * self.window
        end = min(start + self.window, inp.waveform.numel())
        seg = {"start": start / SAMPLE_RATE, "end": end / SAMPLE_RATE, "text": self._text(tokens), "token_ids": tokens}
        inp.segments.append(seg)
        inp.next += 1
        return WindowOutcome(done=end >= inp.waveform.numel(), segments=[seg])

    def result(self, inp: _Input) -> Transcription:
        tokens = [t for s in inp.segments for t in s["token_ids"]]
        return Transcription(text=self._text(tokens), token_ids=tokens, language="en",
                             segments=list(inp.segments) if self.timestamps else None, windows=inp.next)

    def _text(self, ids: list[int]) -> str:
        tok = self.ctx.tokenizer
        return tok.decode(ids, skip_special_tokens=True).strip() if tok is not None else ""
