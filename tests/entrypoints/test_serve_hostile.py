"""``tandem serve`` against a hostile client: every limit holds before the work
it bounds, and every refusal is a JSON error in OpenAI's shape.

- bodies (chunked or not, multipart included) are counted as they arrive and
  refused with 413 once over ``--max-body-bytes``: never read to the end;
- audio is refused from its header or part-way through decoding once over
  ``--max-audio-seconds``, and a file's declared rate is held to the range
  arrays are (1000..384000 Hz);
- ``--max-queued-requests`` counts sequences (prompts x n), not HTTP requests;
- ``finished_reason="abort"`` reaches ``/metrics``;
- request fields are strict (no ``"5"`` for an int, no ``"yes"`` for a bool);
- a client's ``request_id`` never reaches the engine, so no error names
  another client's ids;
- past ``--drain-timeout`` a running request gets a JSON 503, not uvicorn's
  plain-text 500;
- with ``--api-key``, ``/openapi.json`` needs the key and ``/docs`` is gone.

In-process through ``httpx.ASGITransport`` where that shows it, a real server
process for what only uvicorn does (chunked uploads over a socket, SIGTERM).
Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import io
import json
import signal
import time

import httpx
import numpy as np
import pytest
import soundfile as sf

from helpers import count_audio_reads
from tandem import AsyncLLM
from tandem.audio import AudioError, AudioTooLongError, load_audio
from tandem.entrypoints.openai.api_server import MAX_FORM_FIELDS, build_app

WAIT = 60.0
MIB = 1 << 20
PROMPT = {"prompt_token_ids": [0, 17, 5, 9, 2]}


def _error(r: httpx.Response, status: int) -> str:
    """The message of a JSON error in OpenAI's shape, after checking its status."""
    assert r.status_code == status, (r.status_code, r.text[:500])
    assert r.headers["content-type"].startswith("application/json"), r.text[:200]
    err = r.json()["error"]
    assert err["code"] == status and set(err) == {"message", "type", "param", "code"}
    return err["message"]


