"""Streamed completions that cost little (issue 53, frontend part):

- ``stream_interval`` (``--stream-interval``): a stream of N tokens per event sends the
  first output, one every N tokens and the last, and its events joined are the
  every-token stream's text, tokens and usage (stop strings and ``n`` > 1 too);
- the SSE chunks built from a template (``sse.CompletionChunks``) are the JSON
  ``json.dumps`` writes for the chunk dict;
- a client that disconnects (mid-stream, before its stream's first output, or while a
  plain request runs) has its request aborted in the engine within one step (a real
  uvicorn server on 127.0.0.1, steps slowed to 0.2 s so a step is long beside the event
  loop's reaction).

In-process through ``httpx.ASGITransport`` but for the disconnect. Every wait is bounded."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest

from tandem import AsyncLLM
from tandem.entrypoints.openai.api_server import build_app
from tandem.entrypoints.openai.sse import CompletionChunks

WAIT = 60.0
PROMPT = "the rain in spain falls mainly"
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def engines(bart_dir):
    """Two engines of the same model: every token an event, and 3 tokens an event."""
    made = {k: AsyncLLM(model=str(bart_dir), dtype="float32", device="cpu", stream_interval=k) for k in (1, 3)}
    yield made
    for engine in made.values():
        asyncio.run(engine.shutdown(timeout=WAIT))


def _client(engine) -> httpx.AsyncClient:
    app = build_app(engine, served_model_name="m")
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=WAIT)


def _events(text: str) -> tuple[list[dict], bool]:
    lines = [line for line in text.split("\n\n") if line]
    assert all(line.startswith("data: ") for line in lines), lines
    done = lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines if line != "data: [DONE]"], done


async def _stream(engine, **fields) -> tuple[list[dict], dict]:
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, "logprobs": 1, **fields}
    async with _client(engine) as c:
        r = await c.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    events, done = _events(r.text)
    assert done and events[-1]["choices"] == []
    return events[:-1], events[-1]["usage"]


def _joined(events: list[dict], index: int) -> dict:
    choices = [e["choices"][0] for e in events if e["choices"][0]["index"] == index]
    lp = [c["logprobs"] for c in choices]
    return {"text": "".join(c["text"] for c in choices), "finish": [c["finish_reason"] for c in choices][-1],
            "stop_reason": choices[-1]["stop_reason"], "tokens": [t for x in lp for t in x["tokens"]],
            "token_logprobs": [t for x in lp for t in x["token_logprobs"]],
            "text_offset": [t for x in lp for t in x["text_offset"]], "events": len(choices)}


def _expected_events(tokens: int, interval: int) -> int:
    """The first token's event, one each time ``interval`` more are due, and the last."""
    return len(set(range(1, tokens + 1, interval)) | {tokens})


@pytest.mark.asyncio
async def test_stream_interval_sends_fewer_events_that_join_to_the_same_stream(engines):
    every, usage = await _stream(engines[1])
    fewer, usage3 = await _stream(engines[3])
    a, b = _joined(every, 0), _joined(fewer, 0)
    assert a["events"] == MAX_TOKENS and b["events"] == _expected_events(MAX_TOKENS, 3) == 4
    assert {k: v for k, v in a.items() if k != "events"} == {k: v for k, v in b.items() if k != "events"}
    assert a["finish"] == "length" and len(a["tokens"]) == MAX_TOKENS and usage == usage3
    # Every chunk but the last is one the every-token stream also reaches: text is never held back.
    assert all(not e["choices"][0]["finish_reason"] for e in fewer[:-1])


@pytest.mark.asyncio
async def test_stream_interval_with_a_stop_string_and_several_choices(engines):
    every, _ = await _stream(engines[1], logprobs=None)
    text = _joined_text(every)
    stop = text.split()[2][:2]  # inside the third word: spans no more than the text so far
    # (Not seeded sampling with n > 1 and a stop string: when a choice's stop reaches the core
    # decides its sibling's random draws, so two runs of it differ, every token an event or not.)
    for fields in ({"stop": [stop]}, {"n": 2, "temperature": 1.0, "seed": 7}, {"n": 2, "stop": [stop]}):
        every, usage = await _stream(engines[1], logprobs=None, **fields)
        fewer, usage3 = await _stream(engines[3], logprobs=None, **fields)
        for index in range(fields.get("n", 1)):
            assert _joined_text(every, index) == _joined_text(fewer, index), (fields, index)
            ends = [[e["choices"][0][k] for k in ("finish_reason", "stop_reason")] for s in (every, fewer)
                    for e in s if e["choices"][0]["index"] == index and e["choices"][0]["finish_reason"]]
            assert ends[0] == ends[-1] and len(ends) == 2, ends
        assert usage == usage3
        assert len(fewer) < len(every)
    assert ends[0][0] in ("stop", "length")


