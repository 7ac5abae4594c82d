"""``tandem serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over ``AsyncLLM``.

Endpoints: ``POST /v1/completions`` (plain or streamed as server-sent events),
``POST /v1/audio/transcriptions`` and ``/translations`` (Whisper),
``GET /v1/models``, ``/health``, ``/version``, ``/metrics`` (Prometheus) and
``/openapi.json``. Errors have OpenAI's shape: 400 for a bad request (naming the
value), 401 for a wrong or missing API key, 413 for a body (or audio) over its
limit, 503 with ``Retry-After`` when the queue is full, 503 when the engine is
dead or the server is shutting down. A client that disconnects aborts its
request. SIGTERM stops taking requests, lets the running ones finish for up to
``--drain-timeout`` seconds (a second signal: none), answers the rest with a
JSON 503 and exits 0 (``shutdown.py``).

Every limit is enforced before the work it bounds: request bodies are counted
as they arrive (chunked or not) and refused once over ``--max-body-bytes``,
never buffered whole; audio is refused from its header or part-way through
decoding once over ``--max-audio-seconds``; ``--max-queued-requests`` counts the
sequences a request would queue (prompts times ``n``), not HTTP requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
import uuid
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from tandem.entrypoints.async_llm import AsyncLLM, EngineDeadError
from tandem.entrypoints.openai.metrics import AudioMeter, ServerMetrics
from tandem.entrypoints.openai.protocol import CompletionRequest, error_body
from tandem.entrypoints.openai.shutdown import CUT_GRACE_SECONDS, SHUTTING_DOWN, DrainCut, make_server

logger = logging.getLogger("tandem.serve")

DEFAULT_MAX_BODY_BYTES = 4 << 20
# 30 minutes: more than any ordinary speech upload that fits the default 4 MiB body
# (4 MiB of 16 kHz 16-bit WAV is 131 s; of 20 kbit/s Opus, 28 minutes), while a
# file that expands past it (a WAV declaring 1 Hz, an hour of silence in a small
# FLAC) is refused after at most 30 minutes were decoded: 115 MB of 16 kHz float32
# and 60 of Whisper's 30-second windows.
DEFAULT_MAX_AUDIO_SECONDS = 1800.0
# Paths that need no API key (a load balancer's probes and Prometheus scrapes).
OPEN_PATHS = frozenset({"/health", "/version", "/metrics"})
# The non-file fields of an audio upload (model, language, prompt, ...): few and short.
MAX_FORM_FIELDS = 16
MAX_FORM_FIELD_BYTES = 64 << 10


class _HTTPError(Exception):
    def __init__(self, status: int, message: str, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers or {}


class _BodyTooLarge(Exception):
    """Raised into the app from ``receive`` once the body passes the limit."""


def _json_response_messages(status: int, message: str, headers: dict | None = None) -> tuple[dict, dict]:
    body = json.dumps(error_body(status, message)).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), str(v).encode()) for k, v in (headers or {}).items()]
    return ({"type": "http.response.start", "status": status, "headers": raw},
            {"type": "http.response.body", "body": body, "more_body": False})


class _Guard:
    """Pure ASGI middleware in front of every route: the API key, and the body limit.

    The body is counted as the app reads it (``http.request`` messages, whatever
    the framing: Content-Length or chunked), and the read that passes
    ``max_body_bytes`` raises instead of returning: nothing past the limit is
    read, and the app's own answer is replaced by a 413 sent with
    ``Connection: close`` (the client stops uploading; the server never reads
    the rest). A declared Content-Length over the limit is refused before any of
    the body is read. A request task cancelled before it answered (uvicorn's
    hard stop at shutdown) still gets a JSON 503 rather than uvicorn's plain-text
    500, and a stream cancelled part-way ends with a 503 error event."""

    def __init__(self, app, *, api_key: str | None, max_body_bytes: int) -> None:
        self.app, self.api_key, self.max_body_bytes = app, api_key, max_body_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_body_bytes
        headers = dict(scope.get("headers") or [])
        if self.api_key is not None and scope["path"] not in OPEN_PATHS:
            if headers.get(b"authorization", b"").decode("latin-1") != f"Bearer {self.api_key}":
                await self._send(send, 401, "invalid or missing API key (send 'Authorization: Bearer <key>')")
                return
        length = headers.get(b"content-length", b"").decode("latin-1")
        if length.isdigit() and int(length) > limit:
            await self._send(send, 413, f"request body of {length} bytes is over the {limit}-byte limit "
                                        "(--max-body-bytes)", {"connection": "close"})
            return

        state = {"read": 0, "over": False, "started": False, "ended": False, "events": False}

        async def counted_receive():
            if state["over"]:  # never read past the limit
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                state["read"] += len(message.get("body", b""))
                if state["read"] > limit:
                    state["over"] = True
                    raise _BodyTooLarge()
            return message

        async def guarded_send(message):
            if state["over"]:  # the app's answer to a body it could not read: the 413 replaces it
                return
            if message["type"] == "http.response.start":
                state["started"] = True
                ctype = dict(message.get("headers") or []).get(b"content-type", b"")
                state["events"] = ctype.startswith(b"text/event-stream")
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                state["ended"] = True
            await send(message)

        try:
            await self.app(scope, counted_receive, guarded_send)
        except asyncio.CancelledError:
            # Cancelled by the shutdown's last resort (shutdown.py counts them in one log
            # line): the request still gets a JSON 503, or its stream a final 503 event,
            # and the task ends normally, so uvicorn logs no traceback for it.
            logger.debug("%s %s: cancelled at shutdown", scope.get("method"), scope["path"])
            with contextlib.suppress(Exception):
                if not state["started"]:
                    await self._send(send, 503, SHUTTING_DOWN, {"connection": "close"})
                elif not state["ended"]:
                    tail = f"data: {json.dumps(error_body(503, SHUTTING_DOWN))}\n\n" if state["events"] else ""
                    await send({"type": "http.response.body", "body": tail.encode(), "more_body": False})
            return
        except Exception:
            if not state["over"]:
                raise
        if state["over"] and not state["started"]:
            await self._send(send, 413, f"request body is over the {limit}-byte limit (--max-body-bytes); "
                                        f"stopped reading at {state['read']} bytes", {"connection": "close"})

    @staticmethod
    async def _send(send, status: int, message: str, headers: dict | None = None) -> None:
        start, body = _json_response_messages(status, message, headers)
        await send(start)
        await send(body)


def _validation_message(errors) -> str:
    """One message for pydantic's errors, each naming its field (or the body)."""
    parts = []
    for e in errors:
        if e.get("type") == "json_invalid":  # the message says where: "... at line 1 column 15"
            why = (e.get("ctx") or {}).get("error") or e.get("msg", "")
            parts.append(f"invalid JSON body: {why}")
            continue
        where = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        if not where and e.get("type") == "model_type":
            parts.append(f"the body must be a JSON object (got {type(e.get('input')).__name__})")
            continue
        got = ""
        if "input" in e:
            got = repr(e["input"])
            got = f" (got {got[:200]}...)" if len(got) > 200 else f" (got {got})"
        parts.append(f"{where or 'body'}: {e.get('msg')}{got}")
    return "; ".join(parts) or "invalid request body"


