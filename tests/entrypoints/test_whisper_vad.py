"""``vad_filter``: VAD-batched long-form (faster-whisper's batched pipeline) on the
shared engine. The oracle is ``LLM.transcribe`` itself: every speech chunk
transcribed alone, its times offset by hand into the input's time, equals the
batched result, whose chunks were all in flight at once. A stub detector (the
callable ``vad_filter`` takes) places the regions; the real Silero VAD gives the
same result as the stub given the regions Silero finds. With the option off
nothing runs and nothing changes."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest

from helpers import make_whisper, speechlike_audio, synth_audio
from tandem import LLM
from tandem.entrypoints.llm import LLMSession

SR = 16000
# Regions (seconds) of a 95 s input; joined into chunks of at most 30 s of speech, in
# order, they make three: regions 0-2 (8 + 14 + 6.5 = 28.5 s; region 3 would go over),
# 3-5 (12 + 7 + 5.5 = 24.5 s) and 6 (25 s).
REGIONS = [(1.0, 9.0), (10.0, 24.0), (24.5, 31.0), (40.0, 52.0), (53.0, 60.0), (61.0, 66.5), (70.0, 95.0)]
GROUPS = [[0, 1, 2], [3, 4, 5], [6]]


# Slow (decodes the windows of long synthetic files, two engines): out of the default run,
# in CI's bfloat16 stage (pyproject's `slow`).
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def whisper_ts(tmp_path_factory):
    path = make_whisper(tmp_path_factory.mktemp("whisper_vad") / "ckpt", num_mel_bins=80, seed=3, timestamps=True)
    return path, LLM(model=str(path), dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def clip():
    return synth_audio(95.0, seed=1)


def _stub(regions_s):
    """A detector giving fixed regions (seconds), checking what it is handed."""
    calls = []

    def detect(waveform, sample_rate):
        assert isinstance(waveform, np.ndarray) and waveform.dtype == np.float32 and waveform.ndim == 1
        assert sample_rate == SR
        calls.append(waveform.size)
        return [(int(a * SR), int(b * SR)) for a, b in regions_s]

    detect.calls = calls
    return detect


def _by_hand(llm, clip, regions_s, groups, **options):
    """Each group's regions concatenated and transcribed alone; segment times moved into
    the input's time by hand: a chunk time t in region j (of the group) is
    region start + t - (speech before region j in the chunk); an end on a boundary stays
    in the earlier region."""
    out = []
    for group in groups:
        spans = [(int(regions_s[j][0] * SR), int(regions_s[j][1] * SR)) for j in group]
        audio = np.concatenate([clip[a:b] for a, b in spans])
        r = llm.transcribe({"audio": audio, "sampling_rate": SR}, use_tqdm=False, **options)[0]
        assert r.error is None

        def move(t, end):
            before = 0
            for k, (a, b) in enumerate(spans):
                length = (b - a) / SR
                last = k == len(spans) - 1
                if last or (t <= before + length if end else t < before + length):
                    return round(a / SR + t - before, 3)
                before += length

        segs = [{**s, "start": move(s["start"], False), "end": move(s["end"], True)} for s in r.segments or ()]
        out.append((r, segs))
    return out


def _in_flight(monkeypatch):
    """The number of the session's unfinished requests at each engine step."""
    seen = []
    step = LLMSession.step

    def spy(self):
        seen.append(len(self._unfinished))
        return step(self)

    monkeypatch.setattr(LLMSession, "step", spy)
    return seen


def test_chunks_decoded_together_equal_each_chunk_transcribed_alone(whisper_ts, clip, monkeypatch):
    path, llm = whisper_ts
    options = dict(language="en", timestamps=True, temperature=0.0)
    expected = _by_hand(llm, clip, REGIONS, GROUPS, **options)
    seen = _in_flight(monkeypatch)
    detect = _stub(REGIONS)
    r = llm.transcribe({"audio": clip, "sampling_rate": SR}, vad_filter=detect, use_tqdm=False, **options)[0]
    assert r.error is None and detect.calls == [clip.size]
    assert seen[0] == len(GROUPS)  # every chunk submitted before the first step: decoded in parallel
    assert r.token_ids == [t for e, _ in expected for t in e.token_ids]
    assert r.windows == sum(e.windows for e, _ in expected)
    segments = [s for _, segs in expected for s in segs]
    assert len(r.segments) == len(segments) > len(GROUPS)
    for ours, theirs in zip(r.segments, segments):
        assert ours["token_ids"] == theirs["token_ids"]
        # Both sides round to the ms; the offsets are whole samples (62.5 us steps).
        assert ours["start"] == pytest.approx(theirs["start"], abs=1.5e-3)
        assert ours["end"] == pytest.approx(theirs["end"], abs=1.5e-3)
    stats = llm.get_stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_the_first_chunk_s_language_is_given_to_the_others(whisper_ts, clip, monkeypatch):
    path, llm = whisper_ts
    first = _by_hand(llm, clip, REGIONS, GROUPS[:1], temperature=0.0)[0][0]
    assert first.language is not None
    rest = _by_hand(llm, clip, REGIONS, GROUPS[1:], temperature=0.0, language=first.language)
    seen = _in_flight(monkeypatch)
    r = llm.transcribe({"audio": clip, "sampling_rate": SR}, vad_filter=_stub(REGIONS), use_tqdm=False,
                       temperature=0.0)[0]
    assert r.error is None and r.language == first.language and r.segments is None
    assert r.token_ids == first.token_ids + [t for e, _ in rest for t in e.token_ids]
    assert seen[0] == 1 and max(seen) == len(GROUPS) - 1  # the first chunk alone, then the others together


