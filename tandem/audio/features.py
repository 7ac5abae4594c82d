"""Whisper's log-mel features, in torch, equal to transformers' ``WhisperFeatureExtractor``.

The steps are those of the extractor's torch path (``_torch_extract_fbank_features``):
a centred, reflect-padded STFT with a periodic Hann window of 400 samples and a hop
of 160, power spectrum, the last frame dropped, a Slaney mel filter bank,
``log10`` clamped at 1e-10, a floor 8 (i.e. 80 dB) below each clip's maximum, and
``(x + 4) / 4``. The floor is taken per clip, as the extractor does for a batch,
so batching never changes a clip's features.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from tandem.audio.io import SAMPLE_RATE, AudioError

N_FFT = 400
HOP_LENGTH = 160
CHUNK_LENGTH = 30  # seconds
N_SAMPLES = CHUNK_LENGTH * SAMPLE_RATE  # 480000
N_FRAMES = N_SAMPLES // HOP_LENGTH  # 3000

# Whisper's filter bank spans 0..8 kHz whatever the rate (as transformers builds it).
_F_MIN = 0.0
_F_MAX = 8000.0


def _hz_to_mel(hz: np.ndarray) -> np.ndarray:
    """Slaney's mel scale: linear below 1 kHz (3 mels per 200 Hz), logarithmic above."""
    hz = np.atleast_1d(np.asarray(hz, dtype=np.float64))
    mel = 3.0 * hz / 200.0
    log_region = hz >= 1000.0
    mel[log_region] = 15.0 + np.log(hz[log_region] / 1000.0) * (27.0 / np.log(6.4))
    return mel


def _mel_to_hz(mel: np.ndarray) -> np.ndarray:
    mel = np.atleast_1d(np.asarray(mel, dtype=np.float64))
    hz = 200.0 * mel / 3.0
    log_region = mel >= 15.0
    hz[log_region] = 1000.0 * np.exp((np.log(6.4) / 27.0) * (mel[log_region] - 15.0))
    return hz