def _units(params) -> int:
    """Sequences one prompt of these sampling params runs: n, or the beams."""
    return max(int(getattr(params, "n", 1) or 1), int(getattr(params, "num_beams", 1) or 1))


class _Admission:
    """``--max-queued-requests``: how many sequences may wait for admission.

    What waits is read from the scheduler (its waiting and swapped-out groups,
    each counted for its sequences: ``n`` or the beams), plus what this server
    has submitted that the engine thread has not taken in yet (it takes new
    requests between steps). A request is refused with 503 (``Retry-After``)
    when its own sequences (prompts x n) would take the count over the limit, and
    with 400 when they are more than the limit by themselves (it could never be
    admitted)."""

    def __init__(self, engine: AsyncLLM, limit: int | None) -> None:
        self.engine, self.limit = engine, limit
        self.pending: dict[str, int] = {}  # engine request id -> sequences, submitted, maybe not taken in yet

    def queued(self) -> int:
        sch = self.engine.engine.scheduler
        # list() of a deque copies it in one step under the GIL: a consistent snapshot
        # although the engine thread changes it.
        waiting = list(sch.waiting) + list(sch.swapped)
        n = sum(_units(g.sampling_params) for g in waiting)
        live = sch.groups
        for rid in [r for r in self.pending if r in live]:  # taken in: counted above while it waits
            del self.pending[rid]
        return n + sum(self.pending.values())

    def admit(self, ids: list[str], units_each: int, track: bool = True) -> None:
        if self.limit is None:
            return
        want = units_each * len(ids)
        if want > self.limit:
            raise _HTTPError(400, f"the request asks for {want} sequences ({len(ids)} prompt(s) x {units_each}), more "
                                  f"than this server queues at once (--max-queued-requests {self.limit}): split it")
        queued = self.queued()
        if queued + want > self.limit:
            raise _HTTPError(503, f"the queue is full ({queued} sequences waiting, this request adds {want}, the "
                                  f"limit is {self.limit})", {"Retry-After": "1"})
        if track:  # until the engine has taken it in, or the handler is done with it
            for rid in ids:
                self.pending[rid] = units_each

    def done(self, ids: list[str]) -> None:
        for rid in ids:
            self.pending.pop(rid, None)


