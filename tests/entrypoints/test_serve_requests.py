"""``tandem serve``'s requests and connections (docs/serving.md, Security, "Requests and
connections"):

- a lone surrogate (``"\\ud800"``) in any text field is a 400 naming the field and position;
- a long ``model`` is a 400 that shows it cut;
- ``best_of`` must be >= ``n`` (OpenAI's rule), naming both;
- a request-validation error names the first problems and counts the rest: 200,000 unknown
  fields no longer make a 9.7 MB answer;
- a connection that sends nothing, a request head a byte at a time (slowloris), or a body
  that stalls is closed after ``--header-timeout`` / ``--body-timeout``; an idle kept-alive one
  after ``--keep-alive-timeout``; a request whose body is in is never timed.

The connection tests drive a real uvicorn server on 127.0.0.1 (in a thread, with the options
``tandem serve`` parses, and in one slow test the ``tandem serve`` process) over raw sockets;
the rest go through ``httpx.ASGITransport``. The timeouts under test are 1 s; every wait for
the server to act is bounded by ``WAIT`` (30 s: 30x the timeout, for a loaded 2-core machine).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import select
import socket
import threading
import time

import httpx
import pytest
import uvicorn

from helpers import SUBPROCESS_TIMEOUT
from tandem import AsyncLLM
from tandem.entrypoints.cli import _build_parser
from tandem.entrypoints.openai.api_server import build_app
from tandem.entrypoints.openai.connections import uvicorn_options
from tandem.entrypoints.openai.protocol import MAX_SHOWN_PROBLEMS

WAIT = 30.0
PROMPT = {"prompt_token_ids": [0, 17, 5, 9, 2]}


@pytest.fixture(scope="module")
def bart_engine(bart_dir):
    engine = AsyncLLM(model=str(bart_dir), dtype="float32", device="cpu")
    yield engine
    asyncio.run(engine.shutdown(timeout=60))


def _client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=60)


def _error(r: httpx.Response, status: int) -> str:
    assert r.status_code == status, (r.status_code, r.text[:500])
    err = r.json()["error"]
    assert err["code"] == status
    return err["message"]


async def _post_raw(c: httpx.AsyncClient, body: str) -> httpx.Response:
    # Hand-written JSON: json.dumps would escape a lone surrogate as the client meant it anyway,
    # but a literal "\ud800" escape is what a hostile client sends.
    return await c.post("/v1/completions", content=body.encode(), headers={"content-type": "application/json"})


# ------------------------------------------------------------------ request fields


@pytest.mark.asyncio
async def test_a_lone_surrogate_is_a_400_naming_the_field_and_position(bart_engine):
    app = build_app(bart_engine, served_model_name="m")
    cases = [
        ('{"prompt": "ab\\ud800cd"}', "prompt: a lone surrogate U+D800 at character 2 (of 5)"),
        ('{"prompt": ["fine", "\\udc00x"]}', "prompt[1]: a lone surrogate U+DC00 at character 0 (of 2)"),
        ('{"prompt": {"encoder_prompt": "hi", "decoder_prompt": "abc\\ud800"}}',
         "prompt.decoder_prompt: a lone surrogate U+D800 at character 3 (of 4)"),
        ('{"prompt": "hi", "stop": ["ok", "\\ud800"]}', "stop[1]: a lone surrogate U+D800 at character 0"),
        ('{"prompt": "hi", "x\\ud800": 1}', "the key 'x\\ud800': a lone surrogate U+D800 at character 1"),
    ]
    async with _client(app) as c:
        for body, want in cases:
            assert _error(await _post_raw(c, body), 400).startswith(want), body
        # A broken escape that is no surrogate stays the parser's own message, with its position.
        assert _error(await _post_raw(c, '{"prompt": "\\u12"}'), 400).startswith("invalid JSON body: ")
        ok = await _post_raw(c, '{"prompt": "ab\\ud83d\\ude00cd", "max_tokens": 2}')  # a pair: one code point
        assert ok.status_code == 200, ok.text


@pytest.mark.asyncio
async def test_a_long_model_name_is_a_404_that_shows_it_cut(bart_engine):
    app = build_app(bart_engine, served_model_name="m")
    async with _client(app) as c:
        r = await c.post("/v1/completions", json={"prompt": PROMPT, "model": "x" * 5000})
        message = _error(r, 404)
    assert message.startswith("model='xxx") and message.endswith("...: this server serves 'm'")
    assert len(r.content) < 1000, len(r.content)


@pytest.mark.asyncio
async def test_best_of_must_be_at_least_n(bart_engine):
    app = build_app(bart_engine, served_model_name="m")
    async with _client(app) as c:
        for best_of, n, want in ((1, 3, "best_of=1 must be >= n=3"), (0, None, "best_of=0 must be >= n=1"),
                                 (4, 2, "best_of=4 with n=2 is not supported")):
            body = {"prompt": PROMPT, "max_tokens": 2, "best_of": best_of, **({"n": n} if n is not None else {})}
            assert _error(await c.post("/v1/completions", json=body), 400).startswith(want), body
        for best_of, n in ((3, 3), (1, None)):  # best_of == n: n completions
            body = {"prompt": PROMPT, "max_tokens": 2, "best_of": best_of, **({"n": n} if n is not None else {})}
            r = await c.post("/v1/completions", json=body)
            assert r.status_code == 200 and len(r.json()["choices"]) == (n or 1), r.text


@pytest.mark.asyncio
async def test_validation_errors_name_the_first_problems_and_count_the_rest(bart_engine):
    app = build_app(bart_engine, served_model_name="m")
    count = 200_000
    body = '{"prompt": "hi", ' + ", ".join(f'"f{i}": 1' for i in range(count)) + "}"
    async with _client(app) as c:
        r = await _post_raw(c, body)
        message = _error(r, 400)
        assert len(r.content) < 16 << 10, len(r.content)  # was 9.7 MB
        shown = [f"f{i}: Extra inputs are not permitted" for i in range(MAX_SHOWN_PROBLEMS)]
        assert message.split("; ")[:MAX_SHOWN_PROBLEMS] == [s + " (got 1)" for s in shown]
        assert message.endswith(f"; and {count - MAX_SHOWN_PROBLEMS} more problems (the first "
                                f"{MAX_SHOWN_PROBLEMS} are shown)")
        # One problem with a huge name and value: both cut.
        r = await c.post("/v1/completions", json={"prompt": PROMPT, "k" * 100_000: "v" * 100_000})
        assert _error(r, 400).startswith("kkkk") and len(r.content) < 2000, len(r.content)
        # A few problems: all named, none counted.
        r = await c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": "5", "n": True})
        message = _error(r, 400)
        assert message.startswith("max_tokens") and "; n: " in message and "more problem" not in message


# ------------------------------------------------------------------ connections


@contextlib.contextmanager
def _uvicorn(app, *flags):
    """``app`` served by uvicorn on 127.0.0.1 in a thread, with the connection options
    ``tandem serve`` parses from ``flags``: yields the port."""
    args = _build_parser()[1]["serve"].parse_args(["model", *flags])
    # lifespan off: the app's shutdown would stop the module's engine. log_config None: uvicorn
    # leaves logging as it is, so its records reach pytest's caplog.
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_config=None, lifespan="off",
                            **uvicorn_options(args))
    server = uvicorn.Server(config)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        for _ in range(int(WAIT / 0.02)):
            if server.started:
                break
            time.sleep(0.02)
        assert server.started, "uvicorn did not start"
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(WAIT)
        sock.close()


@pytest.fixture(scope="module")
def timed_port(bart_engine):
    app = build_app(bart_engine, served_model_name="m")
    with _uvicorn(app, "--header-timeout", "1", "--body-timeout", "1", "--keep-alive-timeout", "1") as port:
        yield port


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=WAIT)


def _read_until_closed(s: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection; a socket.timeout (the
    test's failure) if it keeps it open for WAIT seconds."""
    data = b""
    while True:
        chunk = s.recv(65536)
        if not chunk:
            return data
        data += chunk


