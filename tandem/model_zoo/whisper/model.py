"""Whisper: audio in, text out, on the same scheduler, block manager and backends as BART.

The encoder input is audio: ``get_audio_encoder_inputs`` reads an audio prompt
and pads its 16 kHz waveform to the 30 s window, and the model computes its
log-mel features on the engine's device, batched over the groups whose encoder
runs this step (``audio.log_mel``, equal to HF's ``WhisperFeatureExtractor``).
Then two convolutions (the second with stride 2: 3000 frames -> 1500
positions), fixed sinusoidal positions and pre-LN transformer layers. The
1500 encoder positions are the request's cross-attention length; the decoder
(learned positions, pre-LN layers, output projection tied to the token
embedding) reads them from the paged cross cache after the encoder's step.

Layers are BART's (``BartEncoderLayer`` / ``BartDecoderLayer`` with pre-LN);
Whisper's K projections have no bias, so the fused projections get a zero one.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from tandem.core.attention import AttentionMetadata
from tandem.core.inputs import EncoderInputs, PromptSlot
from tandem.core.layers import VocabParallelEmbedding
from tandem.core.model import EncoderDecoderModel, KVCacheSpec, ModelContext
from tandem.core.transcription import (
    AudioTooLongError,
    TranscriptionContext,
    TranscriptionOptions,
    TranscriptionSession,
)
from tandem.core.weight_loading import load_checkpoint
from tandem.model_zoo.bart import BartDecoderLayer, BartEncoderLayer, BartVariant
from tandem.model_zoo.whisper.audio import load_waveform, log_mel, pad_to_window
from tandem.model_zoo.whisper.constants import SAMPLE_RATE, TASKS, WINDOW_SAMPLES, WINDOW_SECONDS
from tandem.model_zoo.whisper.prompts import WhisperPrompts

PRE_LN = BartVariant(normalize_before=True, layernorm_embedding=False, final_layer_norm=True, position_offset=0)


class WhisperEncoder(nn.Module):
    def __init__(self, config, ctx: ModelContext) -> None:
        super().__init__()
        d = config.d_model
        self.num_mel_bins = config.num_mel_bins
        self.conv1 = nn.Conv1d(config.num_mel_bins, d, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(d, d, kernel_size=3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(config.max_source_positions, d)
        self.layers = nn.ModuleList(BartEncoderLayer(config, PRE_LN, ctx) for _ in range(config.encoder_layers))
        self.layer_norm = nn.LayerNorm(d)

    def features(self, inputs) -> torch.Tensor:
        """Log-mel ``[G, n_mels, 3000]`` from the groups' inputs: padded waveforms
        ``[G, 480000]`` (the log-mel computed here, batched on the device), ready
        log-mel windows ``[G, n_mels, 3000]`` (long-form), or a list mixing both."""
        if isinstance(inputs, list):
            return torch.cat([self.features(x.unsqueeze(0)) for x in inputs])
        if inputs.dim() == 2:
            return log_mel(inputs, self.num_mel_bins)
        return inputs.float()

    def forward(self, inputs, attn_metadata: AttentionMetadata) -> torch.Tensor:
        """The groups' inputs (see :meth:`features`) -> packed ``[G * 1500, d]`` hidden states."""
        features = self.features(inputs).to(self.conv1.weight.dtype)
        h = nn.functional.gelu(self.conv1(features))
        h = nn.functional.gelu(self.conv2(h))  # [G, d, 1500]
        g, d, n = h.shape
        # The positions added while transposing to [G, 1500, d], written once in token-major
        # order (h.transpose(1, 2) + pos would keep h's channel-major strides, and the
        # reshape below would then copy it again).
        pos = self.embed_positions.weight[:n]
        if torch.is_grad_enabled():  # out= has no autograd; the engine runs in inference mode
            h = (h.transpose(1, 2) + pos).contiguous()
        else:
            h = torch.add(h.transpose(1, 2), pos, out=h.new_empty(g, n, d))
        h = h.view(-1, d)
        for layer in self.layers:
            h = layer(h, attn_metadata)
        return self.layer_norm(h)


class WhisperDecoder(nn.Module):
    def __init__(self, config, ctx: ModelContext) -> None:
        super().__init__()
        d = config.d_model
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, d)
        self.embed_positions = nn.Embedding(config.max_target_positions, d)
        self.layers = nn.ModuleList(BartDecoderLayer(config, PRE_LN, ctx) for _ in range(config.decoder_layers))
        self.layer_norm = nn.LayerNorm(d)

    def forward(self, input_ids, positions, encoder_hidden, kv_caches, attn_metadata) -> torch.Tensor:
        h = self.embed_tokens(input_ids) + self.embed_positions(positions)
        for layer, kv_cache in zip(self.layers, kv_caches):
            h = layer(h, encoder_hidden, kv_cache, attn_metadata)
        return self.layer_norm(h)