async def _watch(tasks: list[asyncio.Future], request: Request | None, cut: asyncio.Event) -> str:
    """Wait until every task is done ("done"), the client disconnects
    ("disconnected") or the drain timeout passes ("cut")."""
    cut_wait = asyncio.ensure_future(cut.wait())
    try:
        while True:
            pending = [t for t in tasks if not t.done()]
            if not pending:
                return "done"
            if cut.is_set():
                return "cut"
            await asyncio.wait([*pending, cut_wait], timeout=0.25, return_when=asyncio.FIRST_COMPLETED)
            if cut.is_set():
                return "cut"
            if request is not None and await request.is_disconnected():
                return "disconnected"
    finally:
        cut_wait.cancel()


def build_app(
    engine: AsyncLLM,
    *,
    served_model_name: str,
    api_key: str | None = None,
    max_queued_requests: int | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_audio_seconds: float | None = DEFAULT_MAX_AUDIO_SECONDS,
) -> FastAPI:
    """The server's app. ``app.state.drain_cut`` is the event that, once set, cuts
    the running requests off (JSON 503; streams end with an error event):
    ``serve`` sets it when ``--drain-timeout`` has passed after SIGTERM."""
    from tandem.model_zoo.whisper import WhisperForConditionalGeneration

    if issubclass(engine.engine.model_cls, WhisperForConditionalGeneration):
        import importlib.util

        if importlib.util.find_spec("multipart") is None and importlib.util.find_spec("python_multipart") is None:
            raise RuntimeError("the audio endpoints parse multipart uploads with python-multipart, which is not "
                               "installed: pip install 'tandem-engine[serve]'")
    metrics = ServerMetrics(engine)
    admission = _Admission(engine, max_queued_requests)
    cut = DrainCut()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await engine.shutdown(timeout=30)

    # No /docs or /redoc: they load Swagger / ReDoc scripts from a CDN and would
    # document nothing the handlers take (they read raw requests); /openapi.json
    # stays, behind the API key when there is one.
    app = FastAPI(title="tandem", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.engine, app.state.metrics, app.state.drain_cut = engine, metrics, cut
    app.add_middleware(_Guard, api_key=api_key, max_body_bytes=max_body_bytes)

    def error(status: int, message: str, headers: dict | None = None) -> JSONResponse:
        return JSONResponse(error_body(status, message), status_code=status, headers=headers)

    @app.exception_handler(_HTTPError)
    async def _http_error(request: Request, exc: _HTTPError):
        return error(exc.status, exc.message, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        return error(400, _validation_message(exc.errors()))

    is_audio = issubclass(engine.engine.model_cls, WhisperForConditionalGeneration)

    @app.exception_handler(StarletteHTTPException)
    async def _starlette_http(request: Request, exc: StarletteHTTPException):
        """Routing's own errors (no such route: 404; a route without this method:
        405) in OpenAI's shape, saying what this server does serve."""
        method, path = request.method, request.url.path
        if exc.status_code == 404:
            served = "POST /v1/completions" + (", POST /v1/audio/transcriptions and /v1/audio/translations"
                                               if is_audio else "")
            if path.rstrip("/") in ("/v1/chat/completions", "/v1/responses"):
                message = (f"{path} is not served: this server serves an encoder/decoder model "
                           f"({engine.engine.architecture}), which takes no chat messages; use {served}")
            else:
                message = f"no route {method} {path}: this server serves {served}, GET /v1/models"
        elif exc.status_code == 405:
            allow = (exc.headers or {}).get("Allow") or (exc.headers or {}).get("allow", "")
            message = f"method {method} is not allowed on {path}" + (f" (use {allow})" if allow else "")
        else:
            message = str(exc.detail)
        return error(exc.status_code, message, dict(exc.headers or {}))

    @app.get("/health")
    async def health():
        h = engine.health()
        if h.status == "dead":
            return error(503, f"the engine is dead: {h.last_error}")
        if h.status == "degraded":  # serving, but its last steps failed
            return JSONResponse({"status": "degraded", "consecutive_step_failures": h.consecutive_step_failures,
                                 "failed_steps": h.failed_steps, "last_error": h.last_error})
        return PlainTextResponse("ok")

    @app.get("/version")
    async def version():
        import tandem

        return {"version": tandem.__version__}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served_model_name, "object": "model", "created": 0,
                                           "owned_by": "tandem", "root": engine.engine.config.model}]}

    @app.post("/v1/audio/transcriptions")
    async def transcriptions(request: Request):
        return await _audio(request, "transcribe")

    @app.post("/v1/audio/translations")
    async def translations(request: Request):
        return await _audio(request, "translate")

    async def _read_form(request: Request) -> tuple[Any, bytes]:
        """The form's fields and the file's bytes. The whole body is bounded by the
        guard's byte count; each other field by MAX_FORM_FIELD_BYTES; one file."""
        try:
            form = await request.form(max_files=1, max_fields=MAX_FORM_FIELDS, max_part_size=MAX_FORM_FIELD_BYTES)
        except _BodyTooLarge:
            raise
        except Exception as e:  # noqa: BLE001 - a malformed multipart body, or one over its limits
            raise _HTTPError(400, f"the body must be multipart/form-data with one 'file' part, at most "
                                  f"{MAX_FORM_FIELDS} other fields of at most {MAX_FORM_FIELD_BYTES} bytes each "
                                  f"({e})") from None
        try:
            upload = form.get("file")
            if upload is None or isinstance(upload, str):
                raise _HTTPError(400, "file: the audio file part is missing")
            data = await upload.read()
        finally:
            await form.close()
        return form, data

    async def _audio(request: Request, task: str):
        from tandem.audio import AudioTooLongError, load_audio
        from tandem.model_zoo.whisper import WhisperForConditionalGeneration

        if not issubclass(engine.engine.model_cls, WhisperForConditionalGeneration):
            raise _HTTPError(400, f"{engine.engine.architecture} takes no audio: the audio endpoints need Whisper")
        form, data = await _read_form(request)
        model_name = form.get("model")
        if model_name not in (None, "", served_model_name):
            raise _HTTPError(400, f"model={model_name!r}: this server serves {served_model_name!r}")
        fmt = form.get("response_format") or "json"
        if fmt not in ("json", "text", "verbose_json", "srt", "vtt"):
            raise _HTTPError(400, f"response_format={fmt!r}: must be json, text, verbose_json, srt or vtt")
        grains = form.getlist("timestamp_granularities[]") or form.getlist("timestamp_granularities")
        if any(g != "segment" for g in grains):
            raise _HTTPError(400, f"timestamp_granularities={grains!r}: only 'segment' is supported")
        stream = (form.get("stream") or "false").lower()
        if stream not in ("true", "false"):
            raise _HTTPError(400, f"stream={form.get('stream')!r}: must be true or false")
        stream = stream == "true"
        options: dict = {"task": task, "timestamps": fmt in ("verbose_json", "srt", "vtt") or bool(grains)}
        language = form.get("language")
        if language and task == "transcribe":
            options["language"] = language
        temperature = form.get("temperature")
        try:
            if temperature not in (None, ""):
                options["temperature"] = float(temperature)
            prompt = form.get("prompt")
            if prompt:
                tok = engine.get_tokenizer()
                if tok is None:
                    raise ValueError("prompt: the model has no tokenizer to encode it")
                options["prompt_ids"] = tok(" " + prompt.strip(), add_special_tokens=False)["input_ids"]
            # Decoding is CPU work (and bounded by max_audio_seconds): off the event loop.
            waveform = await asyncio.to_thread(load_audio, data, max_seconds=max_audio_seconds)
        except AudioTooLongError as e:
            raise _HTTPError(413, f"{e}: this server takes at most {max_audio_seconds:g} s of audio "
                                  "(--max-audio-seconds)") from None
        except (ValueError, TypeError) as e:
            raise _HTTPError(400, str(e)) from None
        del data
        if engine.errored:
            raise _HTTPError(503, "the engine is not running")
        rid = f"audio-{uuid.uuid4().hex}"
        duration = waveform.numel() / 16000
        meter = AudioMeter(engine, metrics)  # the engine, as transcribe_async sees it: each window counted
        gen = _transcribe(meter, waveform, rid, options)
        if stream:
            admission.admit([f"{rid}-w0"], 1, track=False)  # its first window is submitted once the stream runs
            return StreamingResponse(_audio_stream(gen, rid, cut, meter, duration), media_type="text/event-stream")
        first = [f"{rid}-w0"]
        admission.admit(first, 1)
        consume = asyncio.ensure_future(_last(gen))
        try:
            outcome = await _watch([consume], request, cut)
            if outcome != "done":
                consume.cancel()
                await asyncio.gather(consume, return_exceptions=True)
                meter.aborted()
                if outcome == "cut":
                    raise _HTTPError(503, cut.message)
                logger.info("request %s: client disconnected, aborted", rid)
                return JSONResponse(error_body(400, "client disconnected"), status_code=499)
            result = consume.result()
        except (ValueError, TypeError) as e:
            raise _HTTPError(400, str(e)) from None
        except EngineDeadError as e:
            raise _HTTPError(503, str(e)) from None
        finally:
            if not consume.done():
                consume.cancel()  # it closes the generator: the window's request aborts
            admission.done(first)
        if result.error is not None:
            raise _HTTPError(400, result.error)
        meter.finished(rid, duration)
        if fmt == "text":
            return PlainTextResponse(result.text)
        if fmt in ("srt", "vtt"):
            from tandem.entrypoints.cli import _subtitles

            return PlainTextResponse(_subtitles(result.segments or [], fmt))
        if fmt == "verbose_json":
            segments = [{"id": i, "start": s["start"], "end": s["end"], "text": s["text"], "tokens": s["token_ids"]}
                        for i, s in enumerate(result.segments or [])]
            return {"task": "translate" if task == "translate" else "transcribe", "language": result.language,
                    "duration": duration, "text": result.text, "segments": segments}
        return {"text": result.text}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.body()  # the guard stops it at max_body_bytes
        try:
            req = CompletionRequest.model_validate_json(body)
        except ValidationError as e:
            raise RequestValidationError(e.errors()) from None
        del body
        if req.model is not None and req.model != served_model_name:
            raise _HTTPError(400, f"model={req.model!r}: this server serves {served_model_name!r}")
        why = req.unsupported()
        if why:
            raise _HTTPError(400, why)
        if engine.errored:
            raise _HTTPError(503, "the engine is not running")
        try:
            params = req.sampling_params()
            prompts = req.prompts()
        except (ValueError, TypeError) as e:
            raise _HTTPError(400, str(e)) from None
        # Engine request ids are the server's own: a client's request_id is only
        # echoed (as the response's id) and logged, so no client can collide with,
        # learn or abort another's requests.
        engine_base = f"cmpl-{uuid.uuid4().hex}"
        ids = [engine_base if len(prompts) == 1 else f"{engine_base}-{i}" for i in range(len(prompts))]
        base = req.request_id or engine_base
        if req.request_id:
            logger.info("request %s: client request_id %r", engine_base, req.request_id)
        admission.admit(ids, _units(params))
        created = int(time.time())
        if req.stream:
            try:
                first = await _first_outputs(engine, prompts, params, ids, cut)  # errors: a status, not a stream
            finally:  # each has had a first output: the engine has them (no longer pending)
                admission.done(ids)
            return StreamingResponse(
                _stream(engine, metrics, req, params, first, ids, base, created, served_model_name, cut),
                media_type="text/event-stream",
            )
        try:
            return await _complete(engine, metrics, request, params, prompts, ids, base, created, served_model_name,
                                   cut)
        finally:
            admission.done(ids)

    return app