def _trickle(s: socket.socket, head: bytes, seconds: float = WAIT) -> bytes:
    """Send ``head``, then one more header byte every 0.05 s for up to ``seconds``, until
    the server answers or closes: what it sent."""
    s.sendall(head)
    for _ in range(int(seconds / 0.05)):
        try:
            s.sendall(b"x")
        except OSError:  # closed under us
            break
        readable, _, _ = select.select([s], [], [], 0.05)
        if readable:
            break
    with contextlib.suppress(ConnectionResetError):
        return _read_until_closed(s)
    return b""


def test_a_connection_that_sends_nothing_is_closed(timed_port):
    with _connect(timed_port) as s:
        assert _read_until_closed(s) == b""  # closed, nothing said: it asked nothing


def test_headers_sent_a_byte_at_a_time_get_408_and_are_closed(timed_port):
    with _connect(timed_port) as s:
        got = _trickle(s, b"POST /v1/completions HTTP/1.1\r\nhost: t\r\nx-slow: ")
    assert got.startswith(b"HTTP/1.1 408 "), got[:200]
    assert b"--header-timeout" in got.partition(b"\r\n\r\n")[2]


def test_a_stalled_body_is_closed_without_a_traceback(timed_port, caplog):
    caplog.set_level(logging.ERROR)
    with _connect(timed_port) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
                  b"content-length: 100\r\n\r\n{\"prompt\": ")
        assert _read_until_closed(s) == b""
    # The handler saw the disconnect; no "Exception in ASGI application" for it.
    time.sleep(0.2)  # not a bound on anything: lets the handler's task end before the log is read
    assert not [r for r in caplog.records if "Exception" in r.getMessage()], caplog.text[-2000:]


