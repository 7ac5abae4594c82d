"""``/metrics`` and the request log against the tokens the engine really
generated: streamed completions are logged with all their tokens (not the last
delta's), and audio requests (transcriptions and translations, plain and
streamed) are counted in the same metrics as completions. In-process through
``httpx.ASGITransport``; every wait is bounded."""

from __future__ import annotations

import asyncio
import io
import logging
import re

import httpx
import numpy as np
import pytest
import soundfile as sf

from tandem import AsyncLLM
from tandem.entrypoints.openai.api_server import build_app

WAIT = 60.0
PROMPT = {"prompt_token_ids": [0, 17, 5, 9, 2]}
SUCCESS = "tandem:request_success_total"


def _client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=WAIT)


async def _metrics(c: httpx.AsyncClient) -> dict[str, float]:
    """Every sample of ``/metrics`` by its name and labels."""
    text = (await c.get("/metrics")).text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and not line.startswith("#")}


def _delta(before: dict, after: dict, name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


@pytest.fixture(scope="module")
def bart_engine(bart_dir):
    engine = AsyncLLM(model=str(bart_dir), dtype="float32", device="cpu")
    yield engine
    asyncio.run(engine.shutdown(timeout=WAIT))


@pytest.fixture(scope="module")
def whisper_engine(tmp_path_factory):
    from helpers import make_whisper

    path = make_whisper(tmp_path_factory.mktemp("whisper_metrics") / "ckpt", num_mel_bins=80, seed=3,
                        timestamps=True)
    engine = AsyncLLM(model=str(path), dtype="float32", device="cpu")
    yield engine
    asyncio.run(engine.shutdown(timeout=WAIT))


@pytest.mark.asyncio
async def test_streamed_completions_are_logged_and_counted_with_all_their_tokens(bart_engine, caplog):
    app = build_app(bart_engine, served_model_name="m")
    body = {"prompt": PROMPT, "max_tokens": 7, "ignore_eos": True, "temperature": 0}
    caplog.set_level(logging.INFO, logger="tandem.serve")
    async with _client(app) as c:
        before = await _metrics(c)
        r = await c.post("/v1/completions", json={**body, "stream": True,
                                                  "stream_options": {"include_usage": True}})
        assert r.status_code == 200, r.text
        after = await _metrics(c)
        plain = await c.post("/v1/completions", json=body)
        after_plain = await _metrics(c)
    usage = [e for e in r.text.splitlines() if '"usage"' in e]
    assert '"completion_tokens": 7' in usage[0]
    prompt_tokens = plain.json()["usage"]["prompt_tokens"]  # encoder + decoder prompt
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "tandem.serve" and " out, " in rec.getMessage()]
    assert len(lines) == 2, lines
    for line in lines:  # the stream's line as the plain request's: every generated token counted
        assert f": {prompt_tokens} tokens in, 7 out, " in line, line
    for b, a in ((before, after), (after, after_plain)):
        assert _delta(b, a, "tandem:generation_tokens_total") == 7
        assert _delta(b, a, "tandem:prompt_tokens_total") == prompt_tokens
        assert _delta(b, a, f'{SUCCESS}{{finished_reason="length"}}') == 1
        assert _delta(b, a, "tandem:e2e_request_latency_seconds_count") == 1


def _wav(seconds: float, seed: int) -> bytes:
    from helpers import synth_audio

    buf = io.BytesIO()
    sf.write(buf, (synth_audio(seconds, seed=seed) * 32767).astype(np.int16), 16000, format="WAV",
             subtype="PCM_16")
    return buf.getvalue()


@pytest.mark.asyncio
async def test_audio_requests_are_counted_like_completions(whisper_engine, monkeypatch, caplog):
    # What each window's engine request gave, seen from the engine's side.
    windows: list = []
    generate = whisper_engine.generate

    async def spy(prompt, params=None, request_id=None, **kw):
        async for out in generate(prompt, params, request_id, **kw):
            if out.finished:
                windows.append(out)
            yield out

    monkeypatch.setattr(whisper_engine, "generate", spy)
    app = build_app(whisper_engine, served_model_name="w")
    short, long = _wav(4.0, seed=1), _wav(40.0, seed=5)  # one window (no timestamps); two (timestamps)
    calls = [("/v1/audio/transcriptions", short, {}), ("/v1/audio/transcriptions", long,
                                                      {"response_format": "verbose_json"}),
             ("/v1/audio/transcriptions", long, {"response_format": "verbose_json", "stream": "true"}),
             ("/v1/audio/translations", short, {"stream": "true"}), ("/v1/audio/translations", long, {})]
    caplog.set_level(logging.INFO, logger="tandem.serve")
    async with _client(app) as c:
        before = await _metrics(c)
        for path, wav, data in calls:
            r = await c.post(path, files={"file": ("a.wav", wav)}, data={"language": "de", **data}
                             if path.endswith("transcriptions") else data)
            assert r.status_code == 200 and "error" not in r.text, r.text[:300]
        after = await _metrics(c)
    assert len(windows) >= 2 * len(calls) - 2  # the long clips decode two windows or more
    generated = sum(len(c.token_ids) for out in windows for c in out.outputs)
    # Each window: its decoder prompt, and the 1500 positions of Whisper's padded 30 s window.
    prompted = sum(len(out.prompt_token_ids) + 1500 for out in windows)
    assert generated > 0
    assert _delta(before, after, "tandem:generation_tokens_total") == generated
    assert _delta(before, after, "tandem:prompt_tokens_total") == prompted
    reasons = {}
    for out in windows:
        reasons[out.request_id.rsplit("-w", 1)[0]] = out.outputs[0].finish_reason  # the last window's
    assert len(reasons) == len(calls) and set(reasons.values()) <= {"stop", "length"}
    for reason in ("stop", "length"):
        want = sum(r == reason for r in reasons.values())
        assert _delta(before, after, f'{SUCCESS}{{finished_reason="{reason}"}}') == want, reason
    assert _delta(before, after, f'{SUCCESS}{{finished_reason="abort"}}') == 0
    for hist in ("tandem:e2e_request_latency_seconds_count", "tandem:time_to_first_token_seconds_count"):
        assert _delta(before, after, hist) == len(calls), hist
    # One log line per request, with the same counts.
    logged = [re.search(r"(\d+) window\(s\), (\d+) tokens in, (\d+) out", rec.getMessage())
              for rec in caplog.records if rec.name == "tandem.serve"]
    logged = [m for m in logged if m]
    assert len(logged) == len(calls)
    assert sum(int(m[1]) for m in logged) == len(windows)
    assert sum(int(m[2]) for m in logged) == prompted
    assert sum(int(m[3]) for m in logged) == generated