async def _last(gen):
    """The last item of an async generator, which it closes (in this task) when done."""
    last = None
    try:
        async for item in gen:
            last = item
    finally:
        await gen.aclose()
    return last


async def _first_outputs(engine, prompts, params, ids, cut):
    """Start the streams and wait for each first output, so a rejected request is
    a 400 rather than a broken stream."""
    gens = [engine.generate(p, params, rid) for p, rid in zip(prompts, ids)]

    async def firsts():
        return [await g.__anext__() for g in gens]

    waiting = asyncio.ensure_future(firsts())
    try:
        outcome = await _watch([waiting], None, cut)
        if outcome == "cut":
            raise _HTTPError(503, cut.message)
        outs = waiting.result()
    except (ValueError, TypeError) as e:
        await _close(gens)
        raise _HTTPError(400, str(e)) from None
    except EngineDeadError as e:
        await _close(gens)
        raise _HTTPError(503, str(e)) from None
    except BaseException:
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        await _close(gens)
        raise
    failed = [o.error for o in outs if o.error is not None]
    if failed:  # failed in its first step: an error status before the stream starts
        await _close(gens)
        raise _HTTPError(500, f"the request failed while being served: {failed[0]}")
    return list(zip(gens, outs))


async def _close(gens) -> None:
    for g in gens:
        try:
            await g.aclose()
        except Exception:  # noqa: BLE001 - closing a generator that already failed
            pass


