"""load_audio: files written with soundfile, arrays, resampling, mix-down, and every error."""

import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch

from tandem.audio import SAMPLE_RATE, AudioError, load_audio

FORMATS = {  # extension: (soundfile format, subtype)
    "wav": ("WAV", "PCM_16"),
    "flac": ("FLAC", "PCM_24"),
    "ogg": ("OGG", "VORBIS"),
}


def sine(freq: float, rate: int, seconds: float, amp: float = 0.5, phase: float = 0.0) -> np.ndarray:
    t = np.arange(int(round(seconds * rate))) / rate
    return (amp * np.sin(2 * np.pi * freq * t + phase)).astype(np.float32)


def dominant_hz(x: np.ndarray, rate: int = SAMPLE_RATE) -> float:
    spectrum = np.abs(np.fft.rfft(x * np.hanning(x.size)))
    return float(np.argmax(spectrum)) * rate / x.size


def amplitude(x: np.ndarray) -> float:
    """A sine's amplitude from its RMS, away from the resampler's edge transients."""
    mid = x[x.size // 10 : -x.size // 10]
    return float(np.sqrt(2.0 * np.mean(mid.astype(np.float64) ** 2)))


@pytest.mark.parametrize("ext", list(FORMATS))
@pytest.mark.parametrize("rate", [8000, 16000, 44100, 48000])
@pytest.mark.parametrize("channels", [1, 2])
def test_files_load_at_16k_mono(tmp_path, ext, rate, channels):
    seconds = 1.25
    left = sine(440.0, rate, seconds)
    data = left if channels == 1 else np.stack([left, sine(880.0, rate, seconds, amp=0.25)], axis=1)
    path = tmp_path / f"clip.{ext}"
    fmt, subtype = FORMATS[ext]
    sf.write(path, data, rate, format=fmt, subtype=subtype)

    for source in (path, str(path)):
        y = load_audio(source)
        assert isinstance(y, torch.Tensor)
        assert y.dtype == torch.float32 and y.dim() == 1 and y.device.type == "cpu"
        assert abs(y.numel() - seconds * SAMPLE_RATE) <= 4, (ext, rate, channels, y.numel())
        assert torch.isfinite(y).all()
        assert abs(dominant_hz(y.numpy()) - 440.0) <= 2.0
    # The same file handed over as bytes.
    assert torch.equal(load_audio(path.read_bytes()), y)


@pytest.mark.parametrize("rate", [16000, 48000])
def test_stereo_is_the_channel_mean(tmp_path, rate):
    rng = np.random.default_rng(0)
    n = rate  # 1 s
    left = sine(440.0, rate, 1.0, amp=0.6)
    right = (0.2 * rng.standard_normal(n)).astype(np.float32) - 0.1  # unlike the left, with an offset
    path = tmp_path / "stereo.wav"
    sf.write(path, np.stack([left, right], axis=1), rate, subtype="FLOAT")

    y = load_audio(path)
    mean = (left.astype(np.float64) + right) / 2
    if rate == SAMPLE_RATE:  # no resampling: exactly the mean
        np.testing.assert_allclose(y.numpy(), mean, rtol=0, atol=1e-7)
    else:  # mixed, then resampled as a mono array would be
        np.testing.assert_allclose(y.numpy(), load_audio(mean.astype(np.float32), rate).numpy(), atol=1e-6)
    # Neither channel alone.
    assert not np.allclose(y.numpy()[: rate // 4], load_audio(left, rate).numpy()[: rate // 4], atol=1e-2)


def test_arrays_either_channel_layout_and_torch():
    rate = 22050
    stereo = np.stack([sine(300.0, rate, 0.5), sine(700.0, rate, 0.5, amp=0.2)])  # [2, samples]
    a = load_audio(stereo, rate)
    b = load_audio(stereo.T.copy(), rate)  # [samples, 2]
    c = load_audio(torch.from_numpy(stereo), rate)
    d = load_audio(stereo.mean(axis=0), rate)
    assert torch.equal(a, b) and torch.equal(a, c)
    assert (a - d).abs().max().item() <= 1e-6
    # float64 and half-precision tensors become float32; [1, N] and [N, 1] are mono.
    mono = sine(440.0, SAMPLE_RATE, 0.25)
    assert load_audio(torch.from_numpy(mono).double(), SAMPLE_RATE).dtype == torch.float32
    assert torch.equal(load_audio(mono[None, :], SAMPLE_RATE), torch.from_numpy(mono))
    assert torch.equal(load_audio(mono[:, None], SAMPLE_RATE), torch.from_numpy(mono))
    assert load_audio(torch.from_numpy(mono).bfloat16(), SAMPLE_RATE).dtype == torch.float32
    assert load_audio(mono, np.int64(SAMPLE_RATE)).numel() == mono.size


def test_resampling_is_a_real_resampler():
    # A 1 kHz sine at 44.1 kHz stays a 1 kHz sine of the same amplitude at 16 kHz.
    x = sine(1000.0, 44100, 2.0, amp=0.5)
    y = load_audio(x, sampling_rate=44100).numpy()
    assert abs(y.size - 32000) <= 2
    spectrum = np.abs(np.fft.rfft(y))
    assert float(np.argmax(spectrum)) * SAMPLE_RATE / y.size == pytest.approx(1000.0, abs=0.5)
    assert amplitude(y) == pytest.approx(0.5, rel=0.01)
    # A 12 kHz tone is above the new Nyquist (8 kHz): a low-pass resampler removes
    # it, where picking samples would fold it down to 4 kHz at full strength.
    high = load_audio(sine(12000.0, 44100, 2.0, amp=0.5), sampling_rate=44100).numpy()
    assert amplitude(high) < 0.005


def test_integer_pcm_scales_like_soundfile(tmp_path):
    pcm = np.array([-32768, -16384, 0, 16384, 32767], dtype=np.int16)
    y = load_audio(pcm, SAMPLE_RATE)
    np.testing.assert_array_equal(y.numpy(), pcm.astype(np.float32) / 32768)
    assert y.min().item() == -1.0 and y.max().item() < 1.0
    # The same samples through a PCM_16 WAV file and soundfile's float read.
    path = tmp_path / "pcm.wav"
    sf.write(path, pcm, SAMPLE_RATE, subtype="PCM_16")
    assert torch.equal(load_audio(path), y)
    assert torch.equal(load_audio(torch.from_numpy(pcm), SAMPLE_RATE), y)

    np.testing.assert_array_equal(
        load_audio(np.array([-(2**31), 0, 2**30], dtype=np.int32), SAMPLE_RATE).numpy(), [-1.0, 0.0, 0.5]
    )
    np.testing.assert_array_equal(
        load_audio(np.array([0, 128, 192], dtype=np.uint8), SAMPLE_RATE).numpy(), [-1.0, 0.0, 0.5]
    )
    # Integer stereo: scaled, then averaged.
    stereo16 = np.array([[16384, -16384, 8192], [0, 16384, 8192]], dtype=np.int16)  # [channels, samples]
    np.testing.assert_array_equal(load_audio(stereo16, SAMPLE_RATE).numpy(), [0.25, 0.0, 0.25])


def test_mp3_if_libsndfile_has_it(tmp_path):
    if "MP3" not in sf.available_formats():
        pytest.skip("this libsndfile has no MP3")
    path = tmp_path / "clip.mp3"
    sf.write(path, sine(1000.0, 44100, 1.0), 44100, format="MP3")
    y = load_audio(path).numpy()
    assert abs(y.size - SAMPLE_RATE) <= 1200  # MP3 frames: about a frame of slack
    assert abs(dominant_hz(y) - 1000.0) <= 2.0


# ------------------------------------------------------------------ errors


def test_missing_file_names_the_path(tmp_path):
    path = tmp_path / "nowhere" / "missing.wav"
    for source in (path, str(path)):
        with pytest.raises(AudioError, match="no such file") as e:
            load_audio(source)
        assert str(path) in str(e.value)
    with pytest.raises(AudioError, match="not a file") as e:
        load_audio(tmp_path)
    assert str(tmp_path) in str(e.value)


def test_text_file_renamed_wav_is_unreadable(tmp_path, monkeypatch):
    path = tmp_path / "notes.wav"
    path.write_text("this is not audio\n" * 20)
    monkeypatch.setitem(sys.modules, "av", None)  # PyAV absent, whether installed or not
    with pytest.raises(AudioError, match="unreadable") as e:
        load_audio(path)
    assert str(path) in str(e.value)
    assert "pip install av" in str(e.value)
    with pytest.raises(AudioError, match="unreadable"):
        load_audio(b"RIFF but not really")


def test_nan_in_a_float_file(tmp_path):
    data = sine(440.0, SAMPLE_RATE, 0.1)
    data[[3, 50]] = np.nan
    path = tmp_path / "nan.wav"
    sf.write(path, data, SAMPLE_RATE, subtype="FLOAT")
    with pytest.raises(AudioError, match=r"2 non-finite samples \(2 NaN, 0 inf\)") as e:
        load_audio(path)
    assert str(path) in str(e.value)


def test_truncated_file_is_unreadable(tmp_path, monkeypatch):
    path = tmp_path / "cut.flac"
    sf.write(path, sine(440.0, SAMPLE_RATE, 0.5), SAMPLE_RATE)
    path.write_bytes(path.read_bytes()[:20])
    monkeypatch.setitem(sys.modules, "av", None)
    with pytest.raises(AudioError, match="unreadable") as e:
        load_audio(path)
    assert str(path) in str(e.value)


def test_non_finite_samples_are_counted():
    x = np.zeros(100, dtype=np.float32)
    x[[1, 2, 3]] = np.nan
    x[7] = np.inf
    x[8] = -np.inf
    with pytest.raises(AudioError, match=r"5 non-finite samples \(3 NaN, 2 inf\) out of 100"):
        load_audio(x, SAMPLE_RATE)
    with pytest.raises(AudioError, match="1 non-finite"):
        load_audio(torch.tensor([0.0, float("nan")]), SAMPLE_RATE)


@pytest.mark.parametrize("empty", [np.zeros(0, np.float32), np.zeros((2, 0)), torch.zeros(0)])
def test_empty_audio(empty):
    with pytest.raises(AudioError, match="empty audio: 0 samples"):
        load_audio(empty, SAMPLE_RATE)


def test_empty_file(tmp_path):
    path = tmp_path / "empty.wav"
    sf.write(path, np.zeros(0, np.float32), SAMPLE_RATE)
    with pytest.raises(AudioError, match="empty audio") as e:
        load_audio(path)
    assert str(path) in str(e.value)


@pytest.mark.parametrize("rate", [0, -16000, 999, 384001, 16000.0, "16000", True])
def test_bad_sampling_rate_is_named(rate):
    with pytest.raises(AudioError, match="sampling_rate") as e:
        load_audio(np.zeros(100, np.float32), rate)
    assert repr(rate) in str(e.value) or str(rate) in str(e.value)


def test_sampling_rate_required_for_arrays():
    for x in (np.zeros(100, np.float32), torch.zeros(100)):
        with pytest.raises(AudioError, match="sampling_rate is required.*\\(100,\\)"):
            load_audio(x)


def test_file_rate_must_agree(tmp_path):
    path = tmp_path / "a.wav"
    sf.write(path, sine(440.0, 8000, 0.1), 8000)
    assert load_audio(path, 8000).numel() == 1600  # 0.1 s, resampled to 16 kHz
    with pytest.raises(AudioError, match="8000 Hz.*sampling_rate=16000") as e:
        load_audio(path, 16000)
    assert str(path) in str(e.value)


@pytest.mark.parametrize(
    "shape, pattern",
    [((2, 3, 100), r"3 dims.*\(2, 3, 100\)"), ((20, 30), r"\(20, 30\)"), ((), "0 dims")],
)
def test_bad_shapes(shape, pattern):
    with pytest.raises(AudioError, match=pattern):
        load_audio(np.zeros(shape, np.float32), SAMPLE_RATE)


def test_bad_types():
    with pytest.raises(AudioError, match="list"):
        load_audio([0.0, 0.1], SAMPLE_RATE)
    with pytest.raises(AudioError, match="complex"):
        load_audio(np.zeros(10, np.complex64), SAMPLE_RATE)
    with pytest.raises(AudioError, match="bool"):
        load_audio(torch.zeros(10, dtype=torch.bool), SAMPLE_RATE)


def test_no_resampler_says_pip_install_soxr(monkeypatch):
    monkeypatch.setitem(sys.modules, "soxr", None)
    monkeypatch.setitem(sys.modules, "torchaudio", None)
    monkeypatch.setitem(sys.modules, "torchaudio.functional", None)
    with pytest.raises(AudioError, match="44100 Hz.*pip install soxr"):
        load_audio(np.zeros(441, np.float32), 44100)
    # 16 kHz needs no resampler.
    assert load_audio(np.zeros(160, np.float32), SAMPLE_RATE).numel() == 160


def test_resampled_to_nothing_is_an_error():
    with pytest.raises(AudioError, match="too short|empty"):
        load_audio(np.zeros(1, np.float32), 384000)


def test_path_like_objects(tmp_path):
    path = tmp_path / "p.wav"
    sf.write(path, sine(440.0, SAMPLE_RATE, 0.1), SAMPLE_RATE)
    assert isinstance(path, Path)
    assert torch.equal(load_audio(path), load_audio(str(path)))