class _Counted:
    """An async body of ``total`` bytes in ``chunk``-byte pieces (no Content-Length:
    httpx sends it chunked) that counts what was taken from it."""

    def __init__(self, total: int, chunk: int = 64 << 10, head: bytes = b"", tail: bytes = b"") -> None:
        self.total, self.chunk, self.head, self.tail, self.sent = total, chunk, head, tail, 0

    async def __aiter__(self):
        if self.head:
            self.sent += len(self.head)
            yield self.head
        block = b"\0" * self.chunk
        for _ in range(self.total // self.chunk):
            self.sent += len(block)
            yield block
        if self.tail:
            self.sent += len(self.tail)
            yield self.tail


class _SyncCounted(_Counted):
    def __iter__(self):
        block = b"a" * self.chunk
        for _ in range(self.total // self.chunk):
            self.sent += len(block)
            yield block


@pytest.fixture(scope="module")
def bart_engine(bart_dir):
    engine = AsyncLLM(model=str(bart_dir), dtype="float32", device="cpu")
    yield engine
    asyncio.run(engine.shutdown(timeout=WAIT))


@pytest.fixture(scope="module")
def whisper_engine(tmp_path_factory):
    from helpers import make_whisper

    path = make_whisper(tmp_path_factory.mktemp("whisper_hostile") / "ckpt", num_mel_bins=80, seed=3)
    engine = AsyncLLM(model=str(path), dtype="float32", device="cpu")
    yield engine
    asyncio.run(engine.shutdown(timeout=WAIT))


def _client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=WAIT)


def _wav(samples: np.ndarray, rate: int) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, samples, rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def _flac(seconds: float, rate: int = 16000, unknown_length: bool = False) -> bytes:
    """Silence as FLAC (an hour is ~180 KB); ``unknown_length`` zeroes STREAMINFO's
    total-samples field, so only decoding can tell how long it is."""
    buf = io.BytesIO()
    sf.write(buf, np.zeros(int(seconds * rate), np.int16), rate, format="FLAC")
    data = bytearray(buf.getvalue())
    if unknown_length:
        info = data.index(b"fLaC") + 8  # STREAMINFO's data, after its 4-byte block header
        data[info + 13] &= 0xF0  # the low 36 bits of bytes 13..17 hold total samples
        data[info + 14 : info + 18] = b"\0\0\0\0"
    return bytes(data)


def _slow_steps(monkeypatch, engine: AsyncLLM, seconds: float = 0.05) -> None:
    """Each engine step takes at least ``seconds``: a long request stays running
    while the test looks, however fast the machine. (The engine thread runs
    the core's ``step``; patching ``LLMEngine.step`` would slow nothing.)"""
    step = engine.engine.core.step
    calls = []

    def slow():
        calls.append(1)
        time.sleep(seconds)
        return step()

    monkeypatch.setattr(engine.engine.core, "step", slow)
    return calls


async def _wait_for(cond, what: str, timeout: float = WAIT) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in metrics:\n{text}")


# ------------------------------------------------------------------ bodies


@pytest.mark.asyncio
async def test_a_chunked_body_over_the_limit_is_refused_before_it_is_read(bart_engine):
    app = build_app(bart_engine, served_model_name="m", max_body_bytes=MIB)
    async with _client(app) as c:
        body = _Counted(100 * MIB)  # no Content-Length: chunked
        r = await c.post("/v1/completions", content=body, headers={"content-type": "application/json"})
        assert "1048576-byte limit" in _error(r, 413) and "--max-body-bytes" in r.text
        assert r.headers["connection"] == "close"
        assert body.sent <= MIB + 2 * body.chunk, body.sent  # read up to the limit, not the 100 MiB
        # A chunked body under the limit is served as before.
        small = json.dumps({"prompt": PROMPT, "max_tokens": 2}).encode()

        async def chunks():
            for i in range(0, len(small), 7):
                yield small[i : i + 7]

        ok = await c.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
        assert ok.status_code == 200, ok.text


@pytest.mark.asyncio
async def test_multipart_uploads_are_bounded(whisper_engine):
    app = build_app(whisper_engine, served_model_name="w", max_body_bytes=MIB)
    boundary = "hostileboundary"
    head = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n"
            "Content-Type: audio/wav\r\n\r\n").encode()
    ctype = {"content-type": f"multipart/form-data; boundary={boundary}"}
    async with _client(app) as c:
        body = _Counted(100 * MIB, head=head, tail=f"\r\n--{boundary}--\r\n".encode())
        r = await c.post("/v1/audio/transcriptions", content=body, headers=ctype)
        assert "--max-body-bytes" in _error(r, 413)
        assert body.sent <= MIB + 2 * body.chunk, body.sent
        wav = _wav(np.zeros(1600, np.int16), 16000)
        two = await c.post("/v1/audio/transcriptions", files=[("file", ("a.wav", wav)), ("file", ("b.wav", wav))])
        assert "one 'file' part" in _error(two, 400)
        fields = {f"f{i}": "x" for i in range(MAX_FORM_FIELDS + 8)}
        many = await c.post("/v1/audio/transcriptions", files={"file": ("a.wav", wav)}, data=fields)
        assert f"at most {MAX_FORM_FIELDS} other fields" in _error(many, 400)
        long_field = await c.post("/v1/audio/transcriptions", files={"file": ("a.wav", wav)},
                                  data={"prompt": "word " * 20000})
        assert "65536 bytes" in _error(long_field, 400)
        bad_stream = await c.post("/v1/audio/transcriptions", files={"file": ("a.wav", wav)}, data={"stream": "yes"})
        assert "stream='yes'" in _error(bad_stream, 400)


# ------------------------------------------------------------------ audio