def _choice(index: int, completion, text: str, logprobs_out) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs_out, "finish_reason": completion.finish_reason,
            "stop_reason": completion.stop_reason}


def _logprobs(completion, tokenizer, token_ids=None, entries=None) -> dict | None:
    entries = completion.logprobs if entries is None else entries
    if entries is None:
        return None
    token_ids = completion.token_ids if token_ids is None else token_ids

    def name(t: int) -> str:
        return tokenizer.convert_ids_to_tokens(t) if tokenizer is not None else str(t)

    # JSON has no -Infinity or NaN: a chosen token of probability 0 (every token
    # banned, say) gets null, and top entries of probability 0 are left out.
    return {
        "tokens": [name(t) for t in token_ids],
        "token_logprobs": [_finite(e.get(t)) for e, t in zip(entries, token_ids)],
        "top_logprobs": [{name(k): v for k, v in e.items() if _finite(v) is not None} for e in entries],
        "text_offset": [],
    }


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def _usage(outs) -> dict:
    prompt = sum(len(o.encoder_prompt_token_ids) + len(o.prompt_token_ids) for o in outs)
    completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _record(metrics: ServerMetrics, rid: str, out, start: float, first_token_at: float | None,
            n_out: int | None = None) -> None:
    """A finished request's metrics and log line. ``n_out``: the tokens it generated,
    when ``out`` (a stream's last delta) does not hold them all."""
    end = time.monotonic()
    if n_out is None:
        n_out = sum(len(c.token_ids) for c in out.outputs)
    n_in = len(out.encoder_prompt_token_ids) + len(out.prompt_token_ids)
    metrics.prompt_tokens.inc(n_in)
    for c in out.outputs:
        metrics.request_success.labels(finished_reason=c.finish_reason or "abort").inc()
    metrics.e2e.observe(end - start)
    if first_token_at is not None:
        metrics.ttft.observe(first_token_at - start)
    logger.info("request %s: %d tokens in, %d out, %.3f s", rid, n_in, n_out, end - start)


