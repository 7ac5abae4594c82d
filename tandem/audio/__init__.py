"""Audio front-end for speech models (Whisper): loading, resampling, log-mel features.

``load_audio`` turns a file or an array into a 16 kHz mono float32 waveform;
``pad_or_trim`` fits it to Whisper's 30-second window; ``log_mel_spectrogram``
computes the features Whisper's encoder takes, equal to transformers'
``WhisperFeatureExtractor``.
"""

from tandem.audio.features import (
    HOP_LENGTH,
    N_FFT,
    N_FRAMES,
    N_SAMPLES,
    SAMPLE_RATE,
    log_mel_spectrogram,
    mel_filter_bank,
    pad_or_trim,
)
from tandem.audio.io import AudioError, AudioTooLongError, load_audio, require_audio_extra

__all__ = [
    "AudioError",
    "AudioTooLongError",
    "HOP_LENGTH",
    "N_FFT",
    "N_FRAMES",
    "N_SAMPLES",
    "SAMPLE_RATE",
    "load_audio",
    "log_mel_spectrogram",
    "mel_filter_bank",
    "pad_or_trim",
    "require_audio_extra",
]
