"""Loading audio: files or arrays in, a 16 kHz mono float32 waveform out.

Files are read with ``soundfile`` (WAV, FLAC, OGG, MP3 and the other formats
libsndfile knows); for other containers (M4A, WebM, MP4...) ``av`` (PyAV) is used
when installed. Multi-channel audio is mixed down by averaging its channels, and
any rate other than 16 kHz is resampled with ``soxr`` (or, without it,
``torchaudio``), never by picking samples.

Files are decoded block by block: each block is mixed down (and, with ``soxr``,
resampled) as it comes, so memory holds the 16 kHz result rather than every
channel at the file's rate. A file's declared rate is held to the range arrays
are (1000..384000 Hz) before anything is decoded, and ``max_seconds`` is checked
against the length the header declares, then again while decoding: a small file
that expands to hours (a WAV declaring 1 Hz, an hour of silence in a FLAC) is
refused after at most ``max_seconds`` of it was decoded, not after all of it.
"""

from __future__ import annotations

import io
import math
import os
from pathlib import Path

import numpy as np
import torch

from tandem.core.transcription import AudioTooLongError as TooLong

SAMPLE_RATE = 16000

_MIN_RATE = 1000
_MAX_RATE = 384000
_MAX_CHANNELS = 8


_BLOCK_FRAMES = 1 << 16  # frames decoded at a time from a file
_UNKNOWN_FRAMES = 1 << 62  # libsndfile's frame count for a file whose header does not say (SF_COUNT_MAX)


class AudioError(ValueError):
    """Audio that cannot be loaded or turned into features; the message names the bad value."""


class AudioTooLongError(AudioError, TooLong):
    """Audio longer than the ``max_seconds`` it was loaded with (``seconds`` is what was
    declared or decoded before stopping, ``limit`` the limit). A
    :class:`tandem.core.transcription.AudioTooLongError` too, which servers catch."""

    def __init__(self, message: str, seconds: float, limit: float) -> None:
        TooLong.__init__(self, message, seconds, limit)


# What ``pip install 'tandem-engine[audio]'`` brings: soundfile decodes files, soxr resamples.
AUDIO_EXTRA_MODULES = ("soundfile", "soxr")


def require_audio_extra() -> None:
    """Raise ImportError naming the audio extra and each of its modules that does not
    import, so ``tandem transcribe`` says so before it loads a model rather than
    failing every file on the first missing module, then on the next."""
    import importlib

    missing = []
    for name in AUDIO_EXTRA_MODULES:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError:
            missing.append(name)
        except (ImportError, OSError) as e:  # installed but broken, e.g. soundfile without its libsndfile
            missing.append(f"{name} ({type(e).__name__}: {e})")
    if missing:
        raise ImportError(
            f"transcribing files needs the audio extra: pip install 'tandem-engine[audio]' "
            f"(missing: {', '.join(missing)})"
        )


def load_audio(source, sampling_rate: int | None = None, *, max_seconds: float | None = None) -> torch.Tensor:
    """A 1-D float32 CPU tensor of mono samples at 16 kHz.

    ``source`` is a file path (``str`` or ``os.PathLike``), the bytes of an audio
    file, or an array of samples (numpy array or torch tensor), for which
    ``sampling_rate`` is required. Arrays are 1-D (mono) or 2-D with up to 8
    channels along the shorter axis (``[channels, samples]`` or
    ``[samples, channels]``); integer PCM is scaled to [-1, 1] as soundfile does
    (int16 / 32768, uint8 centred on 128...). For a file, the rate comes from the
    file; a ``sampling_rate`` given with one must agree with it, and the file's
    own rate must lie in 1000..384000 Hz as an array's must.

    ``max_seconds`` (default: no limit) refuses longer audio with
    :class:`AudioTooLongError`: a file is refused from its header when the header
    says how long it is, else once decoding passes the limit (never decoded to the
    end); an array from its shape, before it is resampled.

    Raises :class:`AudioError` on anything it cannot load.
    """
    if max_seconds is not None:
        if isinstance(max_seconds, bool) or not isinstance(max_seconds, (int, float)) or not max_seconds > 0 \
                or not math.isfinite(max_seconds):
            raise AudioError(f"max_seconds must be a positive number of seconds or None, got {max_seconds!r}")
    if isinstance(source, (str, os.PathLike)):
        return _load_file(source, sampling_rate, max_seconds)
    if isinstance(source, (bytes, bytearray, memoryview)):
        return _load_file(bytes(source), sampling_rate, max_seconds)
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
        if max_seconds is not None and mono.size > max_seconds * rate:
            seconds = mono.size / rate
            raise AudioTooLongError(
                f"audio too long: an array of shape {shape} at {rate} Hz is {seconds:.1f} s, over the "
                f"{max_seconds:g}-second limit (max_seconds)", seconds, max_seconds)
        return _finish(mono, rate, f"array of shape {shape}")
    raise AudioError(
        f"cannot load audio from a {type(source).__name__}: pass a file path, the bytes of a file, "
        "or a numpy array / torch tensor of samples"
    )