class WhisperModel(nn.Module):
    def __init__(self, config, ctx: ModelContext) -> None:
        super().__init__()
        self.encoder = WhisperEncoder(config, ctx)
        self.decoder = WhisperDecoder(config, ctx)


class WhisperForConditionalGeneration(EncoderDecoderModel):
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "kv_proj": ["k_proj", "v_proj"]}
    model_calls = ("alignment_attention", "next_token_logits")  # word timestamps, no-speech
    tensor_parallel_fields = ("encoder_attention_heads", "decoder_attention_heads", "encoder_ffn_dim", "decoder_ffn_dim")
    config_size_fields = (
        "d_model", "encoder_layers", "decoder_layers", "encoder_attention_heads", "decoder_attention_heads",
        "encoder_ffn_dim", "decoder_ffn_dim", "vocab_size", "num_mel_bins", "max_source_positions",
        "max_target_positions",
    )

    def __init__(self, config, ctx: ModelContext) -> None:
        super().__init__(config, ctx)
        self.model = WhisperModel(config, ctx)

    # -- what requests are checked against ---------------------------------------
    @classmethod
    def kv_cache_spec(cls, config) -> KVCacheSpec:
        heads = config.decoder_attention_heads
        return KVCacheSpec(config.decoder_layers, heads, config.d_model // heads)

    @classmethod
    def check_config(cls, config) -> None:
        cls.check_size_fields(config)
        for field in ("encoder_attention_heads", "decoder_attention_heads"):
            if config.d_model % getattr(config, field):
                raise ValueError(
                    f"config.json: d_model={config.d_model} is not divisible by {field}={getattr(config, field)}"
                )
        if config.num_mel_bins not in (80, 128):
            raise ValueError(f"config.json: num_mel_bins={config.num_mel_bins} (Whisper uses 80 or 128)")
        if config.max_source_positions * 2 != WINDOW_SAMPLES // 160:
            raise ValueError(
                f"config.json: max_source_positions={config.max_source_positions}; the 30 s window gives "
                f"{WINDOW_SAMPLES // 160} frames, so it must be {WINDOW_SAMPLES // 320}"
            )

    @classmethod
    def num_parameters(cls, config) -> int:
        d, v = config.d_model, config.vocab_size
        attn = 4 * d * d + 3 * d  # q, v, out with bias; k without
        norm = 2 * d

        def ffn(f: int) -> int:
            return d * f + f + f * d + d

        encoder = 3 * config.num_mel_bins * d + d + 3 * d * d + d + config.max_source_positions * d
        encoder += config.encoder_layers * (attn + ffn(config.encoder_ffn_dim) + 2 * norm) + norm
        decoder = v * d + config.max_target_positions * d
        decoder += config.decoder_layers * (2 * attn + ffn(config.decoder_ffn_dim) + 3 * norm) + norm
        return encoder + decoder

    @classmethod
    def max_encoder_len(cls, config) -> int:
        return int(config.max_source_positions)

    @classmethod
    def max_decoder_len(cls, config) -> int:
        return int(config.max_target_positions)

    @classmethod
    def get_encoder_inputs(cls, config, token_ids: list[int]) -> EncoderInputs:
        raise ValueError(
            "Whisper's encoder prompt is audio: {'audio': array | tensor | path, 'sampling_rate': int} "
            "(text or token ids go in the decoder prompt)"
        )

    @classmethod
    def get_audio_encoder_inputs(cls, config, audio: Any, sampling_rate: int | None) -> EncoderInputs:
        """Audio of at most 30 s (read, mixed down and resampled to 16 kHz by
        ``tandem.audio.load_audio``), padded to the window; the log-mel runs in the encoder.
        A file longer than the window is refused from its header (or once decoding
        passes the window), never decoded whole."""
        try:
            waveform = load_waveform(audio, sampling_rate, max_seconds=WINDOW_SECONDS)
        except AudioTooLongError as e:
            raise ValueError(f"{e}: longer than Whisper's 30 s window; use LLM.transcribe for long-form audio") from None
        if waveform.numel() > WINDOW_SAMPLES:
            raise ValueError(
                f"audio of {waveform.numel() / SAMPLE_RATE:.2f} s is longer than Whisper's 30 s window; "
                "use LLM.transcribe for long-form audio"
            )
        return EncoderInputs(num_positions=int(config.max_source_positions), features=pad_to_window(waveform))

    @classmethod
    def get_default_decoder_prompt(cls, config) -> list[int]:
        """``<|startoftranscript|>``; see :meth:`default_decoder_prompt`."""
        return [cls.decoder_start_token_id(config)]

    @classmethod
    def default_decoder_prompt(cls, config, generation_config) -> tuple[list[int], PromptSlot | None]:
        """The prompt HF ``generate`` builds for audio given no decoder prompt and no
        arguments: ``<|startoftranscript|>``, the language (detected, a prompt slot, on
        multilingual checkpoints unless the generation config sets one), the task its
        ``task`` or ``forced_decoder_ids`` give, ``<|notimestamps|>``
        (``WhisperPrompts.default_prompt``)."""
        if generation_config is None:
            return cls.get_default_decoder_prompt(config), None
        return WhisperPrompts.from_generation_config(generation_config, config).default_prompt(generation_config, config)

    @classmethod
    def non_text_token_ids(cls, config, generation_config) -> range:
        """The timestamp tokens: HF's Whisper tokenizer leaves them out of decoded text
        (unless asked for ``decode_with_timestamps``); they stay in ``token_ids``."""
        no_timestamps = getattr(generation_config, "no_timestamps_token_id", None)
        if no_timestamps is None:
            return range(0)
        return range(int(no_timestamps) + 1, cls.vocab_size(config))

    @classmethod
    def process_decoder_prompt(cls, config, token_ids: list[int]) -> list[int]:
        """An explicit decoder prompt is used as given (it may open with
        ``<|startofprev|>`` and previous text before ``<|startoftranscript|>``)."""
        return list(token_ids) if token_ids else cls.get_default_decoder_prompt(config)

    # -- transcription (tandem.core.transcription.SupportsTranscription) ----------------
    supports_transcription = True
    transcription_tasks = TASKS
    transcription_sample_rate = SAMPLE_RATE

    @classmethod
    def transcription_languages(cls, ctx: TranscriptionContext) -> tuple[str, ...]:
        return WhisperPrompts.from_generation_config(ctx.generation_config, ctx.hf_config).languages()

    @classmethod
    def transcription_window_seconds(cls, config) -> float:
        return float(WINDOW_SECONDS)

    @classmethod
    def check_audio_support(cls) -> None:
        from tandem.audio import require_audio_extra

        require_audio_extra()

    @classmethod
    def load_transcription_audio(cls, source: Any, sampling_rate: int | None = None, *,
                                 max_seconds: float | None = None) -> torch.Tensor:
        return load_waveform(source, sampling_rate, max_seconds=max_seconds)

    @classmethod
    def transcription_session(cls, ctx: TranscriptionContext, options: TranscriptionOptions) -> TranscriptionSession:
        from tandem.model_zoo.whisper.transcription import WhisperTranscription

        return WhisperTranscription(cls, ctx, options)

    # -- the forward pass -----------------------------------------------------------
    def forward(self, input_ids, positions, encoder_input_ids, encoder_positions, kv_caches, attn_metadata):
        """``encoder_input_ids`` holds the audio inputs of the groups whose encoder runs
        (padded waveforms or log-mel windows, see :meth:`WhisperEncoder.features`), or is empty."""
        encoder_hidden = None
        if isinstance(encoder_input_ids, list) or encoder_input_ids.numel():
            encoder_hidden = self.model.encoder(encoder_input_ids, attn_metadata)
        return self.model.decoder(input_ids, positions, encoder_hidden, kv_caches, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.model.decoder.embed_tokens.logits(hidden_states)

    def alignment_attention(self, inputs: torch.Tensor, token_ids: list[int], heads: list[tuple[int, int]],
                            first_row: int) -> torch.Tensor:
        """The ``(layer, head)`` pairs' cross-attention probabilities ``[len(heads),
        len(token_ids) - first_row, 1500]`` for one window (``inputs``: its encoder
        input, a padded waveform or a log-mel window), recomputed densely
        (``tandem/model_zoo/whisper/cross_attention.py``)."""
        from tandem.model_zoo.whisper.cross_attention import alignment_attention

        return alignment_attention(self, inputs, token_ids, heads, first_row)

    def next_token_logits(self, inputs: torch.Tensor, token_ids: list[int]) -> torch.Tensor:
        """The raw logits ``[vocab]`` after ``token_ids`` for one window, recomputed densely
        (``tandem/model_zoo/whisper/cross_attention.py``)."""
        from tandem.model_zoo.whisper.cross_attention import next_token_logits

        return next_token_logits(self, inputs, token_ids)

    # -- weights --------------------------------------------------------------------
    def hf_to_tandem_name(self, name: str) -> str | None:
        if name == "proj_out.weight":
            return None  # tied to the token embedding
        if name.startswith(("encoder.", "decoder.")):
            return "model." + name
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_checkpoint(self, itertools.chain(weights, self._zero_k_biases()))

    def _zero_k_biases(self):
        """Whisper's K projections have no bias; the fused projections' K shard gets zeros."""
        c = self.config
        zeros = torch.zeros(c.d_model)
        for i in range(c.encoder_layers):
            yield f"model.encoder.layers.{i}.self_attn.k_proj.bias", zeros
        for i in range(c.decoder_layers):
            yield f"model.decoder.layers.{i}.self_attn.k_proj.bias", zeros
            yield f"model.decoder.layers.{i}.encoder_attn.k_proj.bias", zeros