def _record_aborted(metrics: ServerMetrics, params, count: int) -> None:
    """Requests the server aborted (the client left, or the drain timeout cut them):
    their engine outputs are never read, so they are counted here, once per choice."""
    if count:
        metrics.request_success.labels(finished_reason="abort").inc(count * max(1, int(params.n or 1)))


async def _complete(engine, metrics, request, params, prompts, ids, base, created, model, cut):
    start = time.monotonic()

    async def run(prompt, rid):
        last = None
        async for out in engine.generate(prompt, params, rid):
            last = out
        return last

    tasks = [asyncio.create_task(run(p, rid)) for p, rid in zip(prompts, ids)]
    try:
        outcome = await _watch(tasks, request, cut)
        if outcome != "done":  # the client left, or the drain timeout passed: abort (blocks freed)
            unfinished = sum(not t.done() for t in tasks)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            _record_aborted(metrics, params, unfinished)
            if outcome == "cut":  # logged once for all (shutdown.py)
                logger.debug("request %s: cut off (%s)", base, cut.reason)
                raise _HTTPError(503, cut.message)
            logger.info("request %s: client disconnected, aborted", base)
            return JSONResponse(error_body(400, "client disconnected"), status_code=499)
        results = [t.result() for t in tasks]
    except (ValueError, TypeError) as e:
        raise _HTTPError(400, str(e)) from None
    except EngineDeadError as e:
        raise _HTTPError(503, str(e)) from None
    finally:  # whatever ended the wait (an error, the task's own cancellation): no request outlives it
        for t in tasks:
            if not t.done():
                t.cancel()
    failed = [out.error for out in results if out is not None and out.error is not None]
    if failed:  # it failed while being served (its step's fault, or its own)
        raise _HTTPError(500, f"the request failed while being served: {failed[0]}")
    tokenizer = engine.get_tokenizer()
    choices, outs = [], []
    for i, out in enumerate(results):
        outs.append(out)
        n_tokens = sum(len(c.token_ids) for c in out.outputs)
        metrics.generation_tokens.inc(n_tokens)
        _record(metrics, ids[i], out, start, time.monotonic() if n_tokens else None)
        for j, c in enumerate(out.outputs):
            choices.append(_choice(i * len(out.outputs) + j, c, c.text, _logprobs(c, tokenizer)))
    return {"id": base, "object": "text_completion", "created": created, "model": model, "choices": choices,
            "usage": _usage(outs)}


