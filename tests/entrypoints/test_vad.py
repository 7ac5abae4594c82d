"""Silero VAD (``tandem.entrypoints.vad``): the speech regions equal silero-vad's and
faster-whisper's own post-processing of the same per-frame probabilities; the
probabilities equal silero's streaming ONNX model frame by frame; the model finds
synthetic speech islands and not the silence between them; memory is bounded by
the block on a 10-minute input; bad options and bad audio are clear errors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from helpers import speechlike_audio
from tandem.entrypoints.vad import BLOCK_FRAMES, FRAME_SAMPLES, SileroVad, VadOptions, speech_regions_from_probs

pytest.importorskip("onnxruntime")
pytest.importorskip("silero_vad")  # its ONNX model file (the package is not imported)
SR = 16000


@pytest.fixture(scope="module")
def silero_utils():
    """silero-vad's own functions. Importing the package sets torch's thread count to 1
    (``silero_vad/model.py``): put it back, so no later test runs on one thread."""
    pytest.importorskip("silero_vad")
    threads = torch.get_num_threads()
    try:
        import silero_vad.utils_vad as utils
    finally:
        torch.set_num_threads(threads)
    return utils


def _probabilities(seed: int, frames: int) -> np.ndarray:
    """Per-frame probabilities with runs of speech and silence of random lengths, the
    values jittered around the thresholds (so the hysteresis and the short-silence rules
    all fire), and long runs (so max_speech_duration_s cuts)."""
    rng = np.random.default_rng(seed)
    out = []
    while len(out) < frames:
        speech = rng.random() < 0.5
        n = int(rng.choice([1, 3, 8, 20, 60, 400]))
        centre = rng.uniform(0.55, 0.99) if speech else rng.uniform(0.0, 0.45)
        out += list(np.clip(centre + rng.normal(0, 0.12, n), 0, 1))
    return np.asarray(out[:frames], dtype=np.float32)


OPTION_SETS = [
    {},  # faster-whisper's batched defaults
    {"min_silence_duration_ms": 2000, "max_speech_duration_s": math.inf},  # its WhisperModel.transcribe defaults
    {"threshold": 0.6, "neg_threshold": 0.2, "min_speech_duration_ms": 250, "max_speech_duration_s": 5.0,
     "min_silence_duration_ms": 100, "speech_pad_ms": 30},
    {"threshold": 0.4, "min_silence_duration_ms": 0, "speech_pad_ms": 0, "max_speech_duration_s": 2.0},
]


def _cases(params: dict):
    """(probabilities, num_samples, options) for six seeds: 96 s of frames each."""
    options = VadOptions.from_dict(params)
    for seed in range(6):
        probs = _probabilities(seed, 3000)
        num_samples = len(probs) * FRAME_SAMPLES - int(np.random.default_rng(seed).integers(0, FRAME_SAMPLES))
        yield probs, num_samples, options


@pytest.mark.parametrize("params", OPTION_SETS)
def test_regions_equal_silero_s(params, silero_utils):
    """silero-vad's state machine, in the mode faster-whisper copied (a too-long region
    is cut at the last silence over 98 ms, not at the longest one)."""
    longest = 0
    for probs, num_samples, o in _cases(params):
        ours = speech_regions_from_probs(probs, num_samples, o)
        silero = silero_utils.get_speech_timestamps_from_probs(
            list(map(float, probs)), sampling_rate=SR, threshold=o.threshold, neg_threshold=o.neg_threshold,
            min_speech_duration_ms=o.min_speech_duration_ms, max_speech_duration_s=o.max_speech_duration_s,
            min_silence_duration_ms=o.min_silence_duration_ms, speech_pad_ms=o.speech_pad_ms,
            use_max_poss_sil_at_max_speech=False, audio_length_samples=num_samples)
        assert ours == [(s["start"], s["end"]) for s in silero] and ours
        longest = max(longest, max(e - s for s, e in ours))
    if o.max_speech_duration_s < 10:  # the cut fired: no region over the maximum plus its padding
        assert longest <= (o.max_speech_duration_s + 2 * o.speech_pad_ms / 1000) * SR


@pytest.mark.parametrize("params", OPTION_SETS)
def test_regions_equal_faster_whisper_s(params, monkeypatch):
    """faster-whisper's ``get_speech_timestamps``, its model call replaced by the same
    probabilities."""
    from dataclasses import asdict

    fw = pytest.importorskip("faster_whisper.vad")
    for probs, num_samples, o in _cases(params):
        monkeypatch.setattr(fw, "get_vad_model", lambda p=probs: (lambda audio: p))
        theirs = fw.get_speech_timestamps(np.zeros(num_samples, np.float32), fw.VadOptions(**asdict(o)))
        assert speech_regions_from_probs(probs, num_samples, o) == [(s["start"], s["end"]) for s in theirs]


def test_probabilities_equal_the_streaming_model_frame_by_frame(silero_utils):
    """The sequence model, a block of frames per call, against silero's streaming ONNX
    model called once per 512-sample frame with its own state and context: 17 s, so the
    LSTM state and the context cross a block boundary (512 frames)."""
    audio = np.concatenate([speechlike_audio(7.0, seed=1), np.zeros(3 * SR, np.float32),
                            speechlike_audio(7.0, seed=2)[: 7 * SR - 100]])
    ours = SileroVad().probabilities(audio)
    assert len(ours) == -(-audio.size // FRAME_SAMPLES) > BLOCK_FRAMES
    threads = torch.get_num_threads()
    try:
        from silero_vad import load_silero_vad

        model = load_silero_vad(onnx=True)
    finally:
        torch.set_num_threads(threads)
    model.reset_states()
    ref = []
    for i in range(0, audio.size, FRAME_SAMPLES):
        frame = torch.from_numpy(audio[i : i + FRAME_SAMPLES])
        ref.append(model(torch.nn.functional.pad(frame, (0, FRAME_SAMPLES - frame.numel())), SR).item())
    # Two ONNX graphs of the same float32 LSTM; observed equal, and 1e-5 is far below
    # the 0.15 hysteresis that separates a decision from its neighbour.
    np.testing.assert_allclose(ours, np.asarray(ref, np.float32), atol=1e-5)


def test_synthetic_speech_islands_are_found_and_the_silence_is_not():
    islands = [(2.0, 9.0), (13.0, 30.0), (36.5, 40.0)]  # seconds
    audio = np.zeros(42 * SR, np.float32)
    for k, (a, b) in enumerate(islands):
        audio[int(a * SR) : int(b * SR)] = speechlike_audio(b - a, seed=k)
    regions = SileroVad()(audio, VadOptions())
    assert all(0 <= s < e <= audio.size for s, e in regions)
    assert all(e1 <= s2 for (_, e1), (s2, _) in zip(regions, regions[1:]))
    pad = 0.4 + 0.2  # speech_pad_ms, plus 200 ms for the detector's onset and offset
    for a, b in islands:  # each island inside one region (at most max_speech_duration_s each: 17 s fits)
        assert any(s / SR <= a + 0.2 and b - 0.2 <= e / SR for s, e in regions), (a, b, regions)
    for (_, b), (a, _) in zip(islands, islands[1:]):  # the middle of each gap is silence
        mid = (a + b) / 2
        assert not any(s / SR < mid < e / SR for s, e in regions) and a - b > 2 * pad
    assert len(regions) == len(islands)


class _Recorder:
    """A stand-in onnxruntime session: probability 0 for every frame, the block sizes kept."""

    def __init__(self) -> None:
        self.blocks: list[tuple[int, ...]] = []

    def run(self, names, feeds):
        self.blocks.append(feeds["input"].shape)
        return np.zeros(feeds["input"].shape[0], np.float32), feeds["h"], feeds["c"]


def test_a_ten_minute_input_runs_in_bounded_blocks():
    vad = SileroVad()
    vad.session = _Recorder()
    audio = np.zeros(600 * SR, np.float32)
    assert vad(audio, VadOptions()) == []
    frames = -(-audio.size // FRAME_SAMPLES)
    assert sum(b[0] for b in vad.session.blocks) == frames
    assert max(b[0] for b in vad.session.blocks) == BLOCK_FRAMES  # ~1.2 MB per call, whatever the length
    assert {b[1] for b in vad.session.blocks} == {576}


def test_bad_audio_is_a_clear_error():
    vad = SileroVad()
    with pytest.raises(ValueError, match=r"1-D waveform, got shape \(2, 16000\)"):
        vad.probabilities(np.zeros((2, SR), np.float32))
    bad = np.zeros(SR, np.float32)
    bad[[3, 70]] = [np.nan, np.inf]
    with pytest.raises(ValueError, match="2 NaN or infinite"):
        vad.probabilities(bad)
    assert len(vad.probabilities(np.zeros(0, np.float32))) == 0


@pytest.mark.parametrize("params, message", [
    ({"treshold": 0.5}, r"unknown key\(s\) \['treshold'\]; the keys are \['threshold'"),
    ({"threshold": 1.5}, r"threshold=1.5: a speech probability"),
    ({"threshold": "0.5"}, r"threshold='0.5': must be a number"),
    ({"min_silence_duration_ms": True}, r"min_silence_duration_ms=True: must be a number"),
    ({"speech_pad_ms": -1}, r"speech_pad_ms=-1: must be finite and >= 0"),
    ({"min_speech_duration_ms": math.inf}, r"min_speech_duration_ms=inf: must be finite"),
    ({"threshold": 0.3, "neg_threshold": 0.4}, r"neg_threshold=0.4: must be at most threshold=0.3"),
    ({"max_speech_duration_s": 0.5}, r"max_speech_duration_s=0.5: must be more than .*0.832 s"),
    ({"neg_threshold": math.nan}, r"neg_threshold=nan: must be a number"),
])
def test_bad_options_name_the_key_and_value(params, message):
    with pytest.raises(ValueError, match=message):
        VadOptions.from_dict(params)


def test_options_must_be_a_dict():
    with pytest.raises(TypeError, match=r"vad_parameters must be a dict .* got list"):
        VadOptions.from_dict([("threshold", 0.5)])
