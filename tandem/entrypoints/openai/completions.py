"""Serving ``POST /v1/completions``: plain (every prompt's final output) or
streamed (server-sent events of each step's new text), with their metrics and
log lines."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any

from fastapi.responses import JSONResponse

from tandem.entrypoints.async_llm import EngineDeadError
from tandem.entrypoints.openai.metrics import ServerMetrics
from tandem.entrypoints.openai.protocol import HTTPError, error_body
from tandem.entrypoints.openai.shutdown import CUT, watch
from tandem.entrypoints.openai.sse import DONE, CompletionChunks, event

logger = logging.getLogger("tandem.serve")

# A completion left with no token to sample (tandem.core.sequence.SequenceStatus.FINISHED_NO_TOKEN).
NO_TOKEN = "no_allowed_token"


async def first_outputs(engine, prompts, params, ids, cut, lora_request=None, request=None, metrics=None):
    """Start the streams and wait for each first output, so a rejected request is
    a 400 rather than a broken stream. ``lora_request``: the adapter the request's
    ``model`` named (None: the base model). A client that leaves meanwhile (``request``,
    the Starlette request) has its requests aborted at once, counted in ``metrics``:
    an ``HTTPError`` 499 nobody reads."""
    # One queue group per HTTP request: its prompts take turns with other clients' requests.
    gens = [engine.generate(p, params, rid, queue_group=ids[0], lora_request=lora_request)
            for p, rid in zip(prompts, ids)]

    async def firsts():
        return [await g.__anext__() for g in gens]

    waiting = asyncio.ensure_future(firsts())
    try:
        outcome = await watch([waiting], request, cut)
        if outcome == "cut":
            raise HTTPError(503, cut.message)
        if outcome == "disconnected":  # queued, or before its first token: aborted below
            if metrics is not None:
                _record_aborted(metrics, params, len(gens))
            logger.info("request %s: client disconnected before its stream started, aborted", ids[0])
            raise HTTPError(499, "client disconnected")
        outs = waiting.result()
    except (ValueError, TypeError) as e:
        await _close(gens)
        raise HTTPError(400, str(e)) from None
    except EngineDeadError as e:
        await _close(gens)
        raise HTTPError(503, str(e)) from None
    except BaseException:  # a disconnect, a cut, this task's own cancellation: no request outlives it
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        await _close(gens)
        raise
    unsatisfiable = next((why for o in outs if (why := cannot_be_satisfied(o, params, with_text=True))), None)
    if unsatisfiable is not None:
        await _close(gens)
        raise HTTPError(400, unsatisfiable)
    failed = [o.error for o in outs if o.error is not None]
    if failed:  # failed in its first step: an error status before the stream starts
        await _close(gens)
        raise HTTPError(500, f"the request failed while being served: {failed[0]}")
    return list(zip(gens, outs))


def cannot_be_satisfied(out, params, with_text: bool) -> str | None:
    """Why ``out``'s request cannot be served as asked, or None: one of its completions
    was left with no token to sample (``no_allowed_token``: its structured output is one
    the vocabulary cannot write, or its bans leave nothing). That is no OpenAI finish
    reason, and the text would not follow the request (a schema, ``min_tokens``), so
    the server answers it as a 400 (a stream: a last error event), never as a 200.
    ``with_text``: add the text generated so far (a stream has sent it already)."""
    c = next((c for c in out.outputs if c.finish_reason == NO_TOKEN), None)
    if c is None:
        return None
    if out.error is not None and params.structured_outputs is None:
        return None  # a plain request that failed later for another cause (a 500)
    # A structured output's error (the core's) names the field and where the grammar ran out.
    why = out.error
    if why is None:
        n = len(c.token_ids)
        where = "at the start of the output" if n == 0 else f"after {n} generated token{'s' if n > 1 else ''}"
        if len(out.outputs) > 1:
            where += f" (completion {c.index})"
        why = (f"{where}, every token is banned for this request (allowed_token_ids, bad_words_ids, "
               "suppress_tokens, logit_bias, min_tokens): nothing more can be generated")
    if with_text and c.text:
        why += f"; the text generated so far: {_cut(c.text)!r}"
    return why


def _cut(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


async def _close(gens) -> None:
    for g in gens:
        try:
            await g.aclose()
        except Exception:  # noqa: BLE001 - closing a generator that already failed
            pass


def _choice(index: int, completion, text: str, logprobs_out) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs_out, "finish_reason": completion.finish_reason,
            "stop_reason": completion.stop_reason}


class TokenText:
    """One choice's generated tokens as text, for its logprobs: each token's piece (the
    text it adds to the completion, made as the engine makes the text: its own
    incremental detokenizer, with the request's ``skip_special_tokens`` and the
    model's non-text tokens, so the pieces joined are the completion's text) and
    ``text_offset``, where each piece starts in the completion's text (OpenAI's and
    vLLM's meaning, without ``echo``): cumulative across a stream's chunks, so a
    token's offset indexes the whole text however it was streamed. A token that adds
    no text (a skipped special token, a timestamp, the first bytes of a character
    that a later token completes) has an empty piece at the current offset."""

    def __init__(self, tokenizer, params, non_text_token_ids=()) -> None:
        from tandem.core.output_processor import IncrementalDetokenizer

        self.detok = (IncrementalDetokenizer(tokenizer, params.skip_special_tokens, non_text_token_ids)
                      if tokenizer is not None else None)
        self.at = 0  # characters of text the pieces so far make

    def pieces(self, token_ids) -> tuple[list[str], list[int]]:
        tokens, offsets = [], []
        for t in token_ids:
            piece = self.detok.add([t]) if self.detok is not None else ""
            tokens.append(piece)
            offsets.append(self.at)
            self.at += len(piece)
        return tokens, offsets


def _logprobs(completion, tokenizer, text: TokenText, token_ids=None, entries=None) -> dict | None:
    entries = completion.logprobs if entries is None else entries
    if entries is None:
        return None
    token_ids = completion.token_ids if token_ids is None else token_ids
    tokens, offsets = text.pieces(token_ids)
    if tokenizer is None:  # no text: tokens are named by their ids
        tokens = [str(t) for t in token_ids]

    def name(t: int) -> str:
        return tokenizer.decode([t]) if tokenizer is not None else str(t)

    def top(entry: dict, chosen: int, piece: str) -> dict:
        # Keyed by each token's text, as OpenAI's; the chosen token by its piece, so
        # top_logprobs[i][tokens[i]] finds it. Two tokens of one text keep the likelier.
        out: dict[str, float] = {}
        for k, v in entry.items():
            if _finite(v) is None:
                continue
            key = piece if k == chosen else name(k)
            if key not in out or v > out[key]:
                out[key] = v
        return out

    # JSON has no -Infinity or NaN: a chosen token of probability 0 (every token
    # banned, say) gets null, and top entries of probability 0 are left out.
    return {
        "tokens": tokens,
        "token_logprobs": [_finite(e.get(t)) for e, t in zip(entries, token_ids)],
        "top_logprobs": [top(e, t, p) for e, t, p in zip(entries, token_ids, tokens)],
        "text_offset": offsets,
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


async def complete(engine, metrics, request, params, prompts, ids, base, created, model, cut, lora_request=None):
    start = time.monotonic()

    async def run(prompt, rid):
        last = None
        async for out in engine.generate(prompt, params, rid, queue_group=ids[0], lora_request=lora_request):
            last = out
        return last

    tasks = [asyncio.create_task(run(p, rid)) for p, rid in zip(prompts, ids)]
    try:
        outcome = await watch(tasks, request, cut)
        if outcome != "done":  # the client left, or the drain timeout passed: abort (blocks freed)
            unfinished = sum(not t.done() for t in tasks)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            _record_aborted(metrics, params, unfinished)
            if outcome == "cut":  # logged once for all (shutdown.py)
                logger.debug("request %s: cut off (%s)", base, cut.reason)
                raise HTTPError(503, cut.message)
            logger.info("request %s: client disconnected, aborted", base)
            return JSONResponse(error_body(400, "client disconnected"), status_code=499)
        results = [t.result() for t in tasks]
    except (ValueError, TypeError) as e:
        raise HTTPError(400, str(e)) from None
    except EngineDeadError as e:
        raise HTTPError(503, str(e)) from None
    finally:  # whatever ended the wait (an error, the task's own cancellation): no request outlives it
        for t in tasks:
            if not t.done():
                t.cancel()
    unsatisfiable = next(
        (why for out in results if out is not None and (why := cannot_be_satisfied(out, params, with_text=True))), None
    )
    if unsatisfiable is not None:
        raise HTTPError(400, unsatisfiable)
    failed = [out.error for out in results if out is not None and out.error is not None]
    if failed:  # it failed while being served (its step's fault, or its own)
        raise HTTPError(500, f"the request failed while being served: {failed[0]}")
    tokenizer = engine.get_tokenizer()
    non_text = engine.engine.non_text_token_ids
    choices, outs = [], []
    for i, out in enumerate(results):
        outs.append(out)
        n_tokens = sum(len(c.token_ids) for c in out.outputs)
        metrics.generation_tokens.inc(n_tokens)
        _record(metrics, ids[i], out, start, time.monotonic() if n_tokens else None)
        for j, c in enumerate(out.outputs):
            text = TokenText(tokenizer, params, non_text)
            choices.append(_choice(i * len(out.outputs) + j, c, c.text, _logprobs(c, tokenizer, text)))
    return {"id": base, "object": "text_completion", "created": created, "model": model, "choices": choices,
            "usage": _usage(outs)}


async def stream_completion(engine, metrics, req, params, first, ids, base, created, model, cut):
    """Server-sent events: one chunk per new text per choice, then (with
    ``stream_options.include_usage``) a usage chunk, then ``[DONE]``. What the
    prompts' outputs make while a send is under way goes out in one send."""
    tokenizer = engine.get_tokenizer()
    non_text = engine.engine.non_text_token_ids
    chunks = CompletionChunks(base, created, model)
    texts: dict[tuple[int, int], TokenText] = {}  # (prompt, choice) -> its tokens' text so far: offsets go on
    want_logprobs = params.logprobs is not None
    start = time.monotonic()
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i, gen, out):
        try:
            queue.put_nowait((i, out))
            while not out.finished:
                out = await gen.__anext__()
                queue.put_nowait((i, out))
        except BaseException as e:  # noqa: BLE001 - delivered to the response loop
            queue.put_nowait((i, e))
        finally:
            await gen.aclose()

    async def on_cut():
        await cut.wait()
        queue.put_nowait((None, CUT))

    tasks = [asyncio.create_task(pump(i, g, o)) for i, (g, o) in enumerate(first)]
    watcher = asyncio.create_task(on_cut())
    finals: dict[int, Any] = {}
    generated: dict[int, int] = {}
    last_token_at: dict[int, float] = {}
    first_token_at: dict[int, float] = {}
    ended: set[tuple[int, int]] = set()  # (prompt, choice) whose finishing chunk was sent
    failed = False
    try:
        while len(finals) < len(tasks):
            parts: list[bytes] = []
            i, out = await queue.get()
            while True:
                if out is CUT:  # logged once for all (shutdown.py)
                    logger.debug("request %s: stream cut off (%s)", base, cut.reason)
                    yield b"".join((*parts, event(error_body(503, cut.message))))
                    return
                ending = _ending(out, params)
                if ending is not None:  # the client has the text so far; the stream ends with the error
                    failed = True
                    yield b"".join((*parts, event(ending)))
                    return
                n_per = len(out.outputs)
                new_tokens = 0
                for c in out.outputs:
                    new_tokens += len(c.token_ids)
                generated[i] = generated.get(i, 0) + new_tokens
                if new_tokens:
                    now = time.monotonic()
                    metrics.generation_tokens.inc(new_tokens)
                    if i not in first_token_at:
                        first_token_at[i] = now
                    elif i in last_token_at:
                        metrics.itl.observe((now - last_token_at[i]) / new_tokens)
                    last_token_at[i] = now
                for j, c in enumerate(out.outputs):
                    if c.finish_reason and (i, j) in ended:
                        continue  # its last chunk went out: a choice ends once (its request's later
                        # outputs carry it again while the other choices run)
                    if c.text or c.token_ids or c.finish_reason:
                        if c.finish_reason:
                            ended.add((i, j))
                        logprobs = None
                        if want_logprobs:
                            if (i, j) not in texts:
                                texts[(i, j)] = TokenText(tokenizer, params, non_text)
                            logprobs = _logprobs(c, tokenizer, texts[(i, j)])
                        parts.append(chunks.choice(i * n_per + j, c.text, logprobs, c.finish_reason, c.stop_reason))
                if out.finished:
                    finals[i] = out
                    _record(metrics, ids[i], out, start, first_token_at.get(i), generated.get(i, 0))
                if queue.empty():
                    break
                i, out = queue.get_nowait()
            if parts:
                yield b"".join(parts)
        if req.stream_options is not None and req.stream_options.include_usage:
            yield chunks.usage(_final_usage(finals, generated))
        yield DONE
    finally:  # a disconnect cancels this generator: stop the pumps (their requests abort)
        watcher.cancel()
        for t in tasks:
            t.cancel()
        if not failed:
            _record_aborted(metrics, params, len(tasks) - len(finals))
        await asyncio.gather(watcher, *tasks, return_exceptions=True)


def _ending(out, params) -> dict | None:
    """The error body a stream ends with instead of this output, or None: the output is
    an exception (the request failed to run), a completion left with no token to
    sample, or an error while it was served."""
    if isinstance(out, BaseException):
        message = str(out) if isinstance(out, (ValueError, TypeError, EngineDeadError)) else "internal error"
        return error_body(500, message)
    if out.error is None:  # the usual output: only a completion with no token to sample ends the stream
        for c in out.outputs:
            if c.finish_reason == NO_TOKEN:
                break
        else:
            return None
    unsatisfiable = cannot_be_satisfied(out, params, with_text=False)
    if unsatisfiable is not None:
        return error_body(400, unsatisfiable)
    if out.error is not None:
        return error_body(500, f"the request failed while being served: {out.error}")
    return None


def _final_usage(finals, generated) -> dict:
    """Streamed (delta) outputs carry only each step's tokens: the usage counts each
    request's prompt once and the tokens counted as the stream went."""
    prompt = sum(len(o.encoder_prompt_token_ids) + len(o.prompt_token_ids) for o in finals.values())
    completion = sum(generated.values())
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
