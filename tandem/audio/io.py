"""Loading audio: files or arrays in, a 16 kHz mono float32 waveform out.

Files are read with ``soundfile`` (WAV, FLAC, OGG, MP3 and the other formats
libsndfile knows); for other containers (M4A, WebM, MP4...) ``av`` (PyAV) is used
when installed. Multi-channel audio is mixed down by averaging its channels, and
any rate other than 16 kHz is resampled with ``soxr`` (or, without it,
``torchaudio``), never by picking samples.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np
import torch

SAMPLE_RATE = 16000

_MIN_RATE = 1000
_MAX_RATE = 384000
_MAX_CHANNELS = 8


class AudioError(ValueError):
    """Audio that cannot be loaded or turned into features; the message names the bad value."""


def load_audio(source, sampling_rate: int | None = None) -> torch.Tensor:
    """A 1-D float32 CPU tensor of mono samples at 16 kHz.

    ``source`` is a file path (``str`` or ``os.PathLike``), the bytes of an audio
    file, or an array of samples (numpy array or torch tensor), for which
    ``sampling_rate`` is required. Arrays are 1-D (mono) or 2-D with up to 8
    channels along the shorter axis (``[channels, samples]`` or
    ``[samples, channels]``); integer PCM is scaled to [-1, 1] as soundfile does
    (int16 / 32768, uint8 centred on 128...). For a file, the rate comes from the
    file; a ``sampling_rate`` given with one must agree with it.

    Raises :class:`AudioError` on anything it cannot load.
    """
    if isinstance(source, (str, os.PathLike)):
        return _load_file(source, sampling_rate)
    if isinstance(source, (bytes, bytearray, memoryview)):
        return _load_file(bytes(source), sampling_rate)
    if isinstance(source, (np.ndarray, torch.Tensor)):
        shape = tuple(source.shape)
        if sampling_rate is None:
            raise AudioError(
                f"sampling_rate is required with an array of samples (got an array of shape {shape} "
                "and sampling_rate=None)"
            )
        rate = _check_rate(sampling_rate)
        samples = _to_float(_to_numpy(source), f"array of shape {shape}")
        mono = _mix_down(samples, f"array of shape {shape}")
        return _finish(mono, rate, f"array of shape {shape}")
    raise AudioError(
        f"cannot load audio from a {type(source).__name__}: pass a file path, the bytes of a file, "
        "or a numpy array / torch tensor of samples"
    )


# --------------------------------------------------------------------------- files


def _load_file(source: str | os.PathLike | bytes, sampling_rate: int | None) -> torch.Tensor:
    if sampling_rate is not None:
        sampling_rate = _check_rate(sampling_rate)
    if isinstance(source, bytes):
        what = f"<{len(source)} bytes of audio>"
        if not source:
            raise AudioError(f"empty audio: {what}")
    else:
        what = repr(os.fspath(source))
        path = Path(source).expanduser()
        if not path.exists():
            raise AudioError(f"no such file: {what}")
        if not path.is_file():
            raise AudioError(f"not a file: {what}")
        source = str(path)

    samples, rate = _read(source, what)
    if sampling_rate is not None and sampling_rate != rate:
        raise AudioError(
            f"{what} is sampled at {rate} Hz but sampling_rate={sampling_rate} was given; "
            "leave sampling_rate out for files"
        )
    if rate <= 0:
        raise AudioError(f"{what} declares an invalid sampling rate of {rate} Hz")
    mono = _mix_down(_to_float(samples, what), what, channels_last=True)
    return _finish(mono, rate, what)


def _read(source: str | bytes, what: str) -> tuple[np.ndarray, int]:
    """``[samples, channels]`` and the rate, with soundfile, else with PyAV."""
    reason = None
    try:
        import soundfile
    except ImportError:
        reason = "soundfile is not installed (pip install soundfile)"
    else:
        try:
            data, rate = soundfile.read(
                io.BytesIO(source) if isinstance(source, bytes) else source, dtype="float32", always_2d=True
            )
            return data, int(rate)
        except Exception as e:  # libsndfile's errors: unknown format, truncated file, I/O...
            # LibsndfileError carries libsndfile's own words apart from "Error opening <file>: ".
            reason = (getattr(e, "error_string", None) or str(e) or type(e).__name__).strip().rstrip(".")

    try:
        import av
    except ImportError:
        raise AudioError(
            f"unreadable audio file {what}: {reason} (soundfile). soundfile reads WAV, FLAC, OGG and MP3; "
            "`pip install av` adds other containers (M4A, WebM, MP4...)"
        ) from None
    try:
        return _read_with_av(av, source, what)
    except AudioError:
        raise
    except Exception as e:
        raise AudioError(f"unreadable audio file {what}: {reason} (soundfile); {e} (PyAV)") from e


def _read_with_av(av, source: str | bytes, what: str) -> tuple[np.ndarray, int]:
    chunks = []
    rate = None
    with av.open(io.BytesIO(source) if isinstance(source, bytes) else source) as container:
        if not container.streams.audio:
            raise AudioError(f"unreadable audio file {what}: it has no audio stream")
        resampler = None
        for frame in container.decode(container.streams.audio[0]):
            if resampler is None:
                # Only the sample format changes (to planar float32): the channels and
                # the rate stay, for load_audio's own mix-down and resampler.
                rate = frame.sample_rate
                resampler = av.AudioResampler(format="fltp", layout=frame.layout, rate=rate)
            for out in resampler.resample(frame):
                chunks.append(out.to_ndarray())
        if resampler is not None:
            for out in resampler.resample(None):
                chunks.append(out.to_ndarray())
    if not chunks:
        raise AudioError(f"empty audio: {what} decodes to 0 samples")
    return np.concatenate(chunks, axis=1).T, int(rate)  # [samples, channels]


# --------------------------------------------------------------------------- arrays


def _check_rate(sampling_rate) -> int:
    if isinstance(sampling_rate, bool) or not isinstance(sampling_rate, (int, np.integer)):
        raise AudioError(f"sampling_rate must be a positive int (Hz), got {sampling_rate!r}")
    if not _MIN_RATE <= sampling_rate <= _MAX_RATE:
        raise AudioError(f"sampling_rate={int(sampling_rate)} Hz is outside {_MIN_RATE}..{_MAX_RATE} Hz")
    return int(sampling_rate)


def _to_numpy(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu()
        if x.dtype in (torch.bfloat16, torch.float16):
            x = x.float()
        if x.is_complex() or x.dtype == torch.bool:
            raise AudioError(f"samples must be real numbers, got a tensor of dtype {x.dtype}")
        return x.numpy()
    return x


def _to_float(x: np.ndarray, what: str) -> np.ndarray:
    """Float samples in [-1, 1] for integer PCM, as libsndfile scales it."""
    kind = x.dtype.kind
    if kind == "f":
        return x if x.dtype in (np.float32, np.float64) else x.astype(np.float32)
    if kind == "i":
        full_scale = float(2 ** (8 * x.dtype.itemsize - 1))
        return (x.astype(np.float64) / full_scale).astype(np.float32)
    if kind == "u":
        full_scale = float(2 ** (8 * x.dtype.itemsize - 1))
        return ((x.astype(np.float64) - full_scale) / full_scale).astype(np.float32)
    raise AudioError(f"samples must be integer PCM or floats, got dtype {x.dtype} ({what})")


def _mix_down(x: np.ndarray, what: str, channels_last: bool = False) -> np.ndarray:
    """1-D samples: channels averaged. Checks emptiness and finiteness first."""
    if x.ndim == 0 or x.ndim > 2:
        raise AudioError(
            f"audio must be 1-D (mono) or 2-D (channels x samples), got {x.ndim} dims: {what}"
        )
    if x.size == 0:
        raise AudioError(f"empty audio: 0 samples ({what})")
    bad = ~np.isfinite(x)
    if bad.any():
        n_nan = int(np.isnan(x).sum())
        raise AudioError(
            f"audio has {int(bad.sum())} non-finite samples ({n_nan} NaN, {int(bad.sum()) - n_nan} inf) "
            f"out of {x.size}: {what}"
        )
    if x.ndim == 1:
        return x
    if channels_last:
        axis = 1
    else:
        axis = 0 if x.shape[0] <= x.shape[1] else 1
        if x.shape[axis] > _MAX_CHANNELS:
            raise AudioError(
                f"cannot tell channels from samples in an {what}: neither axis has at most "
                f"{_MAX_CHANNELS} entries; pass [channels, samples] or [samples, channels]"
            )
    if x.shape[axis] == 1:
        return x.reshape(-1)
    return x.mean(axis=axis, dtype=np.float64).astype(np.float32)


def _finish(x: np.ndarray, rate: int, what: str) -> torch.Tensor:
    x = _resample(np.ascontiguousarray(x, dtype=np.float32), rate, what)
    if x.size == 0:
        raise AudioError(f"audio too short: {what} resamples from {rate} Hz to 0 samples at {SAMPLE_RATE} Hz")
    if not x.flags.writeable:
        x = x.copy()
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))


def _resample(x: np.ndarray, rate: int, what: str) -> np.ndarray:
    if rate == SAMPLE_RATE:
        return x
    try:
        import soxr
    except ImportError:
        pass
    else:
        return soxr.resample(x, rate, SAMPLE_RATE, quality="HQ")
    try:
        import torchaudio.functional as taf
    except ImportError:
        raise AudioError(
            f"resampling {what} from {rate} Hz to {SAMPLE_RATE} Hz needs a resampler: pip install soxr"
        ) from None
    return taf.resample(torch.from_numpy(x), rate, SAMPLE_RATE).numpy()