def test_load_audio_holds_files_to_the_array_rate_range_and_max_seconds(monkeypatch):
    one_hz = _wav(np.zeros(2000, np.int16), 1)  # the probe's file: 4,044 bytes "lasting" 2,000 s
    assert len(one_hz) == 4044
    with pytest.raises(AudioError, match=r"1 Hz, outside 1000\.\.384000 Hz"):
        load_audio(one_hz)
    with pytest.raises(AudioError, match=r"999 Hz, outside"):
        load_audio(_wav(np.zeros(100, np.int16), 999))
    # Arrays: refused from their shape, before resampling.
    with pytest.raises(AudioTooLongError, match=r"12\.0 s, over the 10-second limit"):
        load_audio(np.zeros(12 * 8000, np.float32), 8000, max_seconds=10)
    assert load_audio(np.zeros(10 * 8000, np.float32), 8000, max_seconds=10).numel() == 10 * 16000
    # A header that says how long: refused before any of it is decoded.
    reads = count_audio_reads(monkeypatch)
    hour = _flac(3600)
    with pytest.raises(AudioTooLongError, match=r"declares 3600\.0 s, over the 1800-second limit") as e:
        load_audio(hour, max_seconds=1800)
    assert (e.value.seconds, e.value.limit) == (3600.0, 1800) and reads == []
    # No length in the header: decoding stops just past the limit.
    with pytest.raises(AudioTooLongError, match=r"decoding stopped at 20\.0 s"):
        load_audio(_flac(3600, unknown_length=True), max_seconds=20)
    assert 20 * 16000 < sum(reads) <= 20 * 16000 + 1
    # Under the limit, a file decodes in blocks to what a whole read gives.
    reads.clear()
    clip = (0.3 * np.sin(np.arange(5 * 44100) * 0.05)).astype(np.float32)
    stereo = np.stack([clip, -0.5 * clip], axis=1)
    buf = io.BytesIO()
    sf.write(buf, stereo, 44100, format="WAV", subtype="FLOAT")
    y = load_audio(buf.getvalue(), max_seconds=5)
    assert len(reads) > 2  # in blocks
    ref = load_audio(stereo.mean(axis=1, dtype=np.float64).astype(np.float32), 44100)
    assert y.shape == ref.shape and float((y - ref).abs().max()) == 0.0


@pytest.mark.asyncio
async def test_audio_that_expands_is_refused_naming_the_limit(whisper_engine):
    app = build_app(whisper_engine, served_model_name="w", max_audio_seconds=20)
    default = build_app(whisper_engine, served_model_name="w")  # --max-audio-seconds 1800
    async with _client(app) as c, _client(default) as d:
        one_hz = await c.post("/v1/audio/transcriptions", files={"file": ("a.wav", _wav(np.zeros(2000, np.int16), 1))})
        assert "1 Hz, outside 1000..384000 Hz" in _error(one_hz, 400)
        for data in (_flac(60), _flac(60, unknown_length=True)):
            r = await c.post("/v1/audio/transcriptions", files={"file": ("a.flac", data)})
            assert "at most 20 s of audio (--max-audio-seconds)" in _error(r, 413)
        start = time.monotonic()
        r = await d.post("/v1/audio/transcriptions", files={"file": ("a.flac", _flac(3600, unknown_length=True))})
        assert "at most 1800 s of audio (--max-audio-seconds)" in _error(r, 413)
        assert "decoding stopped at 1800.0 s" in r.text
        assert time.monotonic() - start < 20  # half an hour decoded at most, never the hour, nor its features


# ------------------------------------------------------------------ queue, strictness, ids, docs


@pytest.mark.asyncio
async def test_max_queued_requests_counts_prompts_and_n(bart_dir, monkeypatch):
    engine = AsyncLLM(model=str(bart_dir), dtype="float32", device="cpu", max_num_seqs=1)  # one runs, the rest wait
    _slow_steps(monkeypatch, engine)
    app = build_app(engine, served_model_name="m", max_queued_requests=4)
    sch = engine.engine.scheduler
    body = {"prompt": PROMPT, "max_tokens": 100, "ignore_eos": True, "temperature": 0}
    try:
        async with _client(app) as c:
            runs = asyncio.create_task(c.post("/v1/completions", json=body))
            await _wait_for(lambda: len(sch.running) == 1, "the first request to run")
            two = asyncio.create_task(c.post("/v1/completions", json={**body, "prompt": [PROMPT, PROMPT]}))
            await asyncio.sleep(0.1)  # admitted: 2 sequences wait (or are about to)
            three = await c.post("/v1/completions", json={**body, "prompt": [PROMPT] * 3})
            assert "the queue is full (2 sequences waiting, this request adds 3, the limit is 4)" in _error(three, 503)
            assert three.headers["retry-after"] == "1"
            n3 = await c.post("/v1/completions", json={**body, "n": 3, "temperature": 1.0})
            assert "adds 3" in _error(n3, 503)  # n counts: 2 + 3 > 4
            many = await c.post("/v1/completions", json={**body, "prompt": [PROMPT] * 152})
            assert "152 sequences" in _error(many, 400) and "--max-queued-requests 4" in many.text
            n5 = await c.post("/v1/completions", json={**body, "n": 5, "temperature": 1.0})
            assert "5 sequences (1 prompt(s) x 5)" in _error(n5, 400)
            fits = asyncio.create_task(c.post("/v1/completions", json={**body, "prompt": [PROMPT, PROMPT]}))
            await asyncio.sleep(0.1)
            full = await c.post("/v1/completions", json={**body, "max_tokens": 2})
            assert "4 sequences waiting" in _error(full, 503)
            for t in (runs, two, fits):  # the clients leave: their requests abort
                t.cancel()
            await asyncio.gather(runs, two, fits, return_exceptions=True)
            await _wait_for(lambda: not sch.has_unfinished(), "the aborted requests to leave")
            again = await c.post("/v1/completions", json={**body, "prompt": [PROMPT] * 4, "max_tokens": 2})
            assert again.status_code == 200, again.text  # nothing left counted
    finally:
        await engine.shutdown(timeout=WAIT)


