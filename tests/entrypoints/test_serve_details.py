"""Server details (issue 39, Build 5), in-process through ``httpx.ASGITransport``:

- the audio endpoints refuse form fields they do not take (a 400 naming them, bounded
  as a completion's validation errors) and take OpenAI's and vLLM's documented ones,
  the sampling fields applied;
- completion logprobs' ``text_offset``: where each token's text starts in the
  completion's text, cumulative across a stream's chunks;
- a streamed transcription sends a ``transcript.text.delta`` for a clip of one window
  too, and its deltas join to the done event's text (several windows too);
- each stream event carries vLLM's chunk shape beside OpenAI's (``choices[0].delta.content``
  joining to the text, a done chunk with one empty choice), and its usage with vLLM's
  ``stream_include_usage`` / ``stream_continuous_usage_stats``, as the server counted it.
"""

from __future__ import annotations

import asyncio
import io
import json

import httpx
import pytest

from tandem import LLM, AsyncLLM, SamplingParams
from tandem.demo_whisper import PATH as DEMO
from tandem.demo_whisper import synthesize, write_wav
from tandem.entrypoints.openai.api_server import build_app
from tandem.entrypoints.openai.protocol import MAX_SHOWN_PROBLEMS

WAIT = 120.0  # the tiny demo models answer in well under a second each; generous for 2 busy cores
ROUTES = ("/v1/audio/transcriptions", "/v1/audio/translations")


def _wav(words: str, tmp_path, name: str) -> bytes:
    path = write_wav(tmp_path / name, synthesize(words))
    return path.read_bytes()


@pytest.fixture(scope="module")
def whisper():
    engine = AsyncLLM(model=str(DEMO), dtype="float32", device="cpu")
    yield engine
    asyncio.run(engine.shutdown(timeout=WAIT))


@pytest.fixture(scope="module")
def bart(bart_dir):
    engine = AsyncLLM(model=str(bart_dir), dtype="float32", device="cpu")
    yield engine
    asyncio.run(engine.shutdown(timeout=WAIT))


@pytest.fixture(scope="module")
def offline():
    return LLM(model=str(DEMO), dtype="float32", device="cpu")


def _client(engine) -> httpx.AsyncClient:
    app = build_app(engine, served_model_name="m")
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=WAIT)


async def _post_audio(c, route: str, audio: bytes, fields: dict) -> httpx.Response:
    return await c.post(route, files={"file": ("a.wav", io.BytesIO(audio), "audio/wav")}, data=fields)


# -- unknown and known form fields --------------------------------------------------


@pytest.mark.asyncio
async def test_audio_endpoints_refuse_unknown_fields_naming_them_as_completions_do(whisper, bart, tmp_path):
    audio = _wav("three one four", tmp_path, "a.wav")
    async with _client(whisper) as c:
        for route in ROUTES:
            r = await _post_audio(c, route, audio, {"bogus": "1"})
            assert r.status_code == 400, (route, r.text)
            err = r.json()["error"]
            assert "bogus: Extra inputs are not permitted (got '1')" in err["message"] and err["param"] == "bogus"
        # many: the first MAX_SHOWN_PROBLEMS named, the rest counted (the form's own limit is 32 fields)
        many = {f"x{i:02d}": "v" for i in range(30)}
        r = await _post_audio(c, ROUTES[0], audio, many)
        assert r.status_code == 400
        message = r.json()["error"]["message"]
        assert "x00:" in message and f"x{MAX_SHOWN_PROBLEMS - 1:02d}:" in message
        assert f"x{MAX_SHOWN_PROBLEMS:02d}:" not in message
        assert f"and {30 - MAX_SHOWN_PROBLEMS} more problems" in message
    async with _client(bart) as c:  # the completion route's message for the same field, the oracle of its shape
        r = await c.post("/v1/completions", json={"prompt": "a", "bogus": "1"})
        assert r.status_code == 400 and "bogus: Extra inputs are not permitted (got '1')" in r.json()["error"]["message"]


