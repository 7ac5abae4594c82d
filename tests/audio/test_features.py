"""Whisper's log-mel features against transformers' WhisperFeatureExtractor."""

import numpy as np
import pytest
import torch
from transformers import WhisperFeatureExtractor

from tandem.audio import (
    HOP_LENGTH,
    N_FFT,
    N_FRAMES,
    N_SAMPLES,
    SAMPLE_RATE,
    AudioError,
    log_mel_spectrogram,
    mel_filter_bank,
    pad_or_trim,
)
from tandem.audio import features as features_mod

# Tolerance against HF: both sides run a float32 STFT and a float32 matmul, then
# log10 of mel powers spanning ~1e-10..1e2. float32 keeps ~7 digits, so a power P
# carries a relative error of ~1e-6 at worst after the FFT's and the matmul's sums;
# log10 turns that into an absolute error of 1e-6 / ln(10) ~ 4e-7, and the final
# /4 shrinks it further (powers down at 1e-10 are floored at max - 8 anyway). 1e-5
# leaves room for another FFT or BLAS ordering (another CPU, batched vs single
# matmul); on this machine the two agree exactly.
ATOL = 1e-5

LENGTHS_S = (0.5, 7.3, 30.0, 41.0)


def synth(seconds: float, seed: int) -> np.ndarray:
    """A sum of sines plus seeded noise, float32 at 16 kHz."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(round(seconds * SAMPLE_RATE))) / SAMPLE_RATE
    x = 0.3 * np.sin(2 * np.pi * 440.0 * t) + 0.2 * np.sin(2 * np.pi * 1234.5 * t + 0.7)
    x += 0.1 * np.sin(2 * np.pi * 5000.0 * t) + 0.05 * rng.standard_normal(t.size)
    return x.astype(np.float32)


@pytest.fixture(scope="module")
def clips() -> list[np.ndarray]:
    return [synth(s, seed=i) for i, s in enumerate(LENGTHS_S)]


_extractors: dict[int, WhisperFeatureExtractor] = {}


def hf_extractor(n_mels: int) -> WhisperFeatureExtractor:
    if n_mels not in _extractors:
        _extractors[n_mels] = WhisperFeatureExtractor(feature_size=n_mels)
    return _extractors[n_mels]


def hf_features(audio, n_mels: int) -> torch.Tensor:
    # HF's defaults: padding="max_length" to 30 s, truncation=True (a 41 s clip keeps its first 30 s).
    return hf_extractor(n_mels)(audio, sampling_rate=SAMPLE_RATE, return_tensors="pt").input_features


def fit(clip: np.ndarray) -> torch.Tensor:
    return pad_or_trim(torch.from_numpy(clip))


def test_constants():
    assert (SAMPLE_RATE, N_SAMPLES, HOP_LENGTH, N_FFT, N_FRAMES) == (16000, 480000, 160, 400, 3000)


@pytest.mark.parametrize("n_mels", [80, 128])
def test_mel_filter_bank_matches_hf(n_mels):
    ours = mel_filter_bank(n_mels)
    ref = hf_extractor(n_mels).mel_filters  # [n_fft // 2 + 1, n_mels], float64
    assert ours.shape == (N_FFT // 2 + 1, n_mels) == ref.shape
    assert ours.dtype == torch.float32
    np.testing.assert_allclose(ours.numpy(), ref, rtol=0, atol=1e-7)
    # HF casts its float64 bank to float32 before the matmul: the same bits.
    assert np.array_equal(ours.numpy(), ref.astype(np.float32))
    assert (ours.sum(0) > 0).all()  # no empty filter


@pytest.mark.parametrize("n_mels", [80, 128])
def test_features_match_hf_one_clip_at_a_time(clips, n_mels):
    for seconds, clip in zip(LENGTHS_S, clips):
        ours = log_mel_spectrogram(fit(clip), n_mels)
        ref = hf_features(clip, n_mels)
        assert ours.shape == ref.shape == (1, n_mels, N_FRAMES), seconds
        assert ours.dtype == torch.float32
        diff = (ours - ref).abs().max().item()
        assert diff <= ATOL, f"{seconds} s, {n_mels} mels: max abs diff {diff}"


@pytest.mark.parametrize("n_mels", [80, 128])
def test_batch_equals_one_at_a_time_and_hf(clips, n_mels):
    batch = torch.stack([fit(c) for c in clips])
    ours = log_mel_spectrogram(batch, n_mels)
    assert ours.shape == (len(clips), n_mels, N_FRAMES)
    for i, clip in enumerate(clips):
        single = log_mel_spectrogram(fit(clip), n_mels)[0]
        assert (ours[i] - single).abs().max().item() <= 1e-6
        assert (ours[i] - hf_features(clip, n_mels)[0]).abs().max().item() <= ATOL
    # HF's own batched call (it pads every clip to 30 s) agrees too.
    assert (ours - hf_features(list(clips), n_mels)).abs().max().item() <= ATOL


def test_hf_truncates_long_clips_to_30_seconds(clips):
    # What the 41 s comparison above relies on: HF's defaults keep the first 30 s.
    long = clips[-1]
    assert long.size > N_SAMPLES
    assert torch.equal(hf_features(long, 80), hf_features(long[:N_SAMPLES], 80))


def test_floor_is_per_clip_not_per_batch():
    """A loud neighbour must not raise a quiet clip's -80 dB floor, nor silence change anything."""
    loud = fit(synth(5.0, seed=1) * 3.0)
    quiet = fit(synth(5.0, seed=2) * 1e-3)
    silence = torch.zeros(N_SAMPLES)
    batch = log_mel_spectrogram(torch.stack([loud, quiet, silence]), 80)
    for i, clip in enumerate((loud, quiet, silence)):
        ref = hf_features(clip.numpy(), 80)[0]
        assert (batch[i] - ref).abs().max().item() <= ATOL
    # All-zero audio: log10(1e-10) everywhere, (-10 + 4) / 4.
    assert torch.allclose(batch[2], torch.full_like(batch[2], -1.5))