def test_no_speech_bad_regions_and_bad_options(whisper_ts, clip):
    path, llm = whisper_ts
    short = synth_audio(5.0, seed=2)

    def detect(waveform, sample_rate):
        if waveform.size == short.size:
            return []  # no speech
        if waveform.size == clip.size:
            return [(0, 5 * SR), (4 * SR, 6 * SR)]  # overlapping
        return [(0, SR)]

    res = llm.transcribe([{"audio": short, "sampling_rate": SR}, {"audio": clip, "sampling_rate": SR},
                          {"audio": synth_audio(3.0, seed=3), "sampling_rate": SR}],
                         vad_filter=detect, language="en", timestamps=True, use_tqdm=False)
    assert res[0].error is None and res[0].token_ids == [] and res[0].segments == [] and res[0].windows == 0
    assert "(64000, 96000) starts before the previous one ends (80000)" in res[1].error
    assert res[2].error is None and res[2].windows >= 1
    bad = llm.transcribe(short, sampling_rate=SR, vad_filter=lambda w, sr: [(0, w.size + 1)], use_tqdm=False)[0]
    assert f"needs 0 <= start < end <= {short.size}" in bad.error
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['min_silence_ms'\]"):
        llm.transcribe(short, sampling_rate=SR, vad_filter=True, vad_parameters={"min_silence_ms": 10})
    with pytest.raises(ValueError, match="threshold=2: a speech probability"):
        llm.transcribe(short, sampling_rate=SR, vad_filter=True, vad_parameters={"threshold": 2})
    with pytest.raises(ValueError, match="vad_parameters without vad_filter=True"):
        llm.transcribe(short, sampling_rate=SR, vad_parameters={"threshold": 0.5})
    with pytest.raises(ValueError, match="with a callable vad_filter"):
        llm.transcribe(short, sampling_rate=SR, vad_filter=detect, vad_parameters={"threshold": 0.5})
    with pytest.raises(TypeError, match="vad_filter='yes'"):
        llm.transcribe(short, sampling_rate=SR, vad_filter="yes")


def test_with_the_option_off_no_vad_runs_and_nothing_changes(whisper_ts, clip, monkeypatch):
    import tandem.entrypoints.vad as vad

    path, llm = whisper_ts
    options = dict(language="en", timestamps=True, temperature=0.0, use_tqdm=False)
    clip = clip[: 50 * SR]
    default = llm.transcribe({"audio": clip, "sampling_rate": SR}, **options)[0]

    def boom(*args, **kwargs):
        raise AssertionError("the VAD ran with vad_filter off")

    monkeypatch.setattr(vad.SileroVad, "__init__", boom)
    monkeypatch.setattr(vad, "speech_regions_from_probs", boom)
    seen = _in_flight(monkeypatch)
    off = llm.transcribe({"audio": clip, "sampling_rate": SR}, vad_filter=False, **options)[0]
    assert off == default and off.windows >= 2
    assert max(seen) == 1  # sequential long-form: one window in flight


def _islands():
    """Speech islands Silero hears, in silence: 2-14 s, 17-40 s, 47-52 s of a 54 s input."""
    audio = np.zeros(54 * SR, np.float32)
    for k, (a, b) in enumerate([(2, 14), (17, 40), (47, 52)]):
        audio[a * SR : b * SR] = speechlike_audio(b - a, seed=k)
    return audio


def test_silero_regions_go_through_the_same_pipeline(whisper_ts):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("silero_vad")
    from tandem.entrypoints.vad import SileroVad, VadOptions

    path, llm = whisper_ts
    audio = _islands()
    params = {"speech_pad_ms": 100, "min_silence_duration_ms": 500}
    regions = SileroVad()(audio, VadOptions.from_dict(params, max_speech_duration_s=30.0))
    assert len(regions) >= 3
    options = dict(language="en", timestamps=True, temperature=0.0, use_tqdm=False)
    ours = llm.transcribe({"audio": audio, "sampling_rate": SR}, vad_filter=True, vad_parameters=params, **options)[0]
    stub = llm.transcribe({"audio": audio, "sampling_rate": SR}, vad_filter=lambda w, sr: regions, **options)[0]
    assert ours.error is None and ours == stub and ours.token_ids