def _joined_text(events: list[dict], index: int = 0) -> str:
    return "".join(e["choices"][0]["text"] for e in events if e["choices"][0]["index"] == index)


def test_stream_interval_must_be_a_positive_integer(bart_dir):
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="stream_interval"):
            AsyncLLM(model=str(bart_dir), dtype="float32", device="cpu", stream_interval=bad, start=False)


# -- the chunks' bytes -------------------------------------------------------------------------
@pytest.mark.parametrize("text,logprobs,finish,stop", [
    (" the rain", None, None, None),
    ("", None, "length", None),
    ("a \"quoted\"\n\\ line\t", None, "stop", "</s>"),
    ("ünïcødé ☂ 雨", {"tokens": ["雨"], "token_logprobs": [-0.5], "top_logprobs": [{"雨": -0.5}],
                    "text_offset": [0]}, "stop", 2),
])
def test_a_template_chunk_is_the_chunk_json_dumps_writes(text, logprobs, finish, stop):
    chunks = CompletionChunks("cmpl-1", 1700000000, "tiny/bart \"m\"")
    got = chunks.choice(3, text, logprobs, finish, stop)
    chunk = {"id": "cmpl-1", "object": "text_completion", "created": 1700000000, "model": "tiny/bart \"m\"",
             "choices": [{"index": 3, "text": text, "logprobs": logprobs, "finish_reason": finish,
                          "stop_reason": stop}]}
    assert got.startswith(b"data: ") and got.endswith(b"\n\n")
    assert json.loads(got[6:]) == chunk
    if text.isascii() and logprobs is None:  # byte for byte, spaces included
        assert got == f"data: {json.dumps(chunk)}\n\n".encode()
    usage = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}
    assert chunks.usage(usage) == f"data: {json.dumps({**chunk, 'choices': [], 'usage': usage})}\n\n".encode()


# -- disconnects -------------------------------------------------------------------------------
STEP = 0.2  # seconds each engine step takes in these tests
REACT = 0.1  # seconds the server may take to see a close and send the abort


@pytest.mark.parametrize("stream,leave", [(True, "after three events"), (True, "before its first output"),
                                          (False, "while it runs")])
def test_a_client_that_leaves_has_its_request_aborted_within_one_step(engines, monkeypatch, stream, leave):
    """Steps take 0.2 s. After the client closes its connection, no step the engine starts
    runs the request but the one that may start before the server saw the close (within
    ``REACT``): the abort reaches the engine before its next step. (Before issue 53, a
    stream's request ran one more step when the client left before its first output,
    and a plain request up to 0.25 s more: the disconnect was polled.)"""
    from test_serve_requests import _uvicorn

    engine = engines[1]
    core = engine.engine.core
    step = core.step
    steps: list[tuple[float, bool]] = []  # each step's start, and whether the request ran in it

    def slow():
        steps.append((time.monotonic(), bool(core.stats.live_request_ids)))
        time.sleep(STEP)
        return step()

    monkeypatch.setattr(core, "step", slow)
    body = json.dumps({"prompt": PROMPT, "max_tokens": 100, "temperature": 0, "ignore_eos": True,
                       "stream": stream}).encode()
    with _uvicorn(build_app(engine, served_model_name="m")) as port:
        with socket.create_connection(("127.0.0.1", port), timeout=WAIT) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
                      b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            if leave == "after three events":
                got = b""
                while got.count(b"data: ") < 3:  # three tokens streamed: the request runs
                    chunk = s.recv(65536)
                    assert chunk, got
                    got += chunk
                assert b" 200 " in got.split(b"\r\n", 1)[0]
            else:  # queued in the engine (its first output a step away), or running a while
                deadline = time.monotonic() + WAIT
                while not core.stats.live_request_ids or (leave == "while it runs"
                                                          and sum(live for _, live in steps) < 2):
                    assert time.monotonic() < deadline, "the request never reached the engine"
                    time.sleep(0.005)
        closed = time.monotonic()
        deadline, idle_since = closed + WAIT, None
        while idle_since is None or time.monotonic() - idle_since < 3 * STEP:  # idle for steps' time
            assert time.monotonic() < deadline, "the request was never aborted"
            busy = core.stats.live_request_ids or core.stats.num_requests_unfinished
            idle_since = None if busy else idle_since or time.monotonic()
            time.sleep(0.01)
    after = [round(t - closed, 3) for t, live in steps if t > closed + REACT and live]
    assert not after, f"steps ran the request {after} s after the client left"
    assert len(steps) < 10  # never near its 100 tokens
    stats = engine.get_stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_the_server_keeps_its_startup_heap_out_of_the_collectors_way():
    import gc

    from tandem.entrypoints.openai.api_server import frozen_heap

    assert gc.get_freeze_count() == 0
    with frozen_heap():
        assert gc.get_freeze_count() > 0  # what was alive at start: never walked by a collection
    assert gc.get_freeze_count() == 0
