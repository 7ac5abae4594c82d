"""``tandem serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over ``AsyncLLM``.

Endpoints: ``POST /v1/completions`` (plain or streamed as server-sent events),
``GET /v1/models``, ``/health``, ``/version``, ``/metrics`` (Prometheus). Errors
have OpenAI's shape: 400 for a bad request (naming the value), 401 for a wrong
or missing API key, 413 for a body over the limit, 503 with ``Retry-After``
when the queue is full or the engine is dead. A client that disconnects
aborts its request. SIGTERM stops taking requests, lets the running ones
finish (bounded by ``--drain-timeout``) and exits 0.
"""

from __future__ import annotations

import asyncio
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

from tandem.entrypoints.async_llm import AsyncLLM, EngineDeadError
from tandem.entrypoints.openai.metrics import ServerMetrics
from tandem.entrypoints.openai.protocol import CompletionRequest, error_body

logger = logging.getLogger("tandem.serve")


class _HTTPError(Exception):
    def __init__(self, status: int, message: str, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers or {}


def build_app(
    engine: AsyncLLM,
    *,
    served_model_name: str,
    api_key: str | None = None,
    max_queued_requests: int | None = None,
    max_body_bytes: int = 4 << 20,
) -> FastAPI:
    from tandem.model_zoo.whisper import WhisperForConditionalGeneration

    if issubclass(engine.engine.model_cls, WhisperForConditionalGeneration):
        import importlib.util

        if importlib.util.find_spec("multipart") is None and importlib.util.find_spec("python_multipart") is None:
            raise RuntimeError("the audio endpoints parse multipart uploads with python-multipart, which is not "
                               "installed: pip install 'tandem-engine[serve]'")
    metrics = ServerMetrics(engine)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await engine.shutdown(timeout=30)

    app = FastAPI(title="tandem", lifespan=lifespan)
    app.state.engine, app.state.metrics = engine, metrics

    def error(status: int, message: str, headers: dict | None = None) -> JSONResponse:
        return JSONResponse(error_body(status, message), status_code=status, headers=headers)

    @app.exception_handler(_HTTPError)
    async def _http_error(request: Request, exc: _HTTPError):
        return error(exc.status, exc.message, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        parts = []
        for e in exc.errors():
            where = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
            parts.append(f"{where}: {e.get('msg')}" + (f" (got {e['input']!r})" if "input" in e else ""))
        return error(400, "; ".join(parts) or "invalid request body")

    @app.middleware("http")
    async def guard(request: Request, call_next):
        if api_key is not None and request.url.path.startswith("/v1/"):
            if request.headers.get("authorization") != f"Bearer {api_key}":
                return error(401, "invalid or missing API key (send 'Authorization: Bearer <key>')")
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > max_body_bytes:
            return error(413, f"request body of {length} bytes is over the {max_body_bytes}-byte limit")
        return await call_next(request)

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

    async def _audio(request: Request, task: str):
        from tandem.model_zoo.whisper import WhisperForConditionalGeneration

        if not issubclass(engine.engine.model_cls, WhisperForConditionalGeneration):
            raise _HTTPError(400, f"{engine.engine.architecture} takes no audio: the audio endpoints need Whisper")
        try:
            form = await request.form(max_part_size=max_body_bytes)
        except Exception as e:  # noqa: BLE001 - a malformed multipart body
            raise _HTTPError(400, f"the body must be multipart/form-data with a 'file' part ({e})") from None
        upload = form.get("file")
        if upload is None or isinstance(upload, str):
            raise _HTTPError(400, "file: the audio file part is missing")
        model_name = form.get("model")
        if model_name not in (None, "", served_model_name):
            raise _HTTPError(400, f"model={model_name!r}: this server serves {served_model_name!r}")
        fmt = form.get("response_format") or "json"
        if fmt not in ("json", "text", "verbose_json", "srt", "vtt"):
            raise _HTTPError(400, f"response_format={fmt!r}: must be json, text, verbose_json, srt or vtt")
        grains = form.getlist("timestamp_granularities[]") or form.getlist("timestamp_granularities")
        if any(g != "segment" for g in grains):
            raise _HTTPError(400, f"timestamp_granularities={grains!r}: only 'segment' is supported")
        stream = (form.get("stream") or "false").lower() == "true"
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
            from tandem.audio import load_audio

            waveform = load_audio(await upload.read())
        except (ValueError, TypeError) as e:
            raise _HTTPError(400, str(e)) from None
        rid = f"audio-{uuid.uuid4().hex}"
        gen = _transcribe(engine, waveform, rid, options)
        if stream:
            return StreamingResponse(_audio_stream(gen, rid), media_type="text/event-stream")
        try:
            result = None
            async for item in gen:
                result = item
        except (ValueError, TypeError) as e:
            raise _HTTPError(400, str(e)) from None
        except EngineDeadError as e:
            raise _HTTPError(503, str(e)) from None
        if result.error is not None:
            raise _HTTPError(400, result.error)
        duration = waveform.numel() / 16000
        logger.info("request %s: %.2f s of audio, %d tokens out", rid, duration, len(result.token_ids))
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
        body = await request.body()
        if len(body) > max_body_bytes:
            raise _HTTPError(413, f"request body of {len(body)} bytes is over the {max_body_bytes}-byte limit")
        try:
            req = CompletionRequest.model_validate_json(body)
        except ValidationError as e:
            raise RequestValidationError(e.errors()) from None
        if req.model is not None and req.model != served_model_name:
            raise _HTTPError(400, f"model={req.model!r}: this server serves {served_model_name!r}")
        why = req.unsupported()
        if why:
            raise _HTTPError(400, why)
        if engine.errored:
            raise _HTTPError(503, "the engine is not running")
        if max_queued_requests is not None:
            sch = engine.engine.scheduler
            if len(sch.waiting) >= max_queued_requests:
                raise _HTTPError(503, f"the queue is full ({len(sch.waiting)} requests waiting)", {"Retry-After": "1"})
        try:
            params = req.sampling_params()
            prompts = req.prompts()
        except (ValueError, TypeError) as e:
            raise _HTTPError(400, str(e)) from None
        base = req.request_id or f"cmpl-{uuid.uuid4().hex}"
        ids = [base if len(prompts) == 1 else f"{base}-{i}" for i in range(len(prompts))]
        created = int(time.time())
        if req.stream:
            first = await _first_outputs(engine, prompts, params, ids)  # errors become a 400 before streaming
            return StreamingResponse(
                _stream(engine, metrics, req, first, ids, base, created, served_model_name),
                media_type="text/event-stream",
            )
        return await _complete(engine, metrics, request, req, prompts, params, ids, base, created, served_model_name)

    return app


async def _first_outputs(engine, prompts, params, ids):
    """Start the streams and wait for each first output, so a rejected request is
    a 400 rather than a broken stream."""
    gens = [engine.generate(p, params, rid) for p, rid in zip(prompts, ids)]
    firsts = []
    try:
        for g in gens:
            firsts.append(await g.__anext__())
    except (ValueError, TypeError) as e:
        for g in gens:
            await g.aclose()
        raise _HTTPError(400, str(e)) from None
    except EngineDeadError as e:
        raise _HTTPError(503, str(e)) from None
    failed = [o.error for o in firsts if o.error is not None]
    if failed:  # failed in its first step: an error status before the stream starts
        for g in gens:
            await g.aclose()
        raise _HTTPError(500, f"the request failed while being served: {failed[0]}")
    return list(zip(gens, firsts))


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


def _record(metrics: ServerMetrics, rid: str, out, start: float, first_token_at: float | None) -> None:
    end = time.monotonic()
    n_out = sum(len(c.token_ids) for c in out.outputs)
    n_in = len(out.encoder_prompt_token_ids) + len(out.prompt_token_ids)
    metrics.prompt_tokens.inc(n_in)
    for c in out.outputs:
        metrics.request_success.labels(finished_reason=c.finish_reason or "abort").inc()
    metrics.e2e.observe(end - start)
    if first_token_at is not None:
        metrics.ttft.observe(first_token_at - start)
    logger.info("request %s: %d tokens in, %d out, %.3f s", rid, n_in, n_out, end - start)


async def _complete(engine, metrics, request, req, prompts, params, ids, base, created, model):
    start = time.monotonic()

    async def run(prompt, rid):
        last = None
        async for out in engine.generate(prompt, params, rid):
            last = out
        return last, None

    tasks = [asyncio.create_task(run(p, rid)) for p, rid in zip(prompts, ids)]
    try:
        while True:
            done, _ = await asyncio.wait(tasks, timeout=0.25)
            if len(done) == len(tasks):
                break
            if await request.is_disconnected():  # the client left: abort (blocks freed)
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                logger.info("request %s: client disconnected, aborted", base)
                return JSONResponse(error_body(400, "client disconnected"), status_code=499)
        results = [t.result() for t in tasks]
    except (ValueError, TypeError) as e:
        for t in tasks:
            t.cancel()
        raise _HTTPError(400, str(e)) from None
    except EngineDeadError as e:
        raise _HTTPError(503, str(e)) from None
    failed = [out.error for out, _ in results if out is not None and out.error is not None]
    if failed:  # it failed while being served (its step's fault, or its own)
        raise _HTTPError(500, f"the request failed while being served: {failed[0]}")
    tokenizer = engine.get_tokenizer()
    choices, outs = [], []
    for i, (out, _) in enumerate(results):
        outs.append(out)
        n_tokens = sum(len(c.token_ids) for c in out.outputs)
        metrics.generation_tokens.inc(n_tokens)
        _record(metrics, ids[i], out, start, time.monotonic() if n_tokens else None)
        for j, c in enumerate(out.outputs):
            choices.append(_choice(i * len(out.outputs) + j, c, c.text, _logprobs(c, tokenizer)))
    return {"id": base, "object": "text_completion", "created": created, "model": model, "choices": choices,
            "usage": _usage(outs)}


async def _stream(engine, metrics, req, first, ids, base, created, model):
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

    tasks = [asyncio.create_task(pump(i, g, o)) for i, (g, o) in enumerate(first)]
    finals: dict[int, Any] = {}
    generated: dict[int, int] = {}
    last_token_at: dict[int, float] = {}
    first_token_at: dict[int, float] = {}
    try:
        while len(finals) < len(tasks):
            i, out = await queue.get()
            if isinstance(out, BaseException):
                message = str(out) if isinstance(out, (ValueError, TypeError, EngineDeadError)) else "internal error"
                yield f"data: {json.dumps(error_body(500, message))}\n\n"
                return
            if out.error is not None:  # failed while being served: the stream ends with the error
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
                _record(metrics, ids[i], out, start, first_token_at.get(i))
        if req.stream_options is not None and req.stream_options.include_usage:
            usage = _final_usage(finals, generated)
            chunk = {"id": base, "object": "text_completion", "created": created, "model": model, "choices": [],
                     "usage": usage}
            yield f"data: {json.dumps(chunk)}\n\n"
        yield "data: [DONE]\n\n"
    finally:  # a disconnect cancels this generator: stop the pumps (their requests abort)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


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
    app = build_app(
        engine, served_model_name=args.served_model_name or args.model, api_key=args.api_key,
        max_queued_requests=args.max_queued_requests, max_body_bytes=args.max_body_bytes,
    )
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="info",
                            timeout_graceful_shutdown=args.drain_timeout)
    _Server(config).run()
    return 0


def _server_cls():
    import contextlib
    import signal

    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, but SIGTERM / SIGINT end it with status 0 after the drain
        (uvicorn re-raises the signal, which would exit with -15): the first signal
        stops taking requests and lets the running ones finish, a second one forces."""

        @contextlib.contextmanager
        def capture_signals(self):
            def stop(signum, frame):
                if self.should_exit:
                    self.force_exit = True
                self.should_exit = True

            old = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for s, handler in old.items():
                    signal.signal(s, handler)

    return Server


def _Server(config):
    return _server_cls()(config)


async def _transcribe(engine, waveform, rid, options):
    from tandem.entrypoints.transcribe import transcribe_async

    async for item in transcribe_async(engine, waveform, rid, **options):
        yield item


async def _audio_stream(gen, rid):
    """Server-sent events: a ``transcript.text.delta`` per finished window's text,
    then ``transcript.text.done`` with the whole text, then ``[DONE]``."""
    from tandem.entrypoints.transcribe import Transcription

    try:
        async for item in gen:
            if isinstance(item, Transcription):
                yield f"data: {json.dumps({'type': 'transcript.text.done', 'text': item.text})}\n\n"
            else:
                delta = {"type": "transcript.text.delta", "delta": " ".join(seg["text"] for seg in item),
                         "segments": item}
                yield f"data: {json.dumps(delta)}\n\n"
        yield "data: [DONE]\n\n"
    except (ValueError, TypeError, EngineDeadError) as e:
        yield f"data: {json.dumps(error_body(400, str(e)))}\n\n"
    finally:
        await gen.aclose()