def test_an_idle_kept_alive_connection_is_closed_and_answered_requests_are_never_timed(timed_port, monkeypatch,
                                                                                      bart_engine):
    from test_serve_hostile import _slow_steps

    steps = _slow_steps(monkeypatch, bart_engine)  # 40 steps of 0.05 s: 2 s, twice every timeout
    body = json.dumps({"prompt": PROMPT, "max_tokens": 40, "ignore_eos": True, "temperature": 0}).encode()
    with _connect(timed_port) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
                  b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        got = b""
        while b"\r\n\r\n" not in got or len(got.partition(b"\r\n\r\n")[2]) < _length(got):
            chunk = s.recv(65536)
            assert chunk, got
            got += chunk
        assert got.startswith(b"HTTP/1.1 200 "), got[:300]
        assert len(json.loads(got.partition(b"\r\n\r\n")[2])["choices"][0]["text"]) > 0
        assert len(steps) >= 40
        assert _read_until_closed(s) == b""  # then idle past --keep-alive-timeout: closed


def _length(response: bytes) -> int:
    head = response.partition(b"\r\n\r\n")[0].lower()
    for line in head.split(b"\r\n"):
        if line.startswith(b"content-length:"):
            return int(line.split(b":")[1])
    return 1 << 30


@pytest.mark.slow
def test_tandem_serve_takes_the_timeout_flags(bart_dir):
    from test_serve import _start

    proc, url = _start(bart_dir, "--header-timeout", "1", "--body-timeout", "1")
    try:
        port = int(url.rsplit(":", 1)[1])
        with _connect(port) as s:
            got = _trickle(s, b"GET /health HTTP/1.1\r\nhost: t\r\nx-slow: ")
        assert got.startswith(b"HTTP/1.1 408 "), got[:200]
        assert httpx.get(f"{url}/health", timeout=WAIT).status_code == 200
    finally:
        proc.terminate()
        proc.wait(timeout=SUBPROCESS_TIMEOUT)
