"""The server-sent events of a streamed transcription or translation.

One stream serves two kinds of client, with no switch: every event carries OpenAI's
shape and vLLM's at once, each under its own keys.

- OpenAI's (what ``openai``'s ``audio.transcriptions.create(stream=True)`` parses,
  by ``type``): ``{"type": "transcript.text.delta", "delta", "segments"}`` per finished
  window, then ``{"type": "transcript.text.done", "text"}``;
- vLLM's (its ``TranscriptionStreamResponse``, what vLLM's transcription client reads
  from ``chunk.choices``): ``id``, ``object`` (``transcription.chunk`` or
  ``translation.chunk``), ``created``, ``model`` and ``choices``: in a delta event
  ``[{"delta": {"content": <the delta>}, "finish_reason", "stop_reason": null}]``, in
  the done event the same with ``"content": ""`` (never ``[]``: vLLM's translation client
  reads ``chunk["choices"][0]`` of every event up to ``[DONE]``); ``usage``
  (``{"prompt_tokens", "completion_tokens", "total_tokens"}``) on the done event with
  ``stream_include_usage=true``, and on every delta event too with
  ``stream_continuous_usage_stats=true`` beside it.

Why both at once: the two clients send the same request (vLLM's example calls the
``openai`` client with ``stream=True``; its extra fields are sampling fields any client
may send), so the request cannot say which shape is wanted, while each client ignores
the other's keys (the ``openai`` client keeps unknown keys as attributes, which is how
vLLM's example reads ``chunk.choices``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

from tandem.core.transcription import Transcription
from tandem.entrypoints.async_llm import EngineDeadError
from tandem.entrypoints.openai.metrics import AudioMeter
from tandem.entrypoints.openai.protocol import error_body
from tandem.entrypoints.openai.shutdown import CUT

logger = logging.getLogger("tandem.serve")


class StreamEvents:
    """One stream's events, in both shapes (the module's docstring). Usage is read from
    the request's ``AudioMeter``: prompt tokens are each decoded window's encoder
    positions and decoder prompt, completion tokens every token the windows generated
    (fallback re-decodes included), as the server's metrics count them."""

    def __init__(self, rid: str, task: str, model: str, meter: AudioMeter, *, include_usage: bool = False,
                 continuous_usage: bool = False) -> None:
        self.head = {"id": rid, "object": "translation.chunk" if task == "translate" else "transcription.chunk",
                     "created": int(time.time()), "model": model}
        self.meter, self.include_usage, self.continuous_usage = meter, include_usage, continuous_usage

    def delta(self, text: str, segments: list) -> str:
        event = {"type": "transcript.text.delta", "delta": text, "segments": segments, **self.head,
                 "choices": [self._choice(text)]}
        if self.continuous_usage:
            event["usage"] = self._usage()
        return _sse(event)

    def done(self, text: str) -> str:
        # No new text, but a choice all the same: a client that reads choices[0] of every event reads this one.
        event = {"type": "transcript.text.done", "text": text, **self.head, "choices": [self._choice("")]}
        if self.include_usage:
            event["usage"] = self._usage()
        return _sse(event)

    def _choice(self, content: str) -> dict:
        # Every event is whole windows (never part of one): each ends as its last window did.
        return {"delta": {"content": content}, "finish_reason": self.meter.finish_reason or "stop", "stop_reason": None}

    def _usage(self) -> dict:
        m = self.meter
        return {"prompt_tokens": m.prompt_tokens, "completion_tokens": m.generated,
                "total_tokens": m.prompt_tokens + m.generated}


def _sse(event: dict) -> str:
    return f"data: {json.dumps(event)}\n\n"


async def audio_stream(gen, rid: str, cut, meter: AudioMeter, duration: float, events: StreamEvents):
    """Server-sent events: a delta per finished window that adds text (or segments), a
    single-window clip's one window included, then the done event with the whole text,
    then ``[DONE]``. The deltas joined are the done event's text: each is the new part
    of the transcript so far (``_new_text``).

    Why per window and not per token: a window's tokens are not final until the window
    is: with timestamps the input seeks back to the window's last complete segment
    (its tail is decoded again with the next window), and a fallback temperature
    decodes the whole window again; a stream cannot take back text it sent."""
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
        await queue.put(CUT)

    tasks = [asyncio.create_task(pump()), asyncio.create_task(on_cut())]
    failed = False
    sent = ""  # the text the deltas so far make
    try:
        while True:
            item = await queue.get()
            if item is end:
                meter.finished(rid, duration)
                break
            if item is CUT:  # logged once for all (shutdown.py)
                logger.debug("request %s: stream cut off (%s)", rid, cut.reason)
                yield _sse(error_body(503, cut.message))
                return
            if isinstance(item, BaseException):
                failed = True
                known = isinstance(item, (ValueError, TypeError, EngineDeadError))
                yield _sse(error_body(400 if known else 500, str(item) if known else "internal error"))
                return
            if isinstance(item, Transcription):
                rest = _new_text(sent, item.text, final=True)
                if rest or not sent:  # the text no window reported (one at least, even empty)
                    yield events.delta(rest, [])
                yield events.done(item.text)
            else:
                text = item.text
                if text is None:  # the model does not say its text so far: its segments' texts, joined
                    joined = " ".join(seg["text"] for seg in item.segments if seg["text"])
                    text = sent + (" " if sent and joined else "") + joined
                new = _new_text(sent, text)
                if new or item.segments:
                    sent += new
                    yield events.delta(new, item.segments)
        yield "data: [DONE]\n\n"
    finally:  # a disconnect or the cut: stop the pump (its window's request aborts)
        for t in tasks:
            t.cancel()
        if not failed:
            meter.aborted()  # counted once: a no-op after finished()
        await asyncio.gather(*tasks, return_exceptions=True)


def _new_text(sent: str, text: str, final: bool = False) -> str:
    """What ``text`` (the transcript so far) adds to the ``sent`` deltas: its new part, less
    (until the end) a trailing replacement character, the first bytes of a character a
    later window may complete. Nothing when ``text`` does not go on from what was sent
    (sent text cannot be taken back; the done event has the whole text)."""
    if not text.startswith(sent):
        return ""
    new = text[len(sent):]
    return new if final else new.rstrip("\ufffd")
