"""``tandem serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over ``AsyncLLM``.

Endpoints: ``POST /v1/completions`` (plain or streamed as server-sent events;
structured output from ``response_format`` or vLLM's fields, ``structured.py``),
``POST /v1/audio/transcriptions`` and ``/translations`` (models that support
transcription, ``tandem.core.transcription``: Whisper, or a plugin's; audio in a
completion prompt is inline bytes, never a client's path: ``media.py``),
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
never buffered whole; audio (uploads, inline prompt audio, allowed local files)
is refused from its header or part-way through decoding once over
``--max-audio-seconds``; ``--max-queued-requests`` counts the sequences a
request would queue (prompts times ``n``), not HTTP requests.

Here: the app, its routes and the audio endpoints; ``guard.py``: the ASGI guard
(API key, body limit); ``completions.py``: serving completions, plain and
streamed; ``audio_stream.py``: a streamed transcription's events; ``media.py``: the
audio a completion prompt carries; ``shutdown.py``:
the drain, the cut and the signals; ``metrics.py``.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager, contextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from tandem.core.transcription import AudioTooLongError, supports_transcription
from tandem.entrypoints.async_llm import AsyncLLM, EngineDeadError
from tandem.core.sampling_params import SamplingParams
from tandem.entrypoints.openai.audio_fields import check_other_fields, refuse_unknown, sampling_options, stream_usage
from tandem.entrypoints.openai.audio_stream import StreamEvents, audio_stream
from tandem.entrypoints.openai.completions import complete, first_outputs, stream_completion
from tandem.entrypoints.openai.guard import BodyTooLarge, Guard
from tandem.entrypoints.openai.lora_modules import ServedModels, check_lora_flags
from tandem.entrypoints.openai.media import PromptAudio, find_audio
from tandem.entrypoints.openai.metrics import AudioMeter, ServerMetrics
from tandem.entrypoints.openai.protocol import (
    CompletionRequest, HTTPError, error_body, validation_message,
)
from tandem.entrypoints.openai.shutdown import CUT_GRACE_SECONDS, DrainCut, make_server, watch
from tandem.entrypoints.openai.structured import check_compiles, read_structured
from tandem.entrypoints.transcribe import prompt_ids_of

logger = logging.getLogger("tandem.serve")

DEFAULT_MAX_BODY_BYTES = 4 << 20
# 30 minutes: more than any ordinary speech upload that fits the default 4 MiB body
# (4 MiB of 16 kHz 16-bit WAV is 131 s; of 20 kbit/s Opus, 28 minutes), while a
# file that expands past it (a WAV declaring 1 Hz, an hour of silence in a small
# FLAC) is refused after at most 30 minutes were decoded: 115 MB of 16 kHz float32
# and 60 of Whisper's 30-second windows.
DEFAULT_MAX_AUDIO_SECONDS = 1800.0
# The non-file fields of an audio upload (model, language, prompt, sampling fields, ...):
# few and short. audio_fields.py names about 25, each given once.
MAX_FORM_FIELDS = 32
MAX_FORM_FIELD_BYTES = 64 << 10


def _units(params) -> int:
    """Sequences one prompt of these sampling params runs: n, or the beams."""
    return max(int(getattr(params, "n", 1) or 1), int(getattr(params, "num_beams", 1) or 1))


class _Admission:
    """``--max-queued-requests``: how many sequences may wait for admission.

    What waits is read from the scheduler (its waiting and swapped-out groups,
    each counted for its sequences: ``n`` or the beams), plus what this server
    has submitted that the engine thread has not taken in yet (it takes new
    requests between steps, each client request's prompts in turn with the
    others': ``AsyncLLM``'s fair queue; off by default, as that queue keeps a
    request of many prompts from starving later ones). A request is refused with 503 (``Retry-After``)
    when its own sequences (prompts x n) would take the count over the limit, and
    with 400 when they are more than the limit by themselves (it could never be
    admitted)."""

    def __init__(self, engine: AsyncLLM, limit: int | None) -> None:
        self.engine, self.limit = engine, limit
        self.pending: dict[str, int] = {}  # engine request id -> sequences, submitted, maybe not taken in yet

    def queued(self) -> int:
        # What the engine thread published after its last change, never its live queues.
        stats = self.engine.engine.core.stats
        live, n = stats.live_request_ids, sum(_units(p) for p in stats.queued_params)
        for rid in [r for r in self.pending if r in live]:  # taken in: counted above while it waits
            del self.pending[rid]
        return n + sum(self.pending.values())

    def admit(self, ids: list[str], units_each: int, track: bool = True) -> None:
        if self.limit is None:
            return
        want = units_each * len(ids)
        if want > self.limit:
            raise HTTPError(400, f"the request asks for {want} sequences ({len(ids)} prompt(s) x {units_each}), more "
                                  f"than this server queues at once (--max-queued-requests {self.limit}): split it")
        queued = self.queued()
        if queued + want > self.limit:
            raise HTTPError(503, f"the queue is full ({queued} sequences waiting, this request adds {want}, the "
                                  f"limit is {self.limit})", {"Retry-After": "1"})
        if track:  # until the engine has taken it in, or the handler is done with it
            for rid in ids:
                self.pending[rid] = units_each

    def done(self, ids: list[str]) -> None:
        for rid in ids:
            self.pending.pop(rid, None)


def build_app(
    engine: AsyncLLM,
    *,
    served_model_name: str,
    api_key: str | None = None,
    max_queued_requests: int | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_audio_seconds: float | None = DEFAULT_MAX_AUDIO_SECONDS,
    allowed_local_media_path: str | None = None,
    lora_modules: list[tuple[str, str]] = (),
    lora_allowed_dir: str | None = None,
) -> FastAPI:
    """The server's app. ``app.state.drain_cut`` is the event that, once set, cuts
    the running requests off (JSON 503; streams end with an error event):
    ``serve`` sets it when ``--drain-timeout`` has passed after SIGTERM.
    ``allowed_local_media_path``: a directory whose files completion prompts may
    name as audio (``media.py``); without it, a path in a prompt is refused.
    ``lora_modules``: ``(name, path)`` of each LoRA adapter served by name (the engine
    built with ``enable_lora``); ``lora_allowed_dir``: where ``/v1/load_lora_adapter``
    may load adapters from (``lora_modules.py``; without it, runtime loading is off)."""
    model_cls = engine.engine.model_cls
    is_audio = supports_transcription(model_cls)
    prompt_audio = PromptAudio(model_cls, engine.engine.hf_config, engine.engine.architecture,
                               max_seconds=max_audio_seconds, allowed_dir=allowed_local_media_path)
    if is_audio:
        import importlib.util

        if importlib.util.find_spec("multipart") is None and importlib.util.find_spec("python_multipart") is None:
            raise RuntimeError("the audio endpoints parse multipart uploads with python-multipart, which is not "
                               "installed: pip install 'tandem-engine[serve]'")
    config = engine.engine.config
    served = ServedModels(served_model_name, config.model, enable_lora=config.enable_lora,
                          max_lora_rank=config.max_lora_rank, lora_modules=list(lora_modules),
                          allowed_dir=lora_allowed_dir)
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
    app.add_middleware(Guard, api_key=api_key, max_body_bytes=max_body_bytes)

    def error(status: int, message: str, headers: dict | None = None, param: str | None = None) -> JSONResponse:
        return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)

    @app.exception_handler(HTTPError)
    async def _http_error(request: Request, exc: HTTPError):
        return error(exc.status, exc.message, exc.headers, exc.param)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        return error(400, validation_message(exc.errors(), exc.body if isinstance(exc.body, bytes) else None))

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
        return {"object": "list", "data": served.cards()}

    if served.enable_lora:
        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(request: Request):
            # Reading adapter_config.json is file work: off the event loop.
            return PlainTextResponse(await asyncio.to_thread(served.load, await _json_body(request)))

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(request: Request):
            return PlainTextResponse(served.unload(await _json_body(request)))

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
        except BodyTooLarge:
            raise
        except Exception as e:  # noqa: BLE001 - a malformed multipart body, or one over its limits
            raise HTTPError(400, f"the body must be multipart/form-data with one 'file' part, at most "
                                  f"{MAX_FORM_FIELDS} other fields of at most {MAX_FORM_FIELD_BYTES} bytes each "
                                  f"({e})") from None
        try:
            upload = form.get("file")
            if upload is None or isinstance(upload, str):
                raise HTTPError(400, "file: the audio file part is missing")
            data = await upload.read()
        finally:
            await form.close()
        return form, data

    async def _audio(request: Request, task: str):
        if not is_audio:
            raise HTTPError(400, f"{engine.engine.architecture} takes no audio: the audio endpoints need a model "
                                  "that supports transcription, such as Whisper")
        form, data = await _read_form(request)
        refuse_unknown(form)
        model_name = form.get("model") or None
        lora = served.resolve(model_name)
        fmt = form.get("response_format") or "json"
        if fmt not in ("json", "text", "verbose_json", "srt", "vtt"):
            raise HTTPError(400, f"response_format={fmt!r}: must be json, text, verbose_json, srt or vtt")
        grains = form.getlist("timestamp_granularities[]") or form.getlist("timestamp_granularities")
        if any(g not in ("segment", "word") for g in grains):
            raise HTTPError(400, f"timestamp_granularities={grains!r}: each must be 'segment' or 'word'")
        stream = (form.get("stream") or "false").lower()
        if stream not in ("true", "false"):
            raise HTTPError(400, f"stream={form.get('stream')!r}: must be true or false")
        stream = stream == "true"
        words = "word" in grains
        if words and (fmt != "verbose_json" or stream):  # OpenAI's rule; a stream sends text and segments only
            raise HTTPError(400, f"timestamp_granularities={grains!r}: 'word' needs response_format=verbose_json "
                                  f"without stream, got response_format={fmt!r}, stream={str(stream).lower()}")
        if words and engine.get_tokenizer() is None:
            raise HTTPError(400, f"timestamp_granularities={grains!r}: this model has no tokenizer to find words with")
        options: dict = {"task": task, "timestamps": fmt in ("verbose_json", "srt", "vtt") or bool(grains),
                         "word_timestamps": words}
        language = form.get("language")
        if language and task == "transcribe":
            options["language"] = language
        temperature = form.get("temperature")
        try:
            if temperature not in (None, ""):
                options["temperature"] = float(temperature)
            prompt = form.get("prompt")
            if prompt:
                options["prompt_ids"] = prompt_ids_of(engine.get_tokenizer(), prompt)
            options.update(_vad_fields(form))
            check_other_fields(form, task)
            include_usage, continuous_usage = stream_usage(form, stream)
            sampling = sampling_options(form)
            SamplingParams(**sampling)  # a value out of range: a 400 here, before any audio is decoded
            options.update(sampling)
            # Decoding is CPU work (and bounded by max_audio_seconds): off the event loop.
            waveform = await asyncio.to_thread(model_cls.load_transcription_audio, data,
                                               max_seconds=max_audio_seconds)
        except AudioTooLongError as e:
            raise HTTPError(413, f"{e}: this server takes at most {max_audio_seconds:g} s of audio "
                                  "(--max-audio-seconds)") from None
        except (ValueError, TypeError) as e:
            raise HTTPError(400, str(e)) from None
        del data
        if engine.errored:
            raise HTTPError(503, "the engine is not running")
        rid = f"audio-{uuid.uuid4().hex}"
        duration = waveform.numel() / model_cls.transcription_sample_rate
        meter = AudioMeter(engine, metrics)  # the engine, as transcribe_async sees it: each window counted
        gen = _transcribe(meter, waveform, rid, {**options, "lora_request": lora})
        if stream:
            admission.admit([f"{rid}-w0"], 1, track=False)  # its first window is submitted once the stream runs
            events = StreamEvents(rid, task, model_name or served_model_name, meter, include_usage=include_usage,
                                  continuous_usage=continuous_usage)
            return StreamingResponse(audio_stream(gen, rid, cut, meter, duration, events),
                                     media_type="text/event-stream")
        first = [f"{rid}-w0"]
        admission.admit(first, 1)
        consume = asyncio.ensure_future(_last(gen))
        try:
            outcome = await watch([consume], request, cut)
            if outcome != "done":
                consume.cancel()
                await asyncio.gather(consume, return_exceptions=True)
                meter.aborted()
                if outcome == "cut":
                    raise HTTPError(503, cut.message)
                logger.info("request %s: client disconnected, aborted", rid)
                return JSONResponse(error_body(400, "client disconnected"), status_code=499)
            result = consume.result()
        except (ValueError, TypeError) as e:
            raise HTTPError(400, str(e)) from None
        except EngineDeadError as e:
            raise HTTPError(503, str(e)) from None
        finally:
            if not consume.done():
                consume.cancel()  # it closes the generator: the window's request aborts
            admission.done(first)
        if result.error is not None:
            raise HTTPError(400, result.error)
        meter.finished(rid, duration)
        if fmt == "text":
            return PlainTextResponse(result.text)
        if fmt in ("srt", "vtt"):
            from tandem.entrypoints.transcribe import subtitles

            return PlainTextResponse(subtitles(result.segments or [], fmt))
        if fmt == "verbose_json":
            body = {"task": "translate" if task == "translate" else "transcribe", "language": result.language,
                    "duration": duration, "text": result.text}
            if not words or "segment" in grains:  # OpenAI: segments unless only words were asked for
                body["segments"] = [{"id": i, "start": s["start"], "end": s["end"], "text": s["text"],
                                     "tokens": s["token_ids"]} for i, s in enumerate(result.segments or [])]
            if words:
                body["words"] = result.words
            return body
        return {"text": result.text}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.body()  # the guard stops it at max_body_bytes
        try:
            req = CompletionRequest.model_validate_json(body)
        except ValidationError as e:
            raise RequestValidationError(e.errors(), body=body) from None
        del body
        lora = served.resolve(req.model)
        model_name = req.model or served_model_name
        why = req.unsupported()
        if why:
            raise HTTPError(400, why)
        if engine.errored:
            raise HTTPError(503, "the engine is not running")
        structured = read_structured(req)
        try:
            params = req.sampling_params(structured.params if structured is not None else None)
            prompts = req.prompts()
        except (ValueError, TypeError) as e:
            raise HTTPError(400, str(e)) from None
        if find_audio(prompts):  # bytes or an allowed file, decoded here and bounded: never a client's path
            await asyncio.to_thread(prompt_audio.load, prompts)
        if structured is not None:  # a spec that does not compile is a 400 here, never a queued failure
            await check_compiles(engine, structured, cut, request)
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
                # Errors: a status, not a stream.
                first = await first_outputs(engine, prompts, params, ids, cut, lora, request, metrics)
            finally:  # each has had a first output: the engine has them (no longer pending)
                admission.done(ids)
            return StreamingResponse(
                stream_completion(engine, metrics, req, params, first, ids, base, created, model_name, cut),
                media_type="text/event-stream",
            )
        try:
            return await complete(engine, metrics, request, params, prompts, ids, base, created, model_name,
                                   cut, lora)
        finally:
            admission.done(ids)

    return app


async def _json_body(request: Request) -> Any:
    body = await request.body()  # the guard stops it at max_body_bytes
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HTTPError(400, f"invalid JSON body: {e}") from None


async def _last(gen):
    """The last item of an async generator, which it closes (in this task) when done."""
    last = None
    try:
        async for item in gen:
            last = item
    finally:
        await gen.aclose()
    return last


def serve(args) -> int:
    """Run the server until SIGTERM / Ctrl-C; in-flight requests drain (bounded)."""
    import uvicorn

    from tandem.core.engine_args import from_cli_args
    from tandem.entrypoints.openai.connections import uvicorn_options

    engine_args = from_cli_args(args)
    lora_modules = getattr(args, "lora_modules", None) or []
    lora_allowed_dir = getattr(args, "lora_allowed_dir", None)
    # The LoRA flags checked before the engine is built (a mistake costs no model load).
    check_lora_flags(args.served_model_name or args.model, args.model, engine_args, lora_modules, lora_allowed_dir)
    started = time.perf_counter()
    logger.info("tandem serve: starting the engine for %s (then listening on http://%s:%d)", args.model,
                args.host, args.port)
    engine = AsyncLLM(model=args.model, **engine_args)
    max_audio_seconds = getattr(args, "max_audio_seconds", DEFAULT_MAX_AUDIO_SECONDS)
    app = build_app(
        engine, served_model_name=args.served_model_name or args.model, api_key=args.api_key,
        max_queued_requests=args.max_queued_requests, max_body_bytes=args.max_body_bytes,
        max_audio_seconds=max_audio_seconds if max_audio_seconds and max_audio_seconds > 0 else None,
        allowed_local_media_path=getattr(args, "allowed_local_media_path", None),
        lora_modules=lora_modules, lora_allowed_dir=lora_allowed_dir,
    )
    logger.info("tandem serve: engine started in %.1f s; serving %r on http://%s:%d", time.perf_counter() - started,
                args.served_model_name or args.model, args.host, args.port)
    # uvicorn's own stop (it cancels what still runs) is the backstop: the server's
    # cut comes at the drain timeout, its cancelling CUT_GRACE_SECONDS later.
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="info",
                            timeout_graceful_shutdown=args.drain_timeout + CUT_GRACE_SECONDS + 2,
                            **uvicorn_options(args))  # connections.py: header, body and keep-alive timeouts
    with frozen_heap():
        make_server(config, cut=app.state.drain_cut, drain_timeout=args.drain_timeout).run()
    return 0


@contextmanager
def frozen_heap():
    """The objects alive now (the model's modules, the tokenizer, the imported code:
    some 350,000 for a tiny BART) kept out of the garbage collector's way while the
    block runs, as vLLM's server does: they live as long as the process, yet every
    oldest-generation collection walked them all (130 ms, holding the GIL the engine
    thread steps with), and the allocations of streaming (outputs, events, futures)
    set one off often enough to take half the event loop's CPU per streamed token
    (docs/performance.md, "Serving"). They are collectable again after it (so
    extensions that count leaks at exit find none)."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _vad_fields(form) -> dict:
    """The form's ``vad_filter`` (true/false) and ``vad_parameters`` (a JSON object of
    faster-whisper's VadOptions), checked here: a bad one is a 400."""
    vad = (form.get("vad_filter") or "false").lower()
    if vad not in ("true", "false"):
        raise ValueError(f"vad_filter={form.get('vad_filter')!r}: must be true or false")
    raw = form.get("vad_parameters")
    if vad == "false":
        if raw:
            raise ValueError("vad_parameters without vad_filter=true: give vad_filter=true to use them")
        return {}
    from tandem.entrypoints.vad import VadOptions, check_vad_support

    try:
        check_vad_support()
    except ImportError as e:
        raise ValueError(f"vad_filter=true is not available on this server ({e})") from None
    params = None
    if raw:
        try:
            params = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ValueError(f"vad_parameters={raw!r}: must be a JSON object ({e})") from None
        VadOptions.from_dict(params)
    return {"vad_filter": True, "vad_parameters": params}


async def _transcribe(engine, waveform, rid, options):
    from tandem.entrypoints.transcribe import transcribe_async

    async for item in transcribe_async(engine, waveform, rid, **options):
        yield item
