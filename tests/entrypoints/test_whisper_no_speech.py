"""``no_speech_threshold`` and ``initial_prompt`` against HF's Whisper ``generate``:
silent windows skipped as HF skips them (long-form, tiny random checkpoint with
timestamp tokens), the no-speech probability equal to HF's, and a text prompt
equal to HF's ``prompt_ids`` (the demo checkpoint, which has a tokenizer)."""

import math

import numpy as np

import pytest
import torch

from helpers import WHISPER_TS_IDS as I
from helpers import make_whisper, synth_audio
from tandem import LLM
from tandem.model_zoo.whisper.transcription import WhisperTranscription


@pytest.fixture(scope="module")
def whisper_ts(tmp_path_factory):
    path = make_whisper(tmp_path_factory.mktemp("whisper_ns") / "ckpt", num_mel_bins=80, seed=3, timestamps=True)
    return path, LLM(model=str(path), dtype="float32", device="cpu")


def _hf(path):
    from transformers import WhisperForConditionalGeneration

    return WhisperForConditionalGeneration.from_pretrained(path).eval()


def _long_features(clip):
    from transformers import WhisperFeatureExtractor

    return WhisperFeatureExtractor(feature_size=80)(clip, sampling_rate=16000, return_tensors="pt", truncation=False,
                                                     padding="longest", return_attention_mask=True)


def _clip():
    """Speech-like audio, 40 s of silence, speech again: 105 s, four or more windows."""
    return np.concatenate([synth_audio(35.0, seed=1), np.zeros(16000 * 40, np.float32), synth_audio(30.0, seed=2)])


# float32 logits from two implementations differ by ~1e-6 (layer sums of 32-wide rows
# over a 1659-token vocabulary); a probability near 1e-4 then moves by ~1e-10, so a
# relative 1e-4 bounds both the comparison and the margin no decision may fall within.
REL = 1e-4


def test_no_speech_probability_is_hf_s(whisper_ts):
    path, llm = whisper_ts
    clip = _clip()
    r = llm.transcribe({"audio": clip, "sampling_rate": 16000}, language="en", timestamps=True, use_tqdm=False,
                       temperature=0.0, no_speech_threshold=2.0, logprob_threshold=0.0)[0]
    # HF's WhisperNoSpeechDetection: the model run on the window's decoder prompt,
    # softmax of the logits at <|startoftranscript|>, at <|notimestamps|> - 1.
    f = _long_features(clip).input_features[:, :, :3000]
    with torch.no_grad():
        logits = _hf(path)(input_features=f, decoder_input_ids=torch.tensor([[I["sot"], I["en"], I["transcribe"]]])).logits
    expected = float(logits[0, 0].float().softmax(-1)[I["notimestamps"] - 1])
    assert r.segments[0]["no_speech_prob"] == pytest.approx(expected, rel=REL)
    # A threshold above every probability skips nothing: the plain run's result.
    plain = llm.transcribe({"audio": clip, "sampling_rate": 16000}, language="en", timestamps=True, use_tqdm=False,
                           temperature=0.0)[0]
    assert r.token_ids == plain.token_ids and r.windows == plain.windows