# --------------------------------------------------------------------------- files


def _load_file(source: str | os.PathLike | bytes, sampling_rate: int | None, max_seconds: float | None) -> torch.Tensor:
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
    return _read(source, what, sampling_rate, max_seconds)


class _Decoded:
    """What a file decodes to, block by block: each ``[frames, channels]`` block is
    checked for non-finite samples, mixed down to mono and (with soxr) resampled
    to 16 kHz at once, so no more than a block of the file's own channels and rate
    is held. ``max_seconds`` is checked against the declared length first, then as
    blocks come in."""

    def __init__(self, what: str, sampling_rate: int | None, max_seconds: float | None) -> None:
        self.what, self.sampling_rate, self.max_seconds = what, sampling_rate, max_seconds
        self.rate: int | None = None
        self.frames = 0  # decoded, per channel, at the file's rate
        self.values = 0  # decoded, all channels
        self.bad = self.nan = 0
        self.chunks: list[np.ndarray] = []
        self.stream = None

    def start(self, rate, declared_seconds: float | None = None) -> None:
        what = self.what
        rate = int(rate)
        if self.sampling_rate is not None and self.sampling_rate != rate:
            raise AudioError(
                f"{what} is sampled at {rate} Hz but sampling_rate={self.sampling_rate} was given; "
                "leave sampling_rate out for files"
            )
        if not _MIN_RATE <= rate <= _MAX_RATE:  # the range arrays are held to
            raise AudioError(f"{what} declares a sampling rate of {rate} Hz, outside {_MIN_RATE}..{_MAX_RATE} Hz")
        if self.max_seconds is not None and declared_seconds is not None and declared_seconds > self.max_seconds:
            raise AudioTooLongError(
                f"audio too long: {what} declares {declared_seconds:.1f} s, over the {self.max_seconds:g}-second "
                "limit (max_seconds)", declared_seconds, self.max_seconds)
        self.rate = rate
        if rate != SAMPLE_RATE:
            try:
                import soxr
            except ImportError:  # no streaming resampler: the mono samples are resampled at the end
                pass
            else:
                self.stream = soxr.ResampleStream(rate, SAMPLE_RATE, 1, dtype="float32", quality="HQ")

    def room(self) -> int | None:
        """Frames that may still be decoded (one more than that is over the limit)."""
        if self.max_seconds is None:
            return None
        return max(0, int(math.floor(self.max_seconds * self.rate)) - self.frames) + 1

    def add(self, block: np.ndarray) -> None:
        """``block``: float ``[frames, channels]``."""
        if block.size == 0:
            return
        self.frames += block.shape[0]
        self.values += block.size
        if self.max_seconds is not None and self.frames > self.max_seconds * self.rate:
            seconds = self.frames / self.rate
            raise AudioTooLongError(
                f"audio too long: {self.what} runs past the {self.max_seconds:g}-second limit (max_seconds); "
                f"decoding stopped at {seconds:.1f} s", seconds, self.max_seconds)
        finite = np.isfinite(block)
        if not finite.all():
            self.bad += int(block.size - finite.sum())
            self.nan += int(np.isnan(block).sum())
        if self.bad:  # the load fails: only the count goes on
            return
        if block.shape[1] == 1:
            mono = np.ascontiguousarray(block.reshape(-1), dtype=np.float32)
        else:
            mono = block.mean(axis=1, dtype=np.float64).astype(np.float32)
        self.chunks.append(self.stream.resample_chunk(mono) if self.stream is not None else mono)

    def finish(self) -> torch.Tensor:
        what = self.what
        if self.values == 0:
            raise AudioError(f"empty audio: 0 samples ({what})")
        if self.bad:
            raise AudioError(
                f"audio has {self.bad} non-finite samples ({self.nan} NaN, {self.bad - self.nan} inf) "
                f"out of {self.values}: {what}"
            )
        if self.stream is not None:
            self.chunks.append(self.stream.resample_chunk(np.zeros(0, np.float32), last=True))
            x = np.concatenate(self.chunks) if len(self.chunks) > 1 else self.chunks[0]
            if x.size == 0:
                raise AudioError(
                    f"audio too short: {what} resamples from {self.rate} Hz to 0 samples at {SAMPLE_RATE} Hz")
            return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
        x = np.concatenate(self.chunks) if len(self.chunks) > 1 else self.chunks[0]
        self.chunks = []
        return _finish(x, self.rate, what)


