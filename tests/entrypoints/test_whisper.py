"""Whisper on the shared engine against HF: tiny random checkpoints (80 and 128 mel
bins), clips of different lengths batched, explicit decoder prompts, language
detection, and bad audio failing alone."""

import numpy as np
import pytest
import torch

from helpers import WHISPER_IDS as I
from helpers import make_whisper, synth_audio
from tandem import LLM, SamplingParams

LENGTHS = [1.5, 7.0, 29.5, 12.3, 0.4]


def slow_case(name: str) -> bool:
    """The command's path does not depend on the mel bins: the default run starts it on 80
    (tests/conftest.py)."""
    return name == "test_transcribe_command[128]"


@pytest.fixture(scope="module", params=[80, 128])
def whisper(request, tmp_path_factory):
    path = make_whisper(tmp_path_factory.mktemp(f"whisper{request.param}") / "ckpt", num_mel_bins=request.param,
                        seed=request.param)
    return path, LLM(model=str(path), dtype="float32", device="cpu")


def _hf(path):
    from transformers import WhisperForConditionalGeneration

    return WhisperForConditionalGeneration.from_pretrained(path).eval()


def _features(path, clip):
    from transformers import WhisperFeatureExtractor

    n = _hf(path).config.num_mel_bins
    return WhisperFeatureExtractor(feature_size=n)(clip, sampling_rate=16000, return_tensors="pt").input_features


def _hf_greedy(path, clip, decoder, **kwargs):
    """HF's generate from explicit decoder ids with the checkpoint's suppress settings
    (what HF's Whisper generate runs for short-form audio once its prompt is built)."""
    from transformers.generation.utils import GenerationMixin

    model = _hf(path)
    with torch.no_grad():
        out = GenerationMixin.generate(
            model, input_features=_features(path, clip), decoder_input_ids=torch.tensor([decoder]),
            do_sample=False, num_beams=1, **kwargs,
        )
    return out[0, len(decoder):].tolist()


def test_clips_of_different_lengths_batched_equal_hf(whisper):
    path, llm = whisper
    clips = [synth_audio(s, seed=i) for i, s in enumerate(LENGTHS)]
    decoder = [I["sot"], I["en"], I["transcribe"], I["notimestamps"]]
    res = llm.transcribe([{"audio": c, "sampling_rate": 16000} for c in clips], language="en", use_tqdm=False)
    for clip, r in zip(clips, res):
        assert r.error is None and r.language == "en"
        ref = _hf_greedy(path, clip, decoder)
        assert r.token_ids == ref[: len(r.token_ids)] and len(r.token_ids) == len(ref)
        # The checkpoint's suppress_tokens, and begin_suppress_tokens at the first position.
        assert not {5, 7, 11} & set(r.token_ids) and r.token_ids[0] not in (I["eos"], 20)
    assert len({tuple(r.token_ids) for r in res}) > 1


def test_language_is_detected_as_hf_does(whisper):
    path, llm = whisper
    model = _hf(path)
    clips = [synth_audio(s, seed=10 + i) for i, s in enumerate(LENGTHS)]
    before = llm.get_stats()
    res = llm.transcribe(clips, sampling_rate=16000, use_tqdm=False)
    codes = {I["en"]: "en", I["de"]: "de", I["fr"]: "fr"}
    stats = llm.get_stats()
    for clip, r in zip(clips, res):
        with torch.no_grad():
            lang = int(model.detect_language(_features(path, clip)))
        assert r.language == codes[lang]
        ref = _hf_greedy(path, clip, [I["sot"], lang, I["transcribe"], I["notimestamps"]])
        assert r.token_ids == ref
    # One encoder run per clip (detection and transcription are one request), each over
    # the encoder's output positions (a 30 s window: 3000 frames, 1500 after its stride-2 conv).
    positions = llm.engine.hf_config.max_source_positions
    assert positions == 1500
    assert stats["encoder_tokens_computed"] - before["encoder_tokens_computed"] == len(clips) * positions
    assert stats["encoder_tokens_reused"] == before["encoder_tokens_reused"]  # five different clips
    assert stats["num_requests_finished"] - before["num_requests_finished"] == len(clips)
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_explicit_decoder_prompt_with_previous_text_is_honoured(whisper):
    path, llm = whisper
    clip = synth_audio(5.0, seed=3)
    decoder = [I["prev"], 40, 41, 42, I["sot"], I["de"], I["translate"], I["notimestamps"]]
    out = llm.generate({"encoder_prompt": {"audio": clip, "sampling_rate": 16000},
                        "decoder_prompt": {"prompt_token_ids": decoder}},
                       SamplingParams(temperature=0.0, max_tokens=20, suppress_tokens=[], begin_suppress_tokens=[]),
                       use_tqdm=False)[0]
    assert out.error is None and out.prompt_token_ids == decoder
    assert out.outputs[0].token_ids == _hf_greedy(path, clip, decoder, max_new_tokens=20)