@pytest.mark.asyncio
async def test_openai_and_vllm_transcription_fields_are_taken_and_sampling_applies(whisper, offline, tmp_path):
    audio = _wav("three one four five nine two six", tmp_path, "b.wav")
    full = offline.transcribe(str(tmp_path / "b.wav"), language="en", use_tqdm=False)[0].text
    short = offline.transcribe(str(tmp_path / "b.wav"), language="en", max_tokens=2, use_tqdm=False)[0].text
    assert short != full  # the oracle: max_tokens changes this transcript
    vllm = {"seed": "4419", "top_p": "0.9", "top_k": "5", "min_p": "0.01", "repetition_penalty": "1.0",
            "frequency_penalty": "0", "presence_penalty": "0", "temperature": "0"}
    openai_fields = {"model": "m", "language": "en", "prompt": "three", "response_format": "json",
                     "chunking_strategy": "auto", "stream": "false", "vad_filter": "false"}
    async with _client(whisper) as c:
        r = await _post_audio(c, ROUTES[0], audio, {**vllm, **openai_fields, "timestamp_granularities[]": "segment"})
        assert r.status_code == 200, r.text
        r = await _post_audio(c, ROUTES[0], audio, {"language": "en", "max_completion_tokens": "2"})
        assert r.status_code == 200 and r.json()["text"] == short
        r = await _post_audio(c, ROUTES[0], audio, {"language": "en", "top_k": "1", "seed": "3"})
        assert r.status_code == 200 and r.json()["text"] == full  # top_k=1 is greedy: the greedy oracle
        r = await _post_audio(c, ROUTES[1], audio, {"to_language": "en", "seed": "1"})
        assert r.status_code == 200, r.text
        bad = [
            (ROUTES[0], {"top_p": "0"}, "top_p"),
            (ROUTES[0], {"top_k": "1.5"}, "top_k"),
            (ROUTES[0], {"seed": "nan"}, "seed"),
            (ROUTES[0], {"min_p": "inf"}, "min_p"),
            (ROUTES[0], {"include[]": "logprobs"}, "include"),
            (ROUTES[0], {"chunking_strategy": '{"type": "server_vad"}'}, "chunking_strategy"),
            (ROUTES[0], {"to_language": "fr"}, "to_language"),
            (ROUTES[1], {"to_language": "fr"}, "to_language"),
            (ROUTES[0], {"stream_include_usage": "true"}, "stream_include_usage"),  # vLLM's: only with stream
            (ROUTES[0], {"stream_continuous_usage_stats": "true"}, "stream_continuous_usage_stats"),
            (ROUTES[0], {"stream_include_usage": "yes", "stream": "true"}, "stream_include_usage"),
        ]
        for route, fields, name in bad:
            r = await _post_audio(c, route, audio, fields)
            assert r.status_code == 400 and name in r.json()["error"]["message"], (route, fields, r.text)


# -- text_offset --------------------------------------------------------------------


def _check_offsets(text: str, lp: dict) -> None:
    tokens, offsets = lp["tokens"], lp["text_offset"]
    assert len(offsets) == len(tokens) == len(lp["token_logprobs"]) > 0
    for tok, at in zip(tokens, offsets):
        assert text[at:at + len(tok)] == tok, (text, tokens, offsets)
    assert "".join(tokens) == text  # every character is some token's
    for lp_top, tok in zip(lp["top_logprobs"], tokens):
        assert tok in lp_top  # the chosen token is found by its text


@pytest.mark.asyncio
async def test_text_offset_indexes_each_tokens_text_plain_and_streamed(bart):
    body = {"prompt": ["the rain in spain falls", "a cat sat on the mat"], "max_tokens": 12, "temperature": 0,
            "logprobs": 2}
    async with _client(bart) as c:
        r = await c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        plain = r.json()["choices"]
        for ch in plain:
            _check_offsets(ch["text"], ch["logprobs"])
        r = await c.post("/v1/completions", json={**body, "stream": True})
        assert r.status_code == 200
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    for ch in plain:
        mine = [k["choices"][0] for k in chunks if k["choices"][0]["index"] == ch["index"]]
        assert len([m for m in mine if m["logprobs"] and m["logprobs"]["tokens"]]) > 1  # several chunks
        text = "".join(m["text"] for m in mine)
        joined = {k: [x for m in mine if m["logprobs"] for x in m["logprobs"][k]]
                  for k in ("tokens", "text_offset", "token_logprobs", "top_logprobs")}
        assert text == ch["text"]
        _check_offsets(text, joined)  # offsets index the whole text: cumulative across chunks
        assert joined["text_offset"] == ch["logprobs"]["text_offset"]
        assert joined["tokens"] == ch["logprobs"]["tokens"]


# -- streamed transcription deltas ----------------------------------------------------


def _events(r: httpx.Response) -> list:
    lines = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]", r.text
    return [json.loads(x) for x in lines[:-1]]


@pytest.mark.asyncio
@pytest.mark.parametrize("words,fmt", [
    ("three one four", "json"),  # one window, no timestamps
    ("hello world", "verbose_json"),  # one window, with timestamps
    (" ".join(["one two three four five six seven eight nine zero"] * 11), "json"),  # 33.2 s: two windows
])
async def test_a_streamed_transcription_sends_deltas_that_join_to_its_text(whisper, tmp_path, words, fmt):
    audio = _wav(words, tmp_path, "c.wav")
    async with _client(whisper) as c:
        plain = await _post_audio(c, ROUTES[0], audio, {"language": "en", "response_format": fmt})
        assert plain.status_code == 200, plain.text
        r = await _post_audio(c, ROUTES[0], audio, {"language": "en", "response_format": fmt, "stream": "true"})
        assert r.status_code == 200
    events = _events(r)
    deltas = [e for e in events if e["type"] == "transcript.text.delta"]
    assert events[-1]["type"] == "transcript.text.done" and events[:-1] == deltas
    text = plain.json()["text"]
    assert text and events[-1]["text"] == text
    assert deltas and all(d["delta"] for d in deltas)
    assert "".join(d["delta"] for d in deltas) == text
    if len(words.split()) > 100:
        assert len(deltas) >= 2  # a delta per window, as it finished


