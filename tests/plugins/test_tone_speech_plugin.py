"""The out-of-tree ``tandem-tone-speech`` package: a speech model of its own type, installed
with pip, found through its entry point and served by ``LLM.transcribe``, ``tandem
transcribe`` and ``/v1/audio/transcriptions`` with no change in tandem. The oracle is HF
``WhisperForConditionalGeneration`` holding the same weights, decoding greedily from
features computed here with numpy, one window at a time."""

import asyncio
import io
import json
import subprocess
import sys

import httpx
import numpy as np
import pytest
import torch

from helpers import installed_example, make_tokenizer, synth_audio
from tandem import LLM, AsyncLLM
from tandem.core.transcription import TranscriptionContext, supports_transcription
from tandem.plugins import default_model_registry, plugin_manager

ARCH = "ToneSpeechForConditionalGeneration"
VOCAB, START, EOS = 64, 0, 2  # make_tokenizer's <s> starts, </s> ends
POSITIONS, BANDS, MAX_NEW = 50, 16, 10  # a 1 s window of 100 frames of 10 ms
WINDOW = 2 * POSITIONS * 160
CLIPS = [0.45, 2.5, 1.0, 3.2]  # seconds: one window, three (the last partial), exactly one, four


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    with installed_example("tandem-tone-speech", "tandem_tone_speech", tmp_path_factory.mktemp("pkg"), ("tone_speech",)):
        yield


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A random tone-speech checkpoint, written as HF Whisper weights under the plugin's
    model_type and architecture, and the HF model that holds the same weights."""
    from transformers import GenerationConfig, WhisperConfig, WhisperForConditionalGeneration

    path = tmp_path_factory.mktemp("tone") / "ckpt"
    torch.manual_seed(5)
    config = WhisperConfig(
        vocab_size=VOCAB, num_mel_bins=BANDS, d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
        max_source_positions=POSITIONS, max_target_positions=32, pad_token_id=1, bos_token_id=START,
        eos_token_id=EOS, decoder_start_token_id=START, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        suppress_tokens=None, begin_suppress_tokens=None,
    )
    hf = WhisperForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.dim() == 2 and "embed_positions" not in name:
                p.normal_(0.0, 0.5)
    hf.save_pretrained(path)
    GenerationConfig(decoder_start_token_id=START, eos_token_id=EOS, pad_token_id=1, bos_token_id=START,
                     max_length=32).save_pretrained(path)
    make_tokenizer(VOCAB).save_pretrained(path)
    raw = json.loads((path / "config.json").read_text())
    raw.update(model_type="tone_speech", architectures=[ARCH])
    (path / "config.json").write_text(json.dumps(raw))
    return path, hf


def _bands(window: np.ndarray) -> np.ndarray:
    """The plugin's features, written again: log10 band energies of 10 ms frames."""
    padded = np.zeros(WINDOW, dtype=np.float64)
    padded[: len(window)] = window
    power = np.abs(np.fft.rfft(padded.reshape(-1, 160), axis=-1)) ** 2
    bands = power[:, 1:81].reshape(power.shape[0], BANDS, -1).mean(axis=-1)
    return np.log10(np.maximum(bands, 1e-10)).T


def _oracle(hf, clip: np.ndarray, **budget) -> list[list[int]]:
    """HF's greedy tokens of each window of ``clip`` (</s> dropped); ``budget``: HF's
    ``max_new_tokens`` or ``max_length`` (default: MAX_NEW new tokens)."""
    from transformers.generation.utils import GenerationMixin

    windows = []
    for start in range(0, len(clip), WINDOW):
        features = torch.tensor(_bands(clip[start : start + WINDOW]), dtype=torch.float32)[None]
        with torch.no_grad():
            out = GenerationMixin.generate(hf, input_features=features, decoder_input_ids=torch.tensor([[START]]),
                                           do_sample=False, num_beams=1, **(budget or {"max_new_tokens": MAX_NEW}))
        tokens = out[0, 1:].tolist()
        windows.append(tokens[:-1] if tokens and tokens[-1] == EOS else tokens)
    return windows


@pytest.fixture(scope="module")
def clips():
    return [synth_audio(s, seed=30 + i) for i, s in enumerate(CLIPS)]


def test_the_plugin_declares_transcription(installed, checkpoint):
    info = plugin_manager().plugins["tandem-tone-speech"]
    assert info.models == [ARCH] and info.value == "tandem_tone_speech.plugin"
    cls, arch = default_model_registry().resolve([ARCH])
    assert arch == ARCH and cls.__module__ == "tandem_tone_speech.model"
    assert supports_transcription(cls)
    llm = LLM(model=str(checkpoint[0]), dtype="float32", device="cpu")
    assert llm.engine.model_cls is cls
    assert cls.transcription_window_seconds(llm.engine.hf_config) == 1.0
    assert cls.transcription_languages(TranscriptionContext.from_engine(llm.engine)) == ("en",)