def test_resampled_stereo_file_input(whisper, tmp_path):
    import soundfile as sf

    path, llm = whisper
    mono = synth_audio(4.0, seed=5, sr=44100)
    wav = tmp_path / "clip.wav"
    sf.write(wav, np.stack([mono, mono], axis=1), 44100)
    from_file = llm.transcribe(str(wav), language="en", use_tqdm=False)[0]
    from_array = llm.transcribe({"audio": mono, "sampling_rate": 44100}, language="en", use_tqdm=False)[0]
    assert from_file.error is None and from_file.token_ids == from_array.token_ids


def test_bad_audio_fails_alone(whisper, tmp_path):
    path, llm = whisper
    good = synth_audio(3.0, seed=7)
    nan = good.copy()
    nan[100] = np.nan
    res = llm.transcribe(
        [str(tmp_path / "missing.wav"), {"audio": good, "sampling_rate": 16000}, {"audio": np.zeros(0), "sampling_rate": 16000},
         {"audio": nan, "sampling_rate": 16000}, {"audio": good, "sampling_rate": 0}, {"audio": good},
         {"audio": synth_audio(31.0), "sampling_rate": 16000}],
        language="en", use_tqdm=False,
    )
    assert "missing.wav" in res[0].error
    assert res[1].error is None and res[1].token_ids
    assert "empty" in res[2].error or "0 samples" in res[2].error
    assert "NaN" in res[3].error or "nan" in res[3].error.lower()
    assert "sampling_rate" in res[4].error
    assert "sampling_rate" in res[5].error
    assert res[6].error is None and res[6].windows >= 2  # over 30 s: long-form, window by window
    out = llm.generate({"encoder_prompt": {"audio": synth_audio(31.0), "sampling_rate": 16000}}, use_tqdm=False)[0]
    assert "30 s" in out.error and "transcribe" in out.error
    with pytest.raises(ValueError, match="language='xx'"):
        llm.transcribe(good, sampling_rate=16000, language="xx")
    with pytest.raises(ValueError, match="task="):
        llm.transcribe(good, sampling_rate=16000, task="summarize")
    # Text is not an encoder prompt for Whisper; the error says what is.
    out = llm.generate({"prompt_token_ids": [5, 6]}, use_tqdm=False)[0]
    assert "encoder prompt is audio" in out.error


def test_transcribe_command(whisper, tmp_path):
    import json
    import subprocess
    import sys

    import soundfile as sf

    path, llm = whisper
    clip = synth_audio(6.0, seed=9)
    wav, flac = tmp_path / "a.wav", tmp_path / "b.flac"
    sf.write(wav, clip, 16000)
    sf.write(flac, clip, 16000)
    res = subprocess.run(
        [sys.executable, "-m", "tandem.entrypoints.cli", "transcribe", str(path), str(wav), str(flac),
         str(tmp_path / "gone.wav"), "--format", "json", "--language", "de", "--no-progress",
         "--dtype", "float32", "--device", "cpu"],  # the fixture's: "auto" is bfloat16 on a bf16 CPU
        capture_output=True, text=True,
    )
    assert res.returncode == 1, res.stderr  # one file failed
    records = [json.loads(line) for line in res.stdout.splitlines()]
    assert [r["file"] for r in records] == [str(wav), str(flac), str(tmp_path / "gone.wav")]
    expected = llm.transcribe({"audio": clip, "sampling_rate": 16000}, language="de", use_tqdm=False)[0]
    assert records[0]["token_ids"] == records[1]["token_ids"] == expected.token_ids
    assert records[0]["language"] == "de" and "gone.wav" in records[2]["error"]


