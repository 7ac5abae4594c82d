"""The tone-speech processor: a window of 16 kHz samples -> log band energies.

Each 10 ms frame (160 samples, no overlap) is Fourier-transformed; its power
spectrum's bins 1..80 (100 Hz .. 8 kHz) are averaged in ``n_bands`` equal groups,
and the energies go on a log10 scale, clamped at 1e-10: ``[n_bands, frames]``.
"""

from __future__ import annotations

import torch

SAMPLE_RATE = 16000
HOP = 160  # samples per frame


def window_samples(config) -> int:
    """Samples in one window: two frames per encoder position."""
    return 2 * int(config.max_source_positions) * HOP


def band_energies(window: torch.Tensor, n_bands: int) -> torch.Tensor:
    """``[samples]`` (a whole number of frames) -> ``[n_bands, frames]`` float32."""
    frames = window.float().reshape(-1, HOP)  # [frames, 160]
    power = torch.fft.rfft(frames, dim=-1).abs() ** 2  # [frames, 81]
    bands = power[:, 1:81].reshape(frames.shape[0], n_bands, -1).mean(dim=-1)  # [frames, n_bands]
    return torch.clamp(bands, min=1e-10).log10().T.contiguous()