@pytest.mark.asyncio
async def test_request_fields_are_strict(bart_engine):
    app = build_app(bart_engine, served_model_name="m")
    cases = [({"max_tokens": "5"}, "max_tokens"), ({"stream": "yes"}, "stream"), ({"n": True}, "n"),
             ({"max_tokens": 5.0}, "max_tokens"), ({"temperature": "0.5"}, "temperature"),
             ({"stream_options": {"include_usage": "true"}}, "stream_options.include_usage"),
             ({"prompt": [0, "17", 2]}, "prompt"), ({"logprobs": "2"}, "logprobs"),
             ({"request_id": "x" * 300}, "request_id")]
    async with _client(app) as c:
        for extra, field in cases:
            r = await c.post("/v1/completions", json={"prompt": PROMPT, **extra})
            msg = _error(r, 400)
            assert msg.startswith(field) or f"{field}." in msg or f"{field}:" in msg, (extra, msg)
        ok = await c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "temperature": 1, "top_p": 1})
        assert ok.status_code == 200, ok.text  # an int where a float is due is that float


@pytest.mark.asyncio
async def test_client_request_ids_are_only_echoed(bart_engine):
    app = build_app(bart_engine, served_model_name="m")
    body = {"prompt": PROMPT, "max_tokens": 40, "ignore_eos": True, "temperature": 0, "request_id": "victim-7"}
    async with _client(app) as c:
        # Another client sends the same id while the first is in flight: both are served.
        rs = await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(3)),
                                  c.post("/v1/completions", json={**body, "stream": True}))
        for r in rs:
            assert r.status_code == 200, r.text
            assert "already in use" not in r.text
        assert all(r.json()["id"] == "victim-7" for r in rs[:3])
        assert '"id": "victim-7"' in rs[3].text
        # Without one, each response has its own server id.
        a, b = [(await c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1})).json()["id"]
                for _ in range(2)]
        assert a != b and a.startswith("cmpl-")


@pytest.mark.asyncio
async def test_openapi_needs_the_key_and_docs_are_off(bart_engine):
    app = build_app(bart_engine, served_model_name="m", api_key="k")
    auth = {"Authorization": "Bearer k"}
    async with _client(app) as c:
        for path in ("/openapi.json", "/docs", "/redoc", "/v1/models", "/nowhere"):
            assert "API key" in _error(await c.get(path), 401)
        assert (await c.get("/openapi.json", headers=auth)).json()["info"]["title"] == "tandem"
        assert (await c.get("/docs", headers=auth)).status_code == 404
        assert (await c.get("/redoc", headers=auth)).status_code == 404
        for path in ("/health", "/version", "/metrics"):
            assert (await c.get(path)).status_code == 200
    open_app = build_app(bart_engine, served_model_name="m")  # no key: the spec is open, the docs still off
    async with _client(open_app) as c:
        assert (await c.get("/openapi.json")).status_code == 200
        assert (await c.get("/docs")).status_code == 404