@pytest.fixture(scope="module")
def whisper_ts(tmp_path_factory):
    """A checkpoint whose vocabulary has Whisper's 1501 timestamp tokens."""
    path = make_whisper(tmp_path_factory.mktemp("whisper_ts") / "ckpt", num_mel_bins=80, seed=3, timestamps=True)
    return path, LLM(model=str(path), dtype="float32", device="cpu")


def _hf_segments(path, clip, **kwargs):
    """HF's Whisper generate with timestamps: short-form (<= 30 s, padded features) or
    long-form (the whole input's features and attention mask), as its docs show."""
    from transformers import WhisperFeatureExtractor

    fe = WhisperFeatureExtractor(feature_size=80)
    if len(clip) <= 480000:
        f, extra = fe(clip, sampling_rate=16000, return_tensors="pt"), {}
    else:
        f = fe(clip, sampling_rate=16000, return_tensors="pt", truncation=False, padding="longest",
               return_attention_mask=True)
        extra = {"attention_mask": f.attention_mask}
    with torch.no_grad():
        out = _hf(path).generate(f.input_features, task="transcribe", return_timestamps=True, return_segments=True,
                                 **extra, **kwargs)
    return [(float(s["start"]), float(s["end"]), s["tokens"].tolist()) for s in out["segments"][0]]


def _assert_segments(ours, theirs):
    assert len(ours.segments) == len(theirs) > 0
    for seg, (start, end, tokens) in zip(ours.segments, theirs):
        assert seg["token_ids"] == tokens
        assert seg["start"] == pytest.approx(start, abs=1e-3) and seg["end"] == pytest.approx(end, abs=1e-3)
    assert ours.token_ids == [t for _, _, toks in theirs for t in toks]


def test_timestamps_and_long_form_equal_hf(whisper_ts):
    """A 2-minute input and shorter ones, together: each decodes window by window
    (one window per input in flight) and equals HF's segments, times and tokens."""
    path, llm = whisper_ts
    clips = [synth_audio(120.0, seed=1), synth_audio(12.0, seed=2), synth_audio(47.5, seed=3)]
    res = llm.transcribe([{"audio": c, "sampling_rate": 16000} for c in clips], language="en", timestamps=True,
                         use_tqdm=False)
    for clip, r in zip(clips, res):
        assert r.error is None
        _assert_segments(r, _hf_segments(path, clip, language="en"))
    assert res[0].windows >= 4  # 120 s: at least four 30 s windows
    # The seek rule: each window starts where the previous one's last complete segment ended.
    starts = [s["start"] for s in res[0].segments]
    assert starts == sorted(starts)
    stats = llm.get_stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_long_form_detects_the_language_once(whisper_ts):
    path, llm = whisper_ts
    clip = synth_audio(65.0, seed=4)
    r = llm.transcribe({"audio": clip, "sampling_rate": 16000}, timestamps=True, use_tqdm=False)[0]
    _assert_segments(r, _hf_segments(path, clip))
    from transformers import WhisperFeatureExtractor

    f = WhisperFeatureExtractor(feature_size=80)(clip, sampling_rate=16000, return_tensors="pt", truncation=False,
                                                  padding="longest")
    with torch.no_grad():
        lang = int(_hf(path).detect_language(f.input_features[:, :, :3000]))
    assert r.language == {v: k.strip("<|>") for k, v in {"<|en|>": 151, "<|de|>": 152, "<|fr|>": 153}.items()}[lang]


