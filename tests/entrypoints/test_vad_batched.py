"""VAD-batched long-form's bookkeeping (``tandem.entrypoints.vad_batched``) against
faster-whisper's: regions joined into the same chunks as its ``collect_chunks``,
chunk times mapped to the input's as its ``SpeechTimestampsMap`` maps them, words
through the region of their middle."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tandem.core.transcription import Transcription
from tandem.entrypoints.vad_batched import Chunk, check_regions, collect_chunks, merge

SR = 16000
MAX = 30 * SR


def _regions(seed: int, n: int = 40) -> list[tuple[int, int]]:
    """Ordered, disjoint regions of 0.2-20 s with 0-5 s gaps (samples)."""
    rng = np.random.default_rng(seed)
    out, at = [], int(rng.integers(0, 3 * SR))
    for _ in range(n):
        length = int(rng.uniform(0.2, 20) * SR)
        out.append((at, at + length))
        at += length + int(rng.uniform(0, 5) * SR)
    return out


@pytest.mark.parametrize("seed", range(4))
def test_chunks_and_times_equal_faster_whisper_s(seed):
    fw = pytest.importorskip("faster_whisper.vad")
    regions = _regions(seed)
    audio = np.random.default_rng(seed).standard_normal(regions[-1][1] + SR).astype(np.float32)
    chunks = collect_chunks(torch.from_numpy(audio), regions, MAX, SR)
    their_audio, their_meta = fw.collect_chunks(audio, [{"start": s, "end": e} for s, e in regions], SR, 30)
    # (Its metadata's "segments" miss each later chunk's first region, which it does not
    # read; the audio, offsets and durations are what it decodes and maps with.)
    assert len(chunks) == len(their_audio) > 2
    offset = 0
    for c, a, m in zip(chunks, their_audio, their_meta):
        assert np.array_equal(c.waveform.numpy(), a)
        assert c.waveform.numel() <= MAX
        assert (m["offset"], m["duration"]) == (offset / SR, c.waveform.numel() / SR)
        offset += c.waveform.numel()
    # Times: faster-whisper maps a time of the whole silence-removed audio (chunk offset +
    # time in the chunk) through every region; we map a time of one chunk through its own.
    ts_map = fw.SpeechTimestampsMap([{"start": s, "end": e} for s, e in regions], SR)
    rng = np.random.default_rng(seed)
    for c, m in zip(chunks, their_meta):
        cuts = np.cumsum([0] + [e - s for s, e in c.regions]) / SR
        inside = [round(float(t), 2) for t in rng.uniform(0, cuts[-1], 20)]  # Whisper's 20 ms steps
        inside = [t for t in inside if not np.isclose(cuts, t, atol=1e-3).any()]
        for t in inside:
            for end in (False, True):
                # faster-whisper rounds to 10 ms; 5 ms covers that rounding.
                assert c.to_input_time(t, end=end) == pytest.approx(
                    ts_map.get_original_time(m["offset"] + t, is_end=end), abs=5e-3 + 1e-9)
        for k in range(1, len(c.regions)):  # a boundary: an end in the earlier region, a start in the later
            t = float(cuts[k])
            assert c.to_input_time(t, end=True) == pytest.approx(c.regions[k - 1][1] / SR)
            assert c.to_input_time(t) == pytest.approx(c.regions[k][0] / SR)


def test_a_region_longer_than_the_window_is_a_chunk_of_its_own():
    audio = torch.zeros(200 * SR)
    regions = [(0, 10 * SR), (12 * SR, 60 * SR), (61 * SR, 70 * SR)]
    chunks = collect_chunks(audio, regions, MAX, SR)
    assert [c.regions for c in chunks] == [(regions[0],), (regions[1],), (regions[2],)]


def test_segments_and_words_merged_in_the_input_s_time():
    # Two regions: 2-5 s and 10-12 s of the input, 0-3 s and 3-5 s of the chunk.
    chunk = Chunk(torch.zeros(5 * SR), ((2 * SR, 5 * SR), (10 * SR, 12 * SR)), SR)
    words = [{"word": " a", "start": 0.5, "end": 2.9}, {"word": " b", "start": 2.8, "end": 3.6},
             {"word": " c", "start": 3.5, "end": 4.0}]
    seg = {"start": 0.0, "end": 3.0, "text": "a b", "token_ids": [1, 2], "words": words[:2],
           "token_timestamps": [2.9, 3.0]}
    seg2 = {"start": 3.0, "end": 4.5, "text": "c", "token_ids": [3], "words": words[2:], "token_timestamps": [4.0]}
    r = Transcription(text="a b c", token_ids=[1, 2, 3], language="en", segments=[seg, seg2], words=words,
                      windows=1)
    out = merge([chunk], [r], timestamps=True, word_timestamps=True, language=None)
    assert [(s["start"], s["end"]) for s in out.segments] == [(2.0, 5.0), (10.0, 11.5)]
    assert out.segments[0]["token_timestamps"] == [4.9, 5.0] and out.segments[1]["token_timestamps"] == [11.0]
    # " b" (2.8-3.6, middle 3.2: the second region) moves with the second region, both ends.
    assert [(w["start"], w["end"]) for w in out.words] == [(2.5, 4.9), (9.8, 10.6), (10.5, 11.0)]
    assert out.words == out.segments[0]["words"] + out.segments[1]["words"]
    failed = merge([chunk, chunk], [r, Transcription(error="boom")], timestamps=True, word_timestamps=False,
                   language=None)
    assert failed.error == "speech chunk 1 (2.00-12.00 s): boom"
    empty = merge([], [], timestamps=False, word_timestamps=False, language="de")
    assert empty == Transcription(language="de")


@pytest.mark.parametrize("regions, message", [
    ([(0, 10), (5, 20)], r"\(5, 20\) starts before the previous one ends \(10\)"),
    ([(10, 10)], r"\(10, 10\): needs 0 <= start < end <= 100"),
    ([(0, 101)], r"needs 0 <= start < end <= 100"),
    ([(0.5, 10)], r"\(0.5, 10\): must be two integer sample indices"),
    ([(1, 2, 3)], r"must be two integer"),
    (5, r"must be \(start, end\) sample pairs"),
])
def test_bad_regions_are_named(regions, message):
    with pytest.raises(ValueError, match=message):
        check_regions(regions, 100)
    assert check_regions([{"start": 1, "end": 5}, (5, 9)], 100) == [(1, 5), (5, 9)]


def test_a_vad_that_finds_no_speech_warns_naming_the_input(caplog):
    import logging

    from tandem.entrypoints.vad_batched import VadPlan

    plan = VadPlan(lambda wave: [], 16000, 30.0)
    with caplog.at_level(logging.WARNING, logger="tandem.transcribe"):
        assert plan.chunks(torch.zeros(2 * 16000), "'talk.wav'") == []
        assert len(plan.chunks(torch.ones(16000), "x")) == 0
    assert [r.getMessage().split(";")[0] for r in caplog.records] == [
        "vad_filter found no speech in 'talk.wav' (2.0 s): its transcript is empty",
        "vad_filter found no speech in x (1.0 s): its transcript is empty"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tandem.transcribe"):
        assert len(VadPlan(lambda wave: [(0, 8000)], 16000, 30.0).chunks(torch.ones(16000))) == 1
    assert caplog.records == []  # speech found: nothing to say