def test_cli_vad_flags(whisper_ts, tmp_path, capsys, monkeypatch):
    import soundfile as sf

    from tandem.entrypoints import cli

    path, llm = whisper_ts
    main = cli.main
    monkeypatch.setattr(cli, "_llm", lambda args, model: llm)  # the fixture's engine: no second load
    audio = _islands()
    wav = tmp_path / "talk.wav"
    sf.write(wav, audio, SR, subtype="FLOAT")
    params = {"min_silence_duration_ms": 300}
    argv = ["transcribe", str(path), str(wav), "--format", "json", "--language", "en", "--timestamps",
            "--no-progress", "--dtype", "float32", "--device", "cpu", "--temperature", "0"]
    assert main(argv + ["--vad-filter", "--vad-parameters", json.dumps(params)]) == 0
    record = json.loads(capsys.readouterr().out)
    expected = llm.transcribe(str(wav), language="en", timestamps=True, temperature=0.0, vad_filter=True,
                              vad_parameters=params, use_tqdm=False)[0]
    assert record["token_ids"] == expected.token_ids and record["segments"] == expected.segments
    assert main(argv + ["--vad-parameters", json.dumps(params)]) == 2
    assert "--vad-parameters without --vad-filter" in capsys.readouterr().err
    assert main(argv + ["--vad-filter", "--vad-parameters", '{"pad": 1}']) == 2
    assert "unknown key(s) ['pad']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(argv + ["--vad-filter", "--vad-parameters", "[1]"])
    assert "must be a JSON object" in capsys.readouterr().err


def test_vad_that_removes_all_audio_warns(whisper_ts, tmp_path, capsys, caplog, monkeypatch):
    """Silero's --vad-filter on audio with no speech: the transcript is empty, and a warning
    names the input and says why (before, nothing said the audio had all been dropped)."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("silero_vad")
    import logging

    import soundfile as sf

    from tandem.entrypoints import cli

    path, llm = whisper_ts
    monkeypatch.setattr(cli, "_llm", lambda args, model: llm)
    wav = tmp_path / "quiet.wav"
    sf.write(wav, np.zeros(4 * SR, np.float32), SR, subtype="FLOAT")
    said = f"vad_filter found no speech in {str(wav)!r} (4.0 s): its transcript is empty"
    with caplog.at_level(logging.WARNING, logger="tandem.transcribe"):
        r = llm.transcribe(str(wav), language="en", vad_filter=True, use_tqdm=False)[0]
    assert r.error is None and r.text == "" and r.windows == 0
    warnings = [rec.getMessage() for rec in caplog.records if rec.name == "tandem.transcribe"]
    assert len(warnings) == 1 and said in warnings[0]
    capsys.readouterr()
    assert cli.main(["transcribe", str(path), str(wav), "--language", "en", "--no-progress", "--vad-filter",
                     "--dtype", "float32", "--device", "cpu"]) == 0
    out, err = capsys.readouterr()
    assert out == f"{wav}\t\n" and said in err  # the CLI's log line, on stderr


@pytest.mark.asyncio
async def test_server_vad_filter_field(whisper_ts):
    import httpx
    import soundfile as sf

    from tandem import AsyncLLM
    from tandem.entrypoints.openai.api_server import build_app

    pytest.importorskip("silero_vad")
    path, llm = whisper_ts
    audio = _islands()
    buf = io.BytesIO()
    sf.write(buf, audio, SR, format="WAV", subtype="FLOAT")
    engine = AsyncLLM(model=str(path), dtype="float32", device="cpu")
    try:
        app = build_app(engine, served_model_name="w")
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=120) as c:
            async def post(**fields):
                return await c.post("/v1/audio/transcriptions", files={"file": ("a.wav", buf.getvalue())},
                                    data={"language": "en", "temperature": "0", **fields})

            r = await post(vad_filter="true", response_format="verbose_json",
                           vad_parameters=json.dumps({"speech_pad_ms": 200}))
            assert r.status_code == 200, r.text
            expected = llm.transcribe(audio, sampling_rate=SR, language="en", timestamps=True, temperature=0.0,
                                      vad_filter=True, vad_parameters={"speech_pad_ms": 200}, use_tqdm=False)[0]
            body = r.json()
            assert [s["tokens"] for s in body["segments"]] == [s["token_ids"] for s in expected.segments]
            assert [(s["start"], s["end"]) for s in body["segments"]] == [(s["start"], s["end"])
                                                                         for s in expected.segments]
            stream = await post(vad_filter="true", stream="true")
            events = [json.loads(line[6:]) for line in stream.text.splitlines()
                      if line.startswith("data: {")]
            deltas = [e for e in events if e["type"] == "transcript.text.delta"]
            assert len(deltas) >= 2 and events[-1]["type"] == "transcript.text.done"  # one delta per chunk
            for fields, message in [({"vad_filter": "yes"}, "vad_filter='yes': must be true or false"),
                                    ({"vad_filter": "true", "vad_parameters": '{"x": 1}'}, "unknown key(s) ['x']"),
                                    ({"vad_filter": "true", "vad_parameters": "{"}, "must be a JSON object"),
                                    ({"vad_parameters": "{}"}, "vad_parameters without vad_filter=true")]:
                bad = await post(**fields)
                assert bad.status_code == 400 and message in bad.json()["error"]["message"], bad.text
    finally:
        await engine.shutdown(timeout=60)