def test_temperature_fallback_decodes_a_window_again(whisper_ts):
    path, llm = whisper_ts
    clip = synth_audio(10.0, seed=6)
    plain = llm.transcribe({"audio": clip, "sampling_rate": 16000}, language="en", timestamps=True, use_tqdm=False)[0]
    # A compression-ratio threshold nothing meets: every window falls back through all temperatures.
    r = llm.transcribe({"audio": clip, "sampling_rate": 16000}, language="en", timestamps=True, use_tqdm=False,
                       temperature=(0.0, 0.4, 0.8), compression_ratio_threshold=0.0, seed=3)[0]
    # Each window is decoded at the three temperatures and the last decode stands, so the
    # run is the one at 0.8 alone (each window's request draws from its own seed), three times over.
    last = llm.transcribe({"audio": clip, "sampling_rate": 16000}, language="en", timestamps=True, use_tqdm=False,
                          temperature=(0.8,), compression_ratio_threshold=0.0, seed=3)[0]
    assert r.error is None and last.error is None
    assert r.token_ids == last.token_ids and r.segments == last.segments
    assert r.windows == 3 * last.windows and last.windows >= 1
    # Without a threshold crossed, the first temperature's (greedy) result stands.
    same = llm.transcribe({"audio": clip, "sampling_rate": 16000}, language="en", timestamps=True, use_tqdm=False,
                          temperature=(0.0, 0.4), compression_ratio_threshold=1e9)[0]
    assert same.token_ids == plain.token_ids and same.windows == plain.windows


def test_transcribe_command_writes_subtitles(whisper_ts, tmp_path):
    import subprocess
    import sys

    import soundfile as sf

    path, llm = whisper_ts
    clip = synth_audio(8.0, seed=11)
    wav = tmp_path / "talk.wav"
    sf.write(wav, clip, 16000)
    out_dir = tmp_path / "subs"
    for fmt in ("srt", "vtt"):
        res = subprocess.run(
            [sys.executable, "-m", "tandem.entrypoints.cli", "transcribe", str(path), str(wav), "--format", fmt,
             "--language", "en", "--output-dir", str(out_dir), "--no-progress", "--dtype", "float32", "--device", "cpu"],
            capture_output=True, text=True,
        )
        assert res.returncode == 0, res.stderr
    segments = llm.transcribe(str(wav), language="en", timestamps=True, use_tqdm=False)[0].segments
    srt = (out_dir / "talk.srt").read_text().split("\n\n")
    vtt = (out_dir / "talk.vtt").read_text()
    assert vtt.startswith("WEBVTT\n\n")
    assert len([c for c in srt if c.strip()]) == len(segments)

    def ms(stamp):
        h, m, rest = stamp.replace(",", ".").split(":")
        return round((int(h) * 3600 + int(m) * 60 + float(rest)) * 1000)

    first = srt[0].splitlines()
    assert first[0] == "1"
    start, end = first[1].split(" --> ")
    assert (ms(start), ms(end)) == (round(segments[0]["start"] * 1000), round(segments[0]["end"] * 1000))
    res = subprocess.run([sys.executable, "-m", "tandem.entrypoints.cli", "transcribe", str(path), str(wav), str(wav),
                          "--format", "srt"], capture_output=True, text=True)
    assert res.returncode == 2 and "--output-dir" in res.stderr


def test_generate_without_a_decoder_prompt_builds_hf_s_default(whisper):
    """HF's Whisper generate with no language or task: <|startoftranscript|>, the
    detected language, <|notimestamps|> (no task token)."""
    path, llm = whisper
    clip = synth_audio(9.0, seed=21)
    out = llm.generate({"audio": clip, "sampling_rate": 16000}, use_tqdm=False)[0]
    with torch.no_grad():
        lang = int(_hf(path).detect_language(_features(path, clip)))
    assert out.prompt_token_ids == [I["sot"], lang, I["notimestamps"]]
    assert out.outputs[0].token_ids == _hf_greedy(path, clip, out.prompt_token_ids)