# -- the stream's vLLM shape and usage ------------------------------------------------


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in metrics")


@pytest.mark.asyncio
@pytest.mark.parametrize("route,words", [
    (ROUTES[0], "three one four"),  # one window
    (ROUTES[0], " ".join(["one two three four five six seven eight nine zero"] * 11)),  # 33.2 s: two windows
    (ROUTES[1], "hello world"),
])
async def test_a_stream_carries_vllms_chunk_shape_and_its_usage_when_asked(whisper, tmp_path, route, words):
    audio = _wav(words, tmp_path, "d.wav")
    obj = "translation.chunk" if route == ROUTES[1] else "transcription.chunk"
    async with _client(whisper) as c:
        plain = await _post_audio(c, route, audio, {"language": "en"})
        assert plain.status_code == 200, plain.text
        text = plain.json()["text"]
        before = (await c.get("/metrics")).text
        r = await _post_audio(c, route, audio, {"language": "en", "stream": "true", "stream_include_usage": "true",
                                                "stream_continuous_usage_stats": "true"})
        assert r.status_code == 200, r.text
        after = (await c.get("/metrics")).text
        bare = await _post_audio(c, route, audio, {"language": "en", "stream": "true"})
        alone = await _post_audio(c, route, audio, {"language": "en", "stream": "true",
                                                    "stream_continuous_usage_stats": "true"})
    events = _events(r)
    *deltas, done = events
    for e in events:  # vLLM's TranscriptionStreamResponse keys, beside OpenAI's
        assert e["object"] == obj and e["model"] == "m" and isinstance(e["created"], int)
        assert e["id"] == events[0]["id"]
    # vLLM's reading: each chunk's choices[0].delta.content, joined; a finish reason per chunk
    # (each is whole windows); the last chunk has one choice too (vLLM's translation client reads
    # choices[0] of every chunk), with no new text, and the usage
    assert "".join(e["choices"][0]["delta"]["content"] for e in events) == text
    assert all(len(e["choices"]) == 1 and e["choices"][0]["finish_reason"] in ("stop", "length") for e in events)
    assert [d["choices"][0]["delta"]["content"] for d in deltas] == [d["delta"] for d in deltas]
    assert done["choices"][0]["delta"] == {"content": ""} and done["text"] == text
    # usage: what the server's own counters counted for this request
    prompt = _metric(after, "tandem:prompt_tokens_total") - _metric(before, "tandem:prompt_tokens_total")
    generated = _metric(after, "tandem:generation_tokens_total") - _metric(before, "tandem:generation_tokens_total")
    assert done["usage"] == {"prompt_tokens": prompt, "completion_tokens": generated,
                             "total_tokens": prompt + generated}
    assert generated >= len(text.split()) > 0 and prompt > 0  # each word one token at least
    # continuous: on every delta, counting up to the final usage
    used = [d["usage"]["total_tokens"] for d in deltas]
    assert used == sorted(used) and used[-1] <= done["usage"]["total_tokens"]
    assert all(d["usage"]["total_tokens"] == d["usage"]["prompt_tokens"] + d["usage"]["completion_tokens"]
               for d in deltas)
    # without stream_include_usage, no usage (the continuous stats alone too, as vLLM)
    for other in (bare, alone):
        assert other.status_code == 200 and not any("usage" in e for e in _events(other))
        assert _events(other)[-1]["text"] == text


@pytest.mark.asyncio
@pytest.mark.parametrize("route", ROUTES)
async def test_every_stream_event_reads_as_vllms_translation_client_reads_it(whisper, tmp_path, route):
    """vLLM's examples/online_serving/openai_translation_client.py reads a stream line by line:
    ``data: `` stripped, ``[DONE]`` ends it, every other line is JSON whose ``choices[0]`` it
    reads; the contents printed are the whole text. (Its done event had ``choices: []``, an
    IndexError in that client.)"""
    audio = _wav("hello world", tmp_path, "e.wav")
    async with _client(whisper) as c:
        text = (await _post_audio(c, route, audio, {"language": "en"})).json()["text"]
        r = await _post_audio(c, route, audio, {"language": "en", "stream": "true", "model": "m"})
    assert r.status_code == 200, r.text
    printed, ended = [], False
    for line in r.text.splitlines():  # vLLM's loop, as its client writes it
        if line:
            if line.startswith("data: "):
                line = line[len("data: "):]
            if line.strip() == "[DONE]":
                ended = True
                break
            chunk = json.loads(line)
            printed.append(chunk["choices"][0].get("delta", {}).get("content"))
    assert ended and "".join(printed) == text == "hello world"