def test_llm_transcribe_equals_hf_window_by_window(installed, checkpoint, clips):
    path, hf = checkpoint
    llm = LLM(model=str(path), dtype="float32", device="cpu")
    res = llm.transcribe([{"audio": c, "sampling_rate": 16000} for c in clips], timestamps=True,
                         temperature=0.0, max_tokens=MAX_NEW, use_tqdm=False)
    tok = llm.get_tokenizer()
    for seconds, clip, r in zip(CLIPS, clips, res):
        assert r.error is None, r.error
        windows = _oracle(hf, clip)
        assert r.windows == len(windows) == -(-len(clip) // WINDOW)
        assert [s["token_ids"] for s in r.segments] == windows
        assert r.token_ids == [t for w in windows for t in w]
        assert r.text == tok.decode(r.token_ids, skip_special_tokens=True).strip()
        assert [s["start"] for s in r.segments] == [float(i) for i in range(len(windows))]
        assert r.segments[-1]["end"] == pytest.approx(seconds)
    assert len({tuple(r.token_ids) for r in res}) == len(res)  # the audio decides the tokens
    # The model's own rules: an option it does not have is an error naming it.
    with pytest.raises(ValueError, match="tone speech only transcribes"):
        llm.transcribe(clips[0], sampling_rate=16000, task="translate")
    with pytest.raises(ValueError, match="compression_ratio_threshold"):
        llm.transcribe(clips[0], sampling_rate=16000, compression_ratio_threshold=2.4)
    bad = llm.transcribe([{"audio": clips[0]}, {"audio": clips[0], "sampling_rate": 16000}], max_tokens=MAX_NEW,
                         temperature=0.0, use_tqdm=False)
    assert "sampling_rate" in bad[0].error and bad[1].token_ids == _oracle(hf, clips[0])[0]
    # generate() takes one window of audio as an encoder prompt (the model reads it): HF's tokens,
    # to the checkpoint's max_length.
    out = llm.generate({"audio": clips[0], "sampling_rate": 16000}, use_tqdm=False)[0]
    assert out.error is None and out.prompt_token_ids == [START]
    tokens = list(out.outputs[0].token_ids)
    assert (tokens[:-1] if tokens[-1:] == [EOS] else tokens) == _oracle(hf, clips[0], max_length=32)[0]
    out = llm.generate({"audio": clips[1], "sampling_rate": 16000}, use_tqdm=False)[0]
    assert "longer than this model's 1 s window" in out.error


def test_tandem_transcribe_command(installed, checkpoint, clips, tmp_path):
    import soundfile as sf

    path, hf = checkpoint
    wav = tmp_path / "talk.wav"
    sf.write(wav, clips[1], 16000, subtype="FLOAT")
    res = subprocess.run(
        [sys.executable, "-m", "tandem.entrypoints.cli", "transcribe", str(path), str(wav), "--format", "json",
         "--temperature", "0", "--no-progress", "--dtype", "float32", "--device", "cpu"],
        capture_output=True, text=True,
    )
    assert res.returncode == 0, res.stderr
    (record,) = [json.loads(line) for line in res.stdout.splitlines()]
    # --temperature 0, and the checkpoint's max_length (32 positions) as the budget.
    want = [t for w in _oracle(hf, clips[1], max_length=32) for t in w]
    assert record["error"] is None and record["token_ids"] == want and record["language"] == "en"


def test_audio_transcriptions_endpoint(installed, checkpoint, clips):
    import soundfile as sf

    from tandem.entrypoints.openai.api_server import build_app

    path, hf = checkpoint
    buf = io.BytesIO()
    sf.write(buf, clips[3], 16000, format="WAV", subtype="FLOAT")
    tok = make_tokenizer(VOCAB)

    async def run():
        engine = AsyncLLM(model=str(path), dtype="float32", device="cpu")
        try:
            app = build_app(engine, served_model_name="tone")
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=60.0) as c:
                files = {"file": ("a.wav", buf.getvalue())}
                plain = await c.post("/v1/audio/transcriptions", files=files,
                                     data={"temperature": "0", "response_format": "verbose_json"})
                streamed = await c.post("/v1/audio/transcriptions", files=files,
                                        data={"temperature": "0", "stream": "true"})
                translated = await c.post("/v1/audio/translations", files=files)
                return plain, streamed, translated
        finally:
            await engine.shutdown(timeout=60)

    # The endpoint has no max_tokens field: the windows run to the checkpoint's max_length.
    plain, streamed, translated = asyncio.run(run())
    assert plain.status_code == 200, plain.text
    body = plain.json()
    assert body["language"] == "en" and body["duration"] == pytest.approx(CLIPS[3])
    assert [s["start"] for s in body["segments"]] == [0.0, 1.0, 2.0, 3.0]
    full = _oracle(hf, clips[3], max_length=32)
    assert [s["tokens"] for s in body["segments"]] == full
    assert body["text"] == tok.decode([t for w in full for t in w], skip_special_tokens=True).strip()
    assert body["text"]
    # Streamed: a delta per window as the model's session reports it, then the whole text.
    events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    deltas = [e for e in events if e["type"] == "transcript.text.delta"]
    assert [d["segments"][0]["token_ids"] for d in deltas] == full
    assert (events[-1]["type"], events[-1]["text"]) == ("transcript.text.done", body["text"])  # OpenAI's keys
    assert events[-1]["choices"][0]["delta"] == {"content": ""}  # vLLM's chunk shape beside them (docs/from_vllm.md)
    assert streamed.text.rstrip().endswith("data: [DONE]")
    assert translated.status_code == 400 and "tone speech only transcribes" in translated.json()["error"]["message"]
