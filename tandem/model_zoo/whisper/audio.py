"""Whisper's audio processing: raw audio to 16 kHz waveforms (``tandem.audio``), the
30 s window, and the one function that computes its log-mel features."""

from __future__ import annotations

from typing import Any

import torch

from tandem.model_zoo.whisper.constants import HOP_LENGTH, SAMPLE_RATE, WINDOW_SAMPLES


def load_waveform(source: Any, sampling_rate: int | None = None, *, max_seconds: float | None = None) -> torch.Tensor:
    """A file path, a file's bytes, or samples with their rate as a 16 kHz mono float32
    waveform; ``AudioError`` (a ``ValueError``) names what is wrong."""
    try:
        from tandem.audio import load_audio
    except ImportError as e:
        raise ValueError(f"audio prompts need tandem's audio extra: pip install 'tandem-engine[audio]' ({e})") from e
    return load_audio(source, sampling_rate, max_seconds=max_seconds)


def pad_to_window(waveform: torch.Tensor) -> torch.Tensor:
    """A waveform of at most 30 s, zero-padded to the window, float32."""
    padded = torch.zeros(WINDOW_SAMPLES, dtype=torch.float32)
    padded[: waveform.numel()] = waveform.float()
    return padded


def log_mel(waveforms: torch.Tensor, n_mels: int) -> torch.Tensor:
    """Whisper's log-mel features, HF's ``WhisperFeatureExtractor``: ``[B, N]`` or ``[N]``
    samples -> ``[B, n_mels, N // 160]`` float32 on the waveforms' device, each clip
    floored at its own max. Both paths use it: the encoder on the step's padded 30 s
    windows (batched on the device) and long-form decoding on a whole input once
    (HF's extractor with ``truncation=False``), whose windows are slices of it."""
    from tandem.audio import log_mel_spectrogram

    return log_mel_spectrogram(waveforms.float(), n_mels, any_length=True)


def num_frames(num_samples: int) -> int:
    """Log-mel frames HF's frame-rate attention mask gives an input of ``num_samples``."""
    return -(-num_samples // HOP_LENGTH)


__all__ = ["SAMPLE_RATE", "load_waveform", "log_mel", "num_frames", "pad_to_window"]