def _read(source: str | bytes, what: str, sampling_rate: int | None, max_seconds: float | None) -> torch.Tensor:
    """Decode with soundfile, else with PyAV; mono at 16 kHz."""
    reason = None
    try:
        import soundfile
    except ImportError:
        reason = "soundfile is not installed (pip install soundfile)"
    else:
        try:
            with soundfile.SoundFile(io.BytesIO(source) if isinstance(source, bytes) else source) as f:
                out = _Decoded(what, sampling_rate, max_seconds)
                # A header that says how long the file is is believed; libsndfile gives
                # 2**63 - 1 frames when it does not say (decoding stops at the limit then).
                declared = f.frames / f.samplerate if 0 < f.frames < _UNKNOWN_FRAMES and f.samplerate > 0 else None
                out.start(f.samplerate, declared)
                while True:
                    room = out.room()
                    block = f.read(frames=_BLOCK_FRAMES if room is None else min(_BLOCK_FRAMES, room),
                                   dtype="float32", always_2d=True)
                    if block.shape[0] == 0:
                        break
                    out.add(block)
                return out.finish()
        except AudioError:
            raise
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
        return _read_with_av(av, source, what, _Decoded(what, sampling_rate, max_seconds))
    except AudioError:
        raise
    except Exception as e:
        raise AudioError(f"unreadable audio file {what}: {reason} (soundfile); {e} (PyAV)") from e


def _read_with_av(av, source: str | bytes, what: str, out: _Decoded) -> torch.Tensor:
    with av.open(io.BytesIO(source) if isinstance(source, bytes) else source) as container:
        if not container.streams.audio:
            raise AudioError(f"unreadable audio file {what}: it has no audio stream")
        stream = container.streams.audio[0]
        declared = None
        if stream.duration is not None and stream.time_base is not None:
            declared = float(stream.duration * stream.time_base)
        elif container.duration is not None:
            declared = container.duration / 1_000_000  # av.time_base: microseconds
        resampler = None
        for frame in container.decode(stream):
            if resampler is None:
                # Only the sample format changes (to planar float32): the channels and
                # the rate stay, for the mix-down and the resampler.
                out.start(frame.sample_rate, declared)
                resampler = av.AudioResampler(format="fltp", layout=frame.layout, rate=frame.sample_rate)
            for o in resampler.resample(frame):
                out.add(o.to_ndarray().T)  # [channels, samples] -> [samples, channels]
        if resampler is None:
            raise AudioError(f"empty audio: {what} decodes to 0 samples")
        for o in resampler.resample(None):
            out.add(o.to_ndarray().T)
    if out.values == 0:
        raise AudioError(f"empty audio: {what} decodes to 0 samples")
    return out.finish()


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