def _check_positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise AudioError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def mel_filter_bank(n_mels: int, n_fft: int = N_FFT, sampling_rate: int = SAMPLE_RATE) -> torch.Tensor:
    """The Slaney-normalised Slaney-scale mel filter bank Whisper uses, ``[n_fft//2 + 1, n_mels]`` float32.

    Triangles centred on ``n_mels + 2`` points evenly spaced in mel between 0 Hz and
    8 kHz, evaluated at the FFT bins' frequencies, each scaled by ``2 / bandwidth`` so
    every filter has about the same area. Computed in float64, then cast.
    """
    n_mels = _check_positive_int("n_mels", n_mels)
    n_fft = _check_positive_int("n_fft", n_fft)
    sampling_rate = _check_positive_int("sampling_rate", sampling_rate)
    n_bins = n_fft // 2 + 1
    if n_bins < 2:
        raise AudioError(f"n_fft must be at least 2, got {n_fft}")

    mel_points = np.linspace(_hz_to_mel(_F_MIN)[0], _hz_to_mel(_F_MAX)[0], n_mels + 2)
    hz_points = _mel_to_hz(mel_points)  # [n_mels + 2]: lower edge, centre, upper edge of each filter
    bin_hz = np.linspace(0, sampling_rate // 2, n_bins)  # [n_bins]

    # offsets[f, k] = hz_points[k] - bin_hz[f]
    offsets = hz_points[None, :] - bin_hz[:, None]
    widths = np.diff(hz_points)
    rising = -offsets[:, :-2] / widths[:-1]  # 0 at the lower edge, 1 at the centre
    falling = offsets[:, 2:] / widths[1:]  # 1 at the centre, 0 at the upper edge
    filters = np.maximum(0.0, np.minimum(rising, falling))
    filters *= (2.0 / (hz_points[2:] - hz_points[:-2]))[None, :]
    return torch.from_numpy(filters.astype(np.float32))


_cache_lock = threading.Lock()
_filters_cache: dict[tuple[int, str], torch.Tensor] = {}
_window_cache: dict[str, torch.Tensor] = {}


def _device_key(device: torch.device) -> str:
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return str(device)


def _cached_filters(n_mels: int, device: torch.device) -> torch.Tensor:
    """``mel_filter_bank(n_mels).T`` on ``device``, ``[n_mels, 201]``, made once per (n_mels, device)."""
    key = (n_mels, _device_key(device))
    filters = _filters_cache.get(key)
    if filters is None:
        with _cache_lock:
            filters = _filters_cache.get(key)
            if filters is None:
                filters = mel_filter_bank(n_mels).T.contiguous().to(device)
                _filters_cache[key] = filters
    return filters


def _cached_window(device: torch.device) -> torch.Tensor:
    key = _device_key(device)
    window = _window_cache.get(key)
    if window is None:
        with _cache_lock:
            window = _window_cache.get(key)
            if window is None:
                window = torch.hann_window(N_FFT, device=device)
                _window_cache[key] = window
    return window


def pad_or_trim(waveform: torch.Tensor, length: int = N_SAMPLES) -> torch.Tensor:
    """Fit the last dimension to ``length``: zeros appended at the end, or the tail cut off."""
    length = _check_positive_int("length", length)
    if not isinstance(waveform, torch.Tensor):
        waveform = torch.as_tensor(np.asarray(waveform))
    if waveform.dim() == 0:
        raise AudioError("pad_or_trim needs at least 1 dimension, got a 0-d tensor")
    n = waveform.shape[-1]
    if n > length:
        return waveform[..., :length]
    if n < length:
        return torch.nn.functional.pad(waveform, (0, length - n))
    return waveform


def log_mel_spectrogram(
    waveforms: torch.Tensor, n_mels: int, device: torch.device | str | None = None, *, any_length: bool = False
) -> torch.Tensor:
    """Whisper's log-mel features of 30-second 16 kHz clips.

    ``waveforms`` is ``[B, N_SAMPLES]`` or ``[N_SAMPLES]`` (fit clips with
    :func:`pad_or_trim` first). The work runs on ``device`` (default: where the
    waveforms are). Returns ``[B, n_mels, N_FRAMES]`` float32 on that device
    (``B = 1`` for a 1-D input). ``any_length=True`` takes clips of any length
    (long-form audio, as HF's extractor with ``truncation=False``): ``N // 160``
    frames, floored at the whole clip's max - 8.
    """
    n_mels = _check_positive_int("n_mels", n_mels)
    if not isinstance(waveforms, torch.Tensor):
        waveforms = torch.as_tensor(np.asarray(waveforms))
    if not waveforms.is_floating_point():
        raise AudioError(
            f"waveforms must be float samples in [-1, 1], got dtype {waveforms.dtype}; "
            "load_audio converts integer PCM"
        )
    if waveforms.dim() not in (1, 2) or (waveforms.shape[-1] != N_SAMPLES and not any_length) or waveforms.shape[-1] < 2:
        raise AudioError(
            f"waveforms must be [B, {N_SAMPLES}] or [{N_SAMPLES}] (30 s at {SAMPLE_RATE} Hz), "
            f"got shape {tuple(waveforms.shape)}; fit clips with pad_or_trim first"
        )
    if waveforms.dim() == 1:
        waveforms = waveforms.unsqueeze(0)
    device = torch.device(device) if device is not None else waveforms.device
    x = waveforms.to(device=device, dtype=torch.float32)

    stft = torch.stft(
        x,
        N_FFT,
        HOP_LENGTH,
        window=_cached_window(device),
        center=True,
        pad_mode="reflect",
        return_complex=True,
    )  # [B, 201, N_FRAMES + 1]
    power = (stft[..., :-1].abs() ** 2).contiguous()  # the last frame dropped, as Whisper does
    mel = _cached_filters(n_mels, device) @ power  # [B, n_mels, N_FRAMES]
    log_spec = torch.clamp(mel, min=1e-10).log10()
    clip_max = log_spec.amax(dim=(1, 2), keepdim=True)  # per clip, never across the batch
    log_spec = torch.maximum(log_spec, clip_max - 8.0)
    return (log_spec + 4.0) / 4.0