def test_inputs_and_devices():
    clip = fit(synth(3.0, seed=3))
    ref = log_mel_spectrogram(clip, 80)
    # float64 in, float32 out; numpy in; an explicit device.
    assert torch.equal(log_mel_spectrogram(clip.double(), 80), ref)
    assert torch.equal(log_mel_spectrogram(clip.numpy(), 80), ref)
    out = log_mel_spectrogram(clip, 80, device="cpu")
    assert out.device.type == "cpu" and torch.equal(out, ref)
    # The filters are made once per (n_mels, device).
    cpu = torch.device("cpu")
    assert features_mod._cached_filters(80, cpu) is features_mod._cached_filters(80, cpu)
    assert features_mod._cached_filters(128, cpu).shape == (128, N_FFT // 2 + 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_cpu():
    clips = [fit(synth(s, seed=i)) for i, s in enumerate((2.0, 12.0))]
    batch = torch.stack(clips)
    cpu = log_mel_spectrogram(batch, 128)
    gpu = log_mel_spectrogram(batch, 128, device="cuda")
    assert gpu.is_cuda
    assert torch.equal(log_mel_spectrogram(batch.cuda(), 128).cpu(), gpu.cpu())
    # cuFFT and cuBLAS sum in other orders; TF32 is off by default for matmul in float32.
    assert (gpu.cpu() - cpu).abs().max().item() <= 1e-4


def test_log_mel_errors():
    with pytest.raises(AudioError, match=r"\(16000,\)"):
        log_mel_spectrogram(torch.zeros(16000), 80)
    with pytest.raises(AudioError, match=r"\(2, 3, 480000\)"):
        log_mel_spectrogram(torch.zeros(2, 3, N_SAMPLES), 80)
    with pytest.raises(AudioError, match="int16"):
        log_mel_spectrogram(torch.zeros(N_SAMPLES, dtype=torch.int16), 80)
    with pytest.raises(AudioError, match="n_mels.*0"):
        log_mel_spectrogram(torch.zeros(N_SAMPLES), 0)


def test_pad_or_trim():
    x = torch.arange(1, 11, dtype=torch.float32)
    padded = pad_or_trim(x, 15)
    assert padded.shape == (15,) and torch.equal(padded[:10], x) and not padded[10:].any()
    assert torch.equal(pad_or_trim(x, 4), x[:4])
    assert pad_or_trim(x, 10) is x
    batch = torch.ones(3, 2, 7)
    assert pad_or_trim(batch, 9).shape == (3, 2, 9)
    assert pad_or_trim(batch, 5).shape == (3, 2, 5)
    assert pad_or_trim(torch.ones(100)).shape == (N_SAMPLES,)
    with pytest.raises(AudioError, match="length.*-1"):
        pad_or_trim(x, -1)