_CUT = object()  # queued by the drain-timeout watcher


async def _stream(engine, metrics, req, params, first, ids, base, created, model, cut):
    """Server-sent events: one chunk per new text per choice, then (with
    ``stream_options.include_usage``) a usage chunk, then ``[DONE]``."""
    tokenizer = engine.get_tokenizer()
    start = time.monotonic()
    queue: asyncio.Queue = asyncio.Queue()
    n_per = None

    async def pump(i, gen, out):
        try:
            await queue.put((i, out))
            while not out.finished:
                out = await gen.__anext__()
                await queue.put((i, out))
        except BaseException as e:  # noqa: BLE001 - delivered to the response loop
            await queue.put((i, e))
        finally:
            await gen.aclose()

    async def on_cut():
        await cut.wait()
        await queue.put((None, _CUT))

    tasks = [asyncio.create_task(pump(i, g, o)) for i, (g, o) in enumerate(first)]
    watcher = asyncio.create_task(on_cut())
    finals: dict[int, Any] = {}
    generated: dict[int, int] = {}
    last_token_at: dict[int, float] = {}
    first_token_at: dict[int, float] = {}
    failed = False
    try:
        while len(finals) < len(tasks):
            i, out = await queue.get()
            if out is _CUT:  # logged once for all (shutdown.py)
                logger.debug("request %s: stream cut off (%s)", base, cut.reason)
                yield f"data: {json.dumps(error_body(503, cut.message))}\n\n"
                return
            if isinstance(out, BaseException):
                failed = True
                message = str(out) if isinstance(out, (ValueError, TypeError, EngineDeadError)) else "internal error"
                yield f"data: {json.dumps(error_body(500, message))}\n\n"
                return
            if out.error is not None:  # failed while being served: the stream ends with the error
                failed = True
                yield f"data: {json.dumps(error_body(500, f'the request failed while being served: {out.error}'))}\n\n"
                return
            n_per = len(out.outputs)
            now = time.monotonic()
            new_tokens = sum(len(c.token_ids) for c in out.outputs)
            generated[i] = generated.get(i, 0) + new_tokens
            if new_tokens:
                metrics.generation_tokens.inc(new_tokens)
                if i not in first_token_at:
                    first_token_at[i] = now
                elif i in last_token_at:
                    metrics.itl.observe((now - last_token_at[i]) / new_tokens)
                last_token_at[i] = now
            for j, c in enumerate(out.outputs):
                if c.text or c.token_ids or c.finish_reason:
                    chunk = {"id": base, "object": "text_completion", "created": created, "model": model,
                             "choices": [_choice(i * n_per + j, c, c.text, _logprobs(c, tokenizer))]}
                    yield f"data: {json.dumps(chunk)}\n\n"
            if out.finished:
                finals[i] = out
                _record(metrics, ids[i], out, start, first_token_at.get(i), generated.get(i, 0))
        if req.stream_options is not None and req.stream_options.include_usage:
            usage = _final_usage(finals, generated)
            chunk = {"id": base, "object": "text_completion", "created": created, "model": model, "choices": [],
                     "usage": usage}
            yield f"data: {json.dumps(chunk)}\n\n"
        yield "data: [DONE]\n\n"
    finally:  # a disconnect cancels this generator: stop the pumps (their requests abort)
        watcher.cancel()
        for t in tasks:
            t.cancel()
        if not failed:
            _record_aborted(metrics, params, len(tasks) - len(finals))
        await asyncio.gather(watcher, *tasks, return_exceptions=True)


