"""The demo Whisper shows word timestamps and VAD offline: its generation config ships
``alignment_heads`` (chosen by tools/select_demo_alignment_heads.py), and the energy VAD
finds its tone speech (Silero does not). The oracle is the audio itself: each demo
word's true span is known from ``synthesize(..., plan=True)``."""

import json

import numpy as np
import pytest

from tandem import LLM
from tandem.audio import load_audio
from tandem.demo_whisper import PATH, synthesize
from tandem.entrypoints.cli import main
from tandem.entrypoints.vad_energy import EnergyVad

SAMPLES = json.loads((PATH / "demo_samples.json").read_text())


@pytest.fixture(scope="module")
def llm():
    return LLM(model=str(PATH), dtype="float32", device="cpu")


def _spans(sample):
    audio, spans = synthesize(sample["expected"], seed=sample["seed"], plan=True)
    shipped = load_audio(PATH / sample["file"]).numpy()
    assert shipped.shape == audio.shape and np.abs(shipped - audio).max() < 1e-3  # the file is that audio
    return spans, len(audio) / 16000


def _check_words(words, sample):
    spans, duration = _spans(sample)
    assert [w["word"].strip() for w in words] == sample["expected"].split()
    times = [t for w in words for t in (w["start"], w["end"])]
    assert times == sorted(times) and 0 <= times[0] and times[-1] <= duration, words
    # HF's alignment times a word from the previous token's time to its own: each word
    # after the first ends where it truly ends (20 ms steps), and starts no later than it
    # truly does; the first starts at the window's start (the path's first row).
    for w, (start, end) in zip(words[1:], spans[1:]):
        assert abs(w["end"] - end) <= 0.1 and w["start"] <= start + 0.02, (w, start, end)
    assert words[0]["start"] == 0.0 and words[0]["end"] <= spans[0][1]


def test_word_timestamps_work_offline_and_fall_on_the_words(llm):
    results = llm.transcribe([str(PATH / s["file"]) for s in SAMPLES], word_timestamps=True, use_tqdm=False)
    for sample, r in zip(SAMPLES, results):
        assert r.error is None and r.text == sample["expected"]
        _check_words(r.words, sample)


def test_the_cli_gives_word_timestamps_on_the_shipped_audio(capsys):
    sample = SAMPLES[0]
    assert main(["transcribe", str(PATH), str(PATH / sample["file"]), "--word-timestamps", "--format", "json",
                 "--dtype", "float32", "--no-progress"]) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["error"] is None and record["text"] == sample["expected"]
    _check_words(record["words"], sample)


def test_energy_vad_finds_the_tone_speech_and_not_the_silence():
    sr = 16000
    first, first_spans = synthesize("three one four", seed=3, plan=True)
    second, second_spans = synthesize("stop go", seed=4, plan=True)
    gap = np.zeros(3 * sr, np.float32)
    audio = np.concatenate([gap[: 2 * sr], first, gap, second, gap[: sr]])
    audio += 0.003 * np.random.default_rng(0).standard_normal(audio.size).astype(np.float32)  # a noise floor
    offset2 = (2 * sr + first.size + gap.size) / sr
    truth = [(2 + first_spans[0][0], 2 + first_spans[-1][1]),
             (offset2 + second_spans[0][0], offset2 + second_spans[-1][1])]
    regions = [(s / sr, e / sr) for s, e in EnergyVad()(audio, sr)]
    assert len(regions) == 2, regions
    for (start, end), (t0, t1) in zip(regions, truth):
        # The whole speech, padded by at most speech_pad_ms (0.4 s) and one 32 ms frame each side.
        assert t0 - 0.44 <= start <= t0 and t1 <= end <= t1 + 0.44, (start, end, t0, t1)
    assert EnergyVad()(np.zeros(sr, np.float32), sr) == []  # digital silence: nothing
    # 44.1 kHz input: the same regions, in its own samples.
    at_44k = np.interp(np.arange(int(audio.size * 44100 / sr)) * sr / 44100, np.arange(audio.size), audio)
    regions_44k = [(s / 44100, e / 44100) for s, e in EnergyVad()(at_44k, 44100)]
    assert np.allclose(regions_44k, regions, atol=0.04)


def test_bad_energy_vad_options_are_named():
    with pytest.raises(ValueError, match="unknown key"):
        EnergyVad({"bogus": 1})
    with pytest.raises(ValueError, match="floor_db=nan"):
        EnergyVad(floor_db=float("nan"))


def test_the_cli_vad_filter_finds_the_demo_speech(capsys):
    files = [str(PATH / s["file"]) for s in SAMPLES]
    assert main(["transcribe", str(PATH), *files, "--vad-filter", "--vad-method", "energy",
                 "--vad-parameters", '{"speech_pad_ms": 200}', "--dtype", "float32", "--no-progress"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()[-len(SAMPLES):]
    assert lines == [f"{f}\t{s['expected']}" for f, s in zip(files, SAMPLES)]
    assert main(["transcribe", str(PATH), files[0], "--vad-method", "energy"]) == 2
    assert "--vad-method energy without --vad-filter" in capsys.readouterr().err