@pytest.mark.asyncio
async def test_unknown_routes_and_methods_are_openai_shaped(bart_engine, whisper_engine):
    async with _client(build_app(bart_engine, served_model_name="m")) as c:
        chat = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        msg = _error(chat, 404)
        assert "encoder/decoder model" in msg and "/v1/completions" in msg and "audio" not in msg, msg
        nowhere = await c.get("/v1/nowhere")
        assert "no route GET /v1/nowhere" in _error(nowhere, 404) and "/v1/completions" in nowhere.text
        assert _error(await c.get("/docs"), 404)
        wrong = await c.get("/v1/completions")
        assert "method GET is not allowed on /v1/completions (use POST)" in _error(wrong, 405)
        assert wrong.headers["allow"] == "POST"
        assert "detail" not in (await c.delete("/v1/models")).json()
    async with _client(build_app(whisper_engine, served_model_name="w")) as c:
        chat = await c.post("/v1/chat/completions", json={})
        assert "/v1/audio/transcriptions" in _error(chat, 404)


@pytest.mark.asyncio
async def test_malformed_json_says_so_with_its_position(bart_engine):
    async with _client(build_app(bart_engine, served_model_name="m")) as c:
        for body, where in ((b'{"prompt": "x",', "line 1 column 15"), (b"not json", "line 1 column 2"),
                            (b'{"prompt": "x"} x', "line 1 column 17"), (b"", "line 1 column 0")):
            r = await c.post("/v1/completions", content=body, headers={"content-type": "application/json"})
            msg = _error(r, 400)
            assert msg.startswith("invalid JSON body: ") and msg.endswith(where), msg
        listed = await c.post("/v1/completions", json=[1, 2])
        assert _error(listed, 400) == "the body must be a JSON object (got list)"
        huge = await c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": "9" * 5000})
        msg = _error(huge, 400)
        assert msg.startswith("max_tokens: ") and len(msg) < 400, msg  # the bad value quoted, not all of it


# ------------------------------------------------------------------ drain, aborts


@pytest.mark.asyncio
async def test_the_drain_cut_answers_json_and_counts_aborts(bart_engine, monkeypatch):
    _slow_steps(monkeypatch, bart_engine)
    app = build_app(bart_engine, served_model_name="m")
    sch = bart_engine.engine.scheduler
    body = {"prompt": PROMPT, "max_tokens": 120, "ignore_eos": True, "temperature": 0}
    async with _client(app) as c:
        before = _metric((await c.get("/metrics")).text, 'tandem:request_success_total{finished_reason="abort"}')
        plain = asyncio.create_task(c.post("/v1/completions", json=body))
        streamed = asyncio.create_task(c.post("/v1/completions", json={**body, "stream": True}))
        # Both past their first outputs (the stream has started: a cut before it is a plain 503).
        await _wait_for(lambda: len(sch.running) == 2
                        and all(len(g.seqs[0].output_token_ids) >= 3 for g in list(sch.running)),
                        "both requests to run")
        app.state.drain_cut.set()  # what serve() does --drain-timeout seconds after SIGTERM
        r = await asyncio.wait_for(plain, WAIT)
        assert "shutting down" in _error(r, 503)
        s = await asyncio.wait_for(streamed, WAIT)
        assert s.status_code == 200
        last = json.loads([line for line in s.text.splitlines() if line.startswith("data: ")][-1][6:])
        assert last["error"]["code"] == 503 and "shutting down" in last["error"]["message"]
        await _wait_for(lambda: not sch.has_unfinished(), "the cut requests to be aborted")
        after = _metric((await c.get("/metrics")).text, 'tandem:request_success_total{finished_reason="abort"}')
        assert after - before == 2