def _final_usage(finals, generated) -> dict:
    """Streamed (delta) outputs carry only each step's tokens: the usage counts each
    request's prompt once and the tokens counted as the stream went."""
    prompt = sum(len(o.encoder_prompt_token_ids) + len(o.prompt_token_ids) for o in finals.values())
    completion = sum(generated.values())
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def serve(args) -> int:
    """Run the server until SIGTERM / Ctrl-C; in-flight requests drain (bounded)."""
    import uvicorn

    engine_args = dict(dtype=args.dtype, device=args.device, attention_backend=args.attention_backend,
                       trust_remote_code=args.trust_remote_code, generation_config=args.generation_config,
                       cpu_gemm=args.cpu_gemm, cpu_malloc=args.cpu_malloc, quantization=args.quantization)
    for key in ("max_num_seqs", "max_num_batched_tokens", "block_size", "kv_cache_memory", "num_kv_blocks", "seed",
                "max_consecutive_step_failures"):
        if getattr(args, key, None) is not None:
            engine_args[key] = getattr(args, key)
    engine = AsyncLLM(model=args.model, **engine_args)
    max_audio_seconds = getattr(args, "max_audio_seconds", DEFAULT_MAX_AUDIO_SECONDS)
    app = build_app(
        engine, served_model_name=args.served_model_name or args.model, api_key=args.api_key,
        max_queued_requests=args.max_queued_requests, max_body_bytes=args.max_body_bytes,
        max_audio_seconds=max_audio_seconds if max_audio_seconds and max_audio_seconds > 0 else None,
    )
    # uvicorn's own stop (it cancels what still runs) is the backstop: the server's
    # cut comes at the drain timeout, its cancelling CUT_GRACE_SECONDS later.
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="info",
                            timeout_graceful_shutdown=args.drain_timeout + CUT_GRACE_SECONDS + 2)
    make_server(config, cut=app.state.drain_cut, drain_timeout=args.drain_timeout).run()
    return 0


async def _transcribe(engine, waveform, rid, options):
    from tandem.entrypoints.transcribe import transcribe_async

    async for item in transcribe_async(engine, waveform, rid, **options):
        yield item


async def _audio_stream(gen, rid, cut, meter: AudioMeter, duration: float):
    """Server-sent events: a ``transcript.text.delta`` per finished window's text,
    then ``transcript.text.done`` with the whole text, then ``[DONE]``."""
    from tandem.entrypoints.transcribe import Transcription

    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump():
        try:
            async for item in gen:
                await queue.put(item)
            await queue.put(end)
        except BaseException as e:  # noqa: BLE001 - delivered to the response loop
            await queue.put(e)
        finally:
            await gen.aclose()

    async def on_cut():
        await cut.wait()
        await queue.put(_CUT)

    tasks = [asyncio.create_task(pump()), asyncio.create_task(on_cut())]
    failed = False
    try:
        while True:
            item = await queue.get()
            if item is end:
                meter.finished(rid, duration)
                break
            if item is _CUT:  # logged once for all (shutdown.py)
                logger.debug("request %s: stream cut off (%s)", rid, cut.reason)
                yield f"data: {json.dumps(error_body(503, cut.message))}\n\n"
                return
            if isinstance(item, BaseException):
                failed = True
                known = isinstance(item, (ValueError, TypeError, EngineDeadError))
                yield f"data: {json.dumps(error_body(400 if known else 500, str(item) if known else 'internal error'))}\n\n"
                return
            if isinstance(item, Transcription):
                yield f"data: {json.dumps({'type': 'transcript.text.done', 'text': item.text})}\n\n"
            else:
                delta = {"type": "transcript.text.delta", "delta": " ".join(seg["text"] for seg in item),
                         "segments": item}
                yield f"data: {json.dumps(delta)}\n\n"
        yield "data: [DONE]\n\n"
    finally:  # a disconnect or the cut: stop the pump (its window's request aborts)
        for t in tasks:
            t.cancel()
        if not failed:
            meter.aborted()  # counted once: a no-op after finished()
        await asyncio.gather(*tasks, return_exceptions=True)
