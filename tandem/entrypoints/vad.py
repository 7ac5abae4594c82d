"""Voice activity detection: Silero VAD's speech regions, as faster-whisper finds them.

:class:`VadOptions` are faster-whisper's ``VadOptions`` (same names, same meaning),
checked once. :func:`speech_regions_from_probs` is the speech-timestamp state
machine faster-whisper's ``get_speech_timestamps`` runs over Silero's per-frame
speech probabilities (Silero's own ``get_speech_timestamps_from_probs`` with
``use_max_poss_sil_at_max_speech=False``): a region opens at a frame at or above
``threshold``, closes after ``min_silence_duration_ms`` below ``neg_threshold``,
is cut before ``max_speech_duration_s`` (at the last silence over 98 ms if any),
dropped under ``min_speech_duration_ms``, then padded by ``speech_pad_ms`` each
side (half the gap where two regions are closer than twice that).

:class:`SileroVad` runs the ``silero-vad`` package's sequence ONNX model (the
streaming model's per-frame probabilities, bit-exact, computed a block of frames
per ONNX call) with onnxruntime and numpy only: the package itself is never
imported (its import pulls in torch and sets torch's thread count to 1), its
``.onnx`` file is found on disk. Memory is bounded by the block, whatever the
audio's length: a 10-minute input is 37 calls of 512 frames.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

SAMPLE_RATE = 16000  # the sequence model's rate
FRAME_SAMPLES = 512  # one speech probability per 32 ms frame
CONTEXT_SAMPLES = 64  # the previous frame's tail each frame is read with
BLOCK_FRAMES = 512  # frames per ONNX call (~16 s of audio, ~1.2 MB of input)
MODEL_FILE = "silero_vad_16k_sequence.onnx"
_AT_MAX_SPEECH_SILENCE_MS = 98  # a silence this long is where a region over max_speech_duration_s is cut

_INSTALL = "pip install 'tandem-engine[vad]'"


@dataclass(frozen=True)
class VadOptions:
    """faster-whisper's ``VadOptions``: ``threshold`` (a frame at or above it is speech),
    ``neg_threshold`` (below it, silence; default ``max(threshold - 0.15, 0.01)``),
    ``min_speech_duration_ms`` (shorter regions are dropped), ``max_speech_duration_s``
    (longer regions are cut), ``min_silence_duration_ms`` (the silence that ends a
    region), ``speech_pad_ms`` (added to each side). The defaults are those of
    faster-whisper's batched pipeline (``min_silence_duration_ms=160``, regions of at
    most the 30 s window); its ``WhisperModel.transcribe`` uses 2000 ms and no maximum."""

    threshold: float = 0.5
    neg_threshold: float | None = None
    min_speech_duration_ms: float = 0
    max_speech_duration_s: float = 30.0
    min_silence_duration_ms: float = 160
    speech_pad_ms: float = 400

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "neg_threshold" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
                raise ValueError(f"vad_parameters {f.name}={value!r}: must be a number")
            if value < 0 or (math.isinf(value) and f.name != "max_speech_duration_s"):
                raise ValueError(f"vad_parameters {f.name}={value!r}: must be finite and >= 0")
        for name in ("threshold", "neg_threshold"):
            value = getattr(self, name)
            if value is not None and value > 1:
                raise ValueError(f"vad_parameters {name}={value!r}: a speech probability, between 0 and 1")
        if self.neg_threshold is not None and self.neg_threshold > self.threshold:
            raise ValueError(f"vad_parameters neg_threshold={self.neg_threshold!r}: must be at most "
                             f"threshold={self.threshold!r} (below it a speech frame counts as silence)")
        shortest = (FRAME_SAMPLES + 2 * SAMPLE_RATE * self.speech_pad_ms / 1000) / SAMPLE_RATE
        if self.max_speech_duration_s <= shortest:
            raise ValueError(f"vad_parameters max_speech_duration_s={self.max_speech_duration_s!r}: must be more "
                             f"than one 32 ms frame plus twice speech_pad_ms ({shortest:g} s)")

    @classmethod
    def from_dict(cls, params: Any, **defaults: Any) -> "VadOptions":
        """Options from a ``vad_parameters`` dict (keys: the field names), over ``defaults``."""
        if params is None:
            params = {}
        if not isinstance(params, dict):
            raise TypeError(f"vad_parameters must be a dict of VadOptions fields, got {type(params).__name__}: "
                            f"{params!r}")
        known = [f.name for f in fields(cls)]
        unknown = sorted(str(k) for k in params if k not in known)
        if unknown:
            raise ValueError(f"vad_parameters: unknown key(s) {unknown}; the keys are {known}")
        return cls(**{**defaults, **params})


def speech_regions_from_probs(probs: Any, num_samples: int, options: VadOptions) -> list[tuple[int, int]]:
    """Speech regions ``[(start, end), ...]`` in samples (16 kHz, ``end`` exclusive) of
    audio ``num_samples`` long from its per-frame speech probabilities (one per 512
    samples): faster-whisper's ``get_speech_timestamps`` after its model call."""
    o = options
    rate = SAMPLE_RATE
    neg = o.neg_threshold if o.neg_threshold is not None else max(o.threshold - 0.15, 0.01)
    min_speech = rate * o.min_speech_duration_ms / 1000
    pad = rate * o.speech_pad_ms / 1000
    max_speech = rate * o.max_speech_duration_s - FRAME_SAMPLES - 2 * pad
    min_silence = rate * o.min_silence_duration_ms / 1000
    cut_silence = rate * _AT_MAX_SPEECH_SILENCE_MS / 1000

    regions: list[list[int]] = []
    start: int | None = None  # the open region's start (None: not in speech)
    silence_from = 0  # where the silence inside the open region began (0: none)
    last_cut = next_start = 0  # a silence over cut_silence: where a too-long region may end, and resume
    for i, p in enumerate(np.asarray(probs, dtype=np.float64).tolist()):
        at = FRAME_SAMPLES * i
        if p >= o.threshold and silence_from:
            silence_from = 0
            if next_start < last_cut:
                next_start = at
        if p >= o.threshold and start is None:
            start = at
            continue
        if start is not None and at - start > max_speech:
            if last_cut:  # end at the last long-enough silence; resume where speech came back, if it did
                regions.append([start, last_cut])
                start = None if next_start < last_cut else next_start
                last_cut = next_start = silence_from = 0
            else:  # no silence to cut at: cut here
                regions.append([start, at])
                start = None
                last_cut = next_start = silence_from = 0
                continue
        if p < neg and start is not None:
            if not silence_from:
                silence_from = at
            if at - silence_from > cut_silence:
                last_cut = silence_from
            if at - silence_from < min_silence:
                continue
            if silence_from - start > min_speech:
                regions.append([start, silence_from])
            start = None
            last_cut = next_start = silence_from = 0
    if start is not None and num_samples - start > min_speech:
        regions.append([start, num_samples])

    for i, region in enumerate(regions):  # padding: half the gap where two regions are close
        if i == 0:
            region[0] = int(max(0, region[0] - pad))
        if i + 1 < len(regions):
            nxt = regions[i + 1]
            gap = nxt[0] - region[1]
            if gap < 2 * pad:
                region[1] += int(gap // 2)
                nxt[0] = int(max(0, nxt[0] - gap // 2))
            else:
                region[1] = int(min(num_samples, region[1] + pad))
                nxt[0] = int(max(0, nxt[0] - pad))
        else:
            region[1] = int(min(num_samples, region[1] + pad))
    return [(s, e) for s, e in regions]


def model_path() -> str:
    """The ``silero-vad`` package's sequence ONNX model, found without importing the package."""
    spec = importlib.util.find_spec("silero_vad")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"vad_filter needs the silero-vad package (its ONNX model): {_INSTALL}")
    path = os.path.join(list(spec.submodule_search_locations)[0], "data", MODEL_FILE)
    if not os.path.isfile(path):
        raise ImportError(f"the silero-vad package has no {MODEL_FILE} (silero-vad >= 6.2 ships it): {_INSTALL}")
    return path


def check_vad_support() -> None:
    """Raise ``ImportError`` naming the extra when the built-in VAD cannot run here."""
    if importlib.util.find_spec("onnxruntime") is None:
        raise ImportError(f"vad_filter needs onnxruntime: {_INSTALL}")
    model_path()


@functools.lru_cache(maxsize=1)
def _session(path: str):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    # One thread: the VAD is a small LSTM beside an engine that has the cores.
    opts.inter_op_num_threads = opts.intra_op_num_threads = 1
    opts.log_severity_level = 4
    return ort.InferenceSession(path, sess_options=opts, providers=["CPUExecutionProvider"])


class SileroVad:
    """Silero VAD on 16 kHz waveforms. ``SileroVad()(waveform, options)`` gives the speech
    regions; :meth:`probabilities` the per-frame speech probabilities. The onnxruntime
    session is made once per process and shared (its ``run`` is thread-safe); each call
    keeps its own LSTM state."""

    def __init__(self, path: str | None = None) -> None:
        check_vad_support()
        self.session = _session(path or model_path())

    def probabilities(self, waveform: Any) -> np.ndarray:
        """``[ceil(n / 512)]`` float32 speech probabilities of a 1-D waveform of ``n``
        samples (the last frame zero-padded), each frame read after the previous
        frame's last 64 samples, the LSTM state carried across blocks."""
        audio = np.asarray(waveform, dtype=np.float32)
        if audio.ndim != 1:
            raise ValueError(f"the VAD takes a 1-D waveform, got shape {tuple(audio.shape)}")
        if not np.isfinite(audio).all():
            raise ValueError(f"the VAD's waveform has {int((~np.isfinite(audio)).sum())} NaN or infinite samples")
        n_frames = -(-audio.size // FRAME_SAMPLES)
        h = np.zeros((1, 1, 128), dtype=np.float32)
        c = np.zeros((1, 1, 128), dtype=np.float32)
        context = np.zeros(CONTEXT_SAMPLES, dtype=np.float32)
        out = np.empty(n_frames, dtype=np.float32)
        for first in range(0, n_frames, BLOCK_FRAMES):
            count = min(BLOCK_FRAMES, n_frames - first)
            frames = np.zeros(count * FRAME_SAMPLES, dtype=np.float32)
            samples = audio[first * FRAME_SAMPLES : (first + count) * FRAME_SAMPLES]
            frames[: samples.size] = samples
            frames = frames.reshape(count, FRAME_SAMPLES)
            block = np.empty((count, CONTEXT_SAMPLES + FRAME_SAMPLES), dtype=np.float32)  # [frames, 64 + 512]
            block[:, CONTEXT_SAMPLES:] = frames
            block[0, :CONTEXT_SAMPLES] = context
            block[1:, :CONTEXT_SAMPLES] = frames[:-1, -CONTEXT_SAMPLES:]
            context = frames[-1, -CONTEXT_SAMPLES:].copy()
            try:
                probs, h, c = self.session.run(["speech_probs", "hn", "cn"], {"input": block, "h": h, "c": c})
            except Exception as e:  # noqa: BLE001 - onnxruntime's own errors, made this input's
                raise ValueError(f"the VAD model failed on frames {first}..{first + count}: {e}") from e
            out[first : first + count] = np.asarray(probs).reshape(-1)
        return out

    def __call__(self, waveform: Any, options: VadOptions) -> list[tuple[int, int]]:
        audio = np.asarray(waveform, dtype=np.float32)
        return speech_regions_from_probs(self.probabilities(audio), audio.size, options)