def test_windows_skipped_as_hf_skips_them(whisper_ts, monkeypatch):
    path, llm = whisper_ts
    clip = _clip()
    common = dict(language="en", timestamps=True, use_tqdm=False, temperature=0.0, logprob_threshold=0.0)
    measured = llm.transcribe({"audio": clip, "sampling_rate": 16000}, no_speech_threshold=2.0, **common)[0]
    probs = sorted({s["no_speech_prob"] for s in measured.segments})
    assert len(probs) >= 3
    # Random weights make the probabilities arbitrary: a threshold among them skips some windows.
    threshold = (probs[len(probs) // 2 - 1] + probs[len(probs) // 2]) / 2

    decisions = []
    is_silence = WhisperTranscription._is_silence

    def spy(self, no_speech_prob, avg_logprob):
        skip = is_silence(self, no_speech_prob, avg_logprob)
        decisions.append((no_speech_prob, avg_logprob, skip))
        return skip

    monkeypatch.setattr(WhisperTranscription, "_is_silence", spy)
    r = llm.transcribe({"audio": clip, "sampling_rate": 16000}, no_speech_threshold=threshold, **common)[0]
    assert r.error is None
    skips = [d[2] for d in decisions]
    assert any(skips) and not all(skips), decisions
    assert all(abs(p - threshold) > REL * threshold for p, _, _ in decisions)  # no decision within float noise
    assert all(lp < 0.0 for _, lp, _ in decisions)  # logprob_threshold=0.0: the probability decides

    f = _long_features(clip)
    with torch.no_grad():
        out = _hf(path).generate(f.input_features, attention_mask=f.attention_mask, language="en", task="transcribe",
                                 return_timestamps=True, return_segments=True, temperature=0.0,
                                 no_speech_threshold=threshold, logprob_threshold=0.0)
    theirs = [(float(s["start"]), float(s["end"]), s["tokens"].tolist()) for s in out["segments"][0]]
    assert len(r.segments) == len(theirs) > 0
    for seg, (start, end, tokens) in zip(r.segments, theirs):
        assert seg["token_ids"] == tokens
        assert seg["start"] == pytest.approx(start, abs=1e-3) and seg["end"] == pytest.approx(end, abs=1e-3)
    assert r.token_ids != measured.token_ids  # the skipped windows' text is gone


def test_english_only_with_timestamps_as_hf(tmp_path, monkeypatch):
    """An English-only checkpoint with timestamps: the decoder prompt is
    ``<|startoftranscript|>`` alone, and HF reads the no-speech probability from the
    first generated step's scores, before any processor (the raw logits there); tandem
    recomputes those logits on the model. Probabilities and skipped windows equal HF's."""
    import json

    path = make_whisper(tmp_path / "ckpt", num_mel_bins=80, seed=3, timestamps=True)
    gen_file = path / "generation_config.json"
    gen = json.loads(gen_file.read_text())  # as openai/whisper-*.en's: no language or task tokens
    del gen["lang_to_id"], gen["task_to_id"]
    gen["is_multilingual"] = False
    gen_file.write_text(json.dumps(gen))
    llm = LLM(model=str(path), dtype="float32", device="cpu")
    clip = _clip()
    common = dict(timestamps=True, use_tqdm=False, temperature=0.0, logprob_threshold=0.0)
    measured = llm.transcribe({"audio": clip, "sampling_rate": 16000}, no_speech_threshold=2.0, **common)[0]
    assert measured.error is None and measured.language == "en"
    f = _long_features(clip)
    model = _hf(path)
    with torch.no_grad():
        logits = model(input_features=f.input_features[:, :, :3000],
                       decoder_input_ids=torch.tensor([[I["sot"]]])).logits
    expected = float(logits[0, 0].float().softmax(-1)[I["notimestamps"] - 1])
    assert measured.segments[0]["no_speech_prob"] == pytest.approx(expected, rel=REL)
    probs = sorted({s["no_speech_prob"] for s in measured.segments})
    assert len(probs) >= 3
    threshold = (probs[len(probs) // 2 - 1] + probs[len(probs) // 2]) / 2

    decisions = []
    is_silence = WhisperTranscription._is_silence

    def spy(self, no_speech_prob, avg_logprob):
        decisions.append((no_speech_prob, is_silence(self, no_speech_prob, avg_logprob)))
        return decisions[-1][1]

    monkeypatch.setattr(WhisperTranscription, "_is_silence", spy)
    r = llm.transcribe({"audio": clip, "sampling_rate": 16000}, no_speech_threshold=threshold, **common)[0]
    assert r.error is None
    assert any(d for _, d in decisions) and not all(d for _, d in decisions), decisions
    assert all(abs(p - threshold) > REL * threshold for p, _ in decisions)  # no decision within float noise
    with torch.no_grad():
        out = model.generate(f.input_features, attention_mask=f.attention_mask, return_timestamps=True,
                             return_segments=True, temperature=0.0, no_speech_threshold=threshold,
                             logprob_threshold=0.0)
    theirs = [(float(s["start"]), float(s["end"]), s["tokens"].tolist()) for s in out["segments"][0]]
    assert len(r.segments) == len(theirs) > 0
    for seg, (start, end, tokens) in zip(r.segments, theirs):
        assert seg["token_ids"] == tokens
        assert seg["start"] == pytest.approx(start, abs=1e-3) and seg["end"] == pytest.approx(end, abs=1e-3)
    assert r.token_ids != measured.token_ids  # the skipped windows' text is gone


def test_no_speech_threshold_without_logprob_threshold_skips_on_the_probability(whisper_ts):
    _, llm = whisper_ts
    clip = synth_audio(12.0, seed=5)
    kw = dict(language="en", timestamps=True, use_tqdm=False, temperature=0.0)
    # Every probability is above -1 and below 2: faster-whisper's rule skips on it alone.
    assert llm.transcribe({"audio": clip, "sampling_rate": 16000}, no_speech_threshold=-1.0, **kw)[0].token_ids == []
    assert llm.transcribe({"audio": clip, "sampling_rate": 16000}, no_speech_threshold=2.0, **kw)[0].token_ids


def test_bad_no_speech_threshold_is_an_error(whisper_ts):
    _, llm = whisper_ts
    with pytest.raises(ValueError, match="no_speech_threshold='high'"):
        llm.transcribe({"audio": synth_audio(1.0), "sampling_rate": 16000}, no_speech_threshold="high", use_tqdm=False)


@pytest.fixture(scope="module")
def demo():
    from tandem.demo_whisper import PATH

    return PATH, LLM(model=str(PATH), dtype="float32", device="cpu")


def test_initial_prompt_is_hf_s_prompt_ids(demo):
    from transformers import AutoTokenizer, WhisperFeatureExtractor

    from tandem.demo_whisper import synthesize

    path, llm = demo
    audio = synthesize("three one four")
    text = "  hello world yes "
    r = llm.transcribe({"audio": audio, "sampling_rate": 16000}, language="en", initial_prompt=text, use_tqdm=False)[0]
    tok = AutoTokenizer.from_pretrained(path)
    as_ids = llm.transcribe({"audio": audio, "sampling_rate": 16000}, language="en", use_tqdm=False,
                            prompt_ids=tok(" " + text.strip(), add_special_tokens=False)["input_ids"])[0]
    assert r.error is None and r.token_ids == as_ids.token_ids
    f = WhisperFeatureExtractor.from_pretrained(path)(audio, sampling_rate=16000, return_tensors="pt").input_features
    prompt_ids = torch.tensor(tok.get_prompt_ids(text))  # HF's: <|startofprev|> + " " + stripped text
    with torch.no_grad():
        seq = _hf(path).generate(f, language="en", task="transcribe", prompt_ids=prompt_ids)[0].tolist()
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    assert r.token_ids == [t for t in seq if t != eos]  # HF returns the generated tokens (short-form)
    without = llm.transcribe({"audio": audio, "sampling_rate": 16000}, language="en", use_tqdm=False)[0]
    assert without.token_ids != r.token_ids  # the prompt changed the output: it was seen


def test_initial_prompt_and_prompt_ids_together_is_an_error(demo):
    _, llm = demo
    with pytest.raises(ValueError, match="initial_prompt and prompt_ids"):
        llm.transcribe({"audio": np.zeros(16000, np.float32), "sampling_rate": 16000}, initial_prompt="hi",
                       prompt_ids=[1, 2], use_tqdm=False)


def test_initial_prompt_needs_a_tokenizer(whisper_ts):
    _, llm = whisper_ts
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.transcribe({"audio": synth_audio(1.0), "sampling_rate": 16000}, initial_prompt="hi", use_tqdm=False)


def _transcribe_command(path, tmp_path, *flags):
    """``tandem transcribe --format json --timestamps`` with ``flags`` on the demo's
    "three one four", and the WAV it wrote."""
    import json
    import subprocess
    import sys

    import soundfile as sf

    from tandem.demo_whisper import synthesize

    wav = tmp_path / "say.wav"
    sf.write(wav, synthesize("three one four"), 16000)
    res = subprocess.run(
        [sys.executable, "-m", "tandem.entrypoints.cli", "transcribe", str(path), str(wav), "--format", "json",
         "--timestamps", "--no-progress", "--dtype", "float32", "--device", "cpu", *flags],
        capture_output=True, text=True,
    )
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout), wav


def test_transcribe_command_flags(demo, tmp_path):
    path, llm = demo
    got, wav = _transcribe_command(path, tmp_path, "--initial-prompt", "three", "--no-speech-threshold", "2",
                                   "--logprob-threshold", "0")
    want = llm.transcribe(str(wav), timestamps=True, initial_prompt="three", no_speech_threshold=2.0,
                          logprob_threshold=0.0, use_tqdm=False)[0]
    assert got["token_ids"] == want.token_ids
    # Equal but for no_speech_prob, a softmax of float32 logits: this engine may reuse cached
    # keys and values (encoder and prefix caches) computed in another step's batch, whose
    # GEMM blocking rounds differently (~1e-6 relative on O(10) logits, so ~1e-5 relative on
    # the probability); 1e-4 leaves a 10x margin.
    assert [{**s, "no_speech_prob": None} for s in got["segments"]] == [
        {**s, "no_speech_prob": None} for s in want.segments]
    for a, b in zip(got["segments"], want.segments):
        assert math.isclose(a["no_speech_prob"], b["no_speech_prob"], rel_tol=1e-4, abs_tol=1e-12)
    assert got["segments"] and all(0.0 <= s["no_speech_prob"] <= 1.0 for s in got["segments"])


# Slow: a second start of the command. The test above checks the flags reach the engine; the
# tests of the thresholds skipping windows run in process.
@pytest.mark.slow
def test_transcribe_command_thresholds_that_skip_every_window(demo, tmp_path):
    # A threshold below every probability, with a log-probability bound every window is under: all skipped.
    silent, _ = _transcribe_command(demo[0], tmp_path, "--no-speech-threshold", "-1", "--logprob-threshold", "1")
    assert silent["token_ids"] == [] and silent["text"] == ""
