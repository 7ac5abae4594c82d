"""A forced shutdown of a real ``tandem serve`` process: a second SIGTERM 0.1 s
after the first cuts every in-flight request at once: plain requests get a JSON
503 in OpenAI's shape, streams a final 503 error event. The process exits 0
within a bound, and the log has one line for the cut and no traceback. (The
audio endpoints' answers to the same cut: ``test_serve_hostile.py``, in-process.)
Every wait is bounded."""

from __future__ import annotations

import concurrent.futures
import json
import signal
import time

import httpx
import pytest

WAIT = 60.0
# How long the server may take to exit after the second signal: the cut answers at
# once; the engine stops after its step; interpreter teardown (torch) takes a few.
EXIT_BOUND = 20.0


def _start(model_dir, log_path, *extra):
    from test_serve import _start as start

    return start(model_dir, *extra, log_path=log_path)


def _in_engine(url: str) -> float:
    """Requests the engine holds: running and waiting."""
    from test_serve import _metric

    text = httpx.get(f"{url}/metrics", timeout=5).text
    return _metric(text, "tandem:num_requests_running") + _metric(text, "tandem:num_requests_waiting")


def _outcome(kind: str, r: httpx.Response) -> str:
    """'ok' for a completed 200, 'cut' for a JSON 503 (or a stream ending with a 503
    event); anything else fails the test."""
    if r.status_code == 503:
        assert r.headers["content-type"].startswith("application/json"), r.text[:300]
        err = r.json()["error"]
        assert err["code"] == 503 and err["type"] == "overloaded_error", err
        assert "shutting down" in err["message"] and "second signal" in err["message"], err
        return "cut"
    assert r.status_code == 200, (kind, r.status_code, r.text[:300])
    if kind.endswith("stream"):
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events, r.text[:300]
        if events[-1] == "[DONE]":
            return "ok"
        last = json.loads(events[-1])
        assert last["error"]["code"] == 503 and "second signal" in last["error"]["message"], last
        return "cut"
    assert "error" not in r.json(), r.text[:300]
    return "ok"


def _force(proc, url, submit, n: int, gap: float, log_path) -> list[str]:
    """``n`` concurrent requests (``submit(i)`` -> (kind, response)), SIGTERM once
    some run, SIGTERM again ``gap`` s later; their outcomes."""
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        futs = [pool.submit(submit, i) for i in range(n)]
        deadline = time.monotonic() + WAIT
        while _in_engine(url) + sum(f.done() for f in futs) < n:  # every one in: none meets the closed socket
            assert time.monotonic() < deadline, "the requests did not all reach the engine"
            time.sleep(0.05)
        time.sleep(0.3)  # the streams are past their first events
        proc.send_signal(signal.SIGTERM)
        time.sleep(gap)
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        outcomes = [_outcome(*f.result(timeout=WAIT)) for f in futs]
    rc = proc.wait(timeout=WAIT)
    took = time.monotonic() - start
    log = open(log_path).read()
    assert rc == 0, log[-3000:]
    assert took < EXIT_BOUND, (took, log[-3000:])
    assert "Traceback" not in log and "Exception in ASGI" not in log, log[-5000:]
    assert log.count("a second SIGTERM: shutting down now") == 1, log[-3000:]
    assert "cancelled" not in log  # every request answered the cut itself, none needed the last resort
    return outcomes


def test_a_second_sigterm_cuts_completions_with_json_503s(bart_dir, tmp_path):
    log_path = tmp_path / "serve.log"
    # One sequence at a time: 36 requests of 120 tokens run for far longer than the test waits.
    proc, url = _start(bart_dir, log_path, "--max-num-seqs", "1")
    body = {"prompt": "the rain in spain", "max_tokens": 120, "ignore_eos": True, "temperature": 0.0}

    def submit(i):
        stream = i % 3 == 0
        r = httpx.post(f"{url}/v1/completions", json={**body, "stream": stream}, timeout=WAIT)
        return ("stream" if stream else "plain", r)

    try:
        outcomes = _force(proc, url, submit, 36, 0.1, log_path)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=WAIT)
    assert outcomes.count("cut") >= 30, outcomes  # a few may have finished in the 0.1 s


@pytest.mark.asyncio
async def test_a_second_sigint_a_second_later_cuts_at_once():
    """The signal handling itself, in this process: the first signal only asks the
    server to stop (the drain), a second of either kind, however late, cuts."""
    import asyncio
    import os

    import uvicorn

    from tandem.entrypoints.openai.shutdown import FORCED, DrainCut, make_server

    cut = DrainCut()
    server = make_server(uvicorn.Config(lambda scope, receive, send: None), cut=cut, drain_timeout=30)
    with server.capture_signals():
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.sleep(1.0)
        assert server.should_exit and not cut.is_set()  # draining
        os.kill(os.getpid(), signal.SIGINT)
        await asyncio.wait_for(cut.wait(), 5)
    assert cut.reason == FORCED and "a second signal forced the shutdown" in cut.message
    if server._hard_stop is not None:
        server._hard_stop.cancel()


@pytest.mark.asyncio
async def test_a_cancelled_stream_still_ends_with_a_503_event():
    """The last resort (a request that did not answer the cut in time is cancelled):
    the guard ends its stream with a 503 event and the task ends normally, so
    uvicorn writes no traceback; one that had not answered gets a JSON 503."""
    import asyncio

    from tandem.entrypoints.openai.guard import Guard

    async def streaming(scope, receive, send):
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8")]})
        await send({"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True})
        await asyncio.sleep(3600)

    async def silent(scope, receive, send):
        await asyncio.sleep(3600)

    async def receive():
        await asyncio.sleep(3600)

    for app in (streaming, silent):
        sent: list[dict] = []

        async def send(message):
            sent.append(message)

        guard = Guard(app, api_key=None, max_body_bytes=1 << 20)
        task = asyncio.create_task(guard({"type": "http", "path": "/v1/completions", "method": "POST",
                                          "headers": []}, receive, send))
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.wait_for(task, 5)  # returns: not cancelled, no exception
        assert not task.cancelled() and sent[-1]["more_body"] is False
        last = sent[-1]["body"].decode()
        if app is streaming:
            assert sent[0]["status"] == 200 and last.startswith("data: ")
            err = json.loads(last[6:])["error"]
        else:
            assert sent[0]["status"] == 503
            err = json.loads(last)["error"]
        assert err["code"] == 503 and "shutting down" in err["message"]