@pytest.mark.asyncio
async def test_a_forced_cut_answers_audio_with_json(whisper_engine, monkeypatch):
    from helpers import synth_audio

    from tandem.entrypoints.openai.shutdown import FORCED

    slowed = _slow_steps(monkeypatch, whisper_engine, 0.05)
    app = build_app(whisper_engine, served_model_name="w")
    sch = whisper_engine.engine.scheduler
    wav = _wav((synth_audio(60.0, seed=2) * 32767).astype(np.int16), 16000)  # two 30 s windows
    files = {"file": ("a.wav", wav)}
    async with _client(app) as c:
        plain = asyncio.create_task(c.post("/v1/audio/transcriptions", files=files,
                                           data={"response_format": "verbose_json"}))
        streamed = asyncio.create_task(c.post("/v1/audio/transcriptions", files=files,
                                              data={"response_format": "verbose_json", "stream": "true"}))
        # One window of each request in the engine (a request decodes its windows one after
        # another; a short window may end before the other request's starts, so "both
        # running at once" is not a moment a loaded machine is sure to show).
        await _wait_for(lambda: sch.num_unfinished() >= 2, "a window of each request in the engine")
        app.state.drain_cut.set(FORCED)  # what a second SIGTERM does
        r = await asyncio.wait_for(plain, WAIT)
        assert "shutting down" in _error(r, 503) and "a second signal forced the shutdown" in r.text
        s = await asyncio.wait_for(streamed, WAIT)
        assert s.status_code == 200
        last = json.loads([line for line in s.text.splitlines() if line.startswith("data: ")][-1][6:])
        assert last["error"]["code"] == 503 and "second signal" in last["error"]["message"]
        await _wait_for(lambda: not sch.has_unfinished(), "the cut windows to be aborted")
        metrics = (await c.get("/metrics")).text  # this app's own counters: both counted as aborted
        assert _metric(metrics, 'tandem:request_success_total{finished_reason="abort"}') == 2
    assert slowed, "the engine thread's steps were not slowed"


# ------------------------------------------------------------------ a real server


@pytest.mark.slow
def test_real_server_bounds_uploads_counts_disconnects_and_cuts_with_json(bart_dir):
    from test_serve import _metric as metric
    from test_serve import _start

    proc, url = _start(bart_dir, "--max-body-bytes", str(MIB), "--drain-timeout", "0.5", "--max-num-seqs", "1")
    try:
        def rss_kb() -> int:
            with open(f"/proc/{proc.pid}/status") as f:
                return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))

        # 1. A 100 MiB chunked upload: 413 once past the limit; the server neither reads
        # it to the end nor holds it (a socket's buffers are all the client gets to send).
        rss = rss_kb()
        body = _SyncCounted(100 * MIB)
        r = httpx.post(f"{url}/v1/completions", content=iter(body), headers={"content-type": "application/json"},
                       timeout=WAIT)
        assert "--max-body-bytes" in _error(r, 413)
        assert body.sent < 32 * MIB, body.sent
        assert rss_kb() - rss < 64 * 1024, (rss, rss_kb())
        # 2. A stream the client leaves: its abort is counted.
        abort = 'tandem:request_success_total{finished_reason="abort"}'
        assert metric(httpx.get(f"{url}/metrics").text, abort) == 0
        long = {"prompt": PROMPT, "max_tokens": 120, "ignore_eos": True, "temperature": 0}
        with httpx.stream("POST", f"{url}/v1/completions", json={**long, "stream": True}, timeout=WAIT) as s:
            assert s.status_code == 200
            for n, _ in enumerate(s.iter_lines()):
                if n >= 2:
                    break
        for _ in range(200):
            if metric(httpx.get(f"{url}/metrics").text, abort) == 1:
                break
            time.sleep(0.05)
        assert metric(httpx.get(f"{url}/metrics").text, abort) == 1
        # 3. SIGTERM with requests longer than --drain-timeout: they end with a JSON 503.
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            futs = [pool.submit(httpx.post, f"{url}/v1/completions", json=long, timeout=WAIT) for _ in range(6)]
            for _ in range(600):  # all six in the engine (one runs), so none meets a closed socket
                text = httpx.get(f"{url}/metrics").text
                held = metric(text, "tandem:num_requests_running") + metric(text, "tandem:num_requests_waiting")
                if held + sum(f.done() for f in futs) >= 6:
                    break
                time.sleep(0.05)
            start = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            results = [f.result(timeout=WAIT) for f in futs]
        cut = [r for r in results if r.status_code != 200]
        assert cut, [r.status_code for r in results]  # 6 x 120 tokens, one at a time, take longer than 0.5 s
        for r in cut:
            assert "shutting down" in _error(r, 503)
        assert proc.wait(timeout=WAIT) == 0
        assert time.monotonic() - start < 0.5 + 5 + 10
        log = proc.stdout.read()  # one line for the cut, no traceback per request
        assert "Traceback" not in log and "Exception in ASGI" not in log, log[-3000:]
        assert log.count("--drain-timeout (0.5 s) passed: shutting down now") == 1, log[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=WAIT)
