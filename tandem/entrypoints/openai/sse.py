"""Server-sent events as bytes.

A streamed completion sends one chunk per choice per output, every one the same
object but for the choice: ``CompletionChunks`` encodes the fixed part (id, object,
created, model) once per stream and joins each event from it and the choice's
values, each encoded by orjson, so an event costs no dict and no ``json.dumps`` of
the whole chunk. The bytes are those ``json.dumps`` writes for the chunk, key for key
and space for space, but for non-ASCII text (UTF-8 rather than ``\\u`` escapes) and
``logprobs`` (compact): the same JSON.
"""

from __future__ import annotations

import json
from typing import Any

import orjson

DONE = b"data: [DONE]\n\n"


def dumps(obj: Any) -> bytes:
    """``obj`` as JSON bytes: orjson's, or (what orjson refuses: a lone surrogate, an
    integer past 64 bits) the standard library's."""
    try:
        return orjson.dumps(obj)
    except (TypeError, orjson.JSONEncodeError):
        return json.dumps(obj).encode()


def event(obj: Any) -> bytes:
    """One ``data:`` event of ``obj`` (an error, once a stream): ``json.dumps``'s."""
    return f"data: {json.dumps(obj)}\n\n".encode()


class CompletionChunks:
    """The events of one streamed completion (``object`` ``text_completion``)."""

    def __init__(self, request_id: str, created: int, model: str) -> None:
        self._head = b"".join((b'data: {"id": ', dumps(request_id), b', "object": "text_completion", "created": ',
                               dumps(created), b', "model": ', dumps(model), b', "choices": '))

    def choice(self, index: int, text: str, logprobs: dict | None, finish_reason: str | None,
               stop_reason: int | str | None) -> bytes:
        """A chunk of one choice (the fields of ``_choice`` in completions.py)."""
        return b"".join((
            self._head, b'[{"index": ', b"%d" % index, b', "text": ', dumps(text), b', "logprobs": ',
            b"null" if logprobs is None else dumps(logprobs),
            b', "finish_reason": ', b"null" if finish_reason is None else dumps(finish_reason),
            b', "stop_reason": ', b"null" if stop_reason is None else dumps(stop_reason), b"}]}\n\n",
        ))

    def usage(self, usage: dict) -> bytes:
        """The last chunk of a stream with ``stream_options.include_usage``: no choices."""
        return b"".join((self._head, b'[], "usage": ', json.dumps(usage).encode(), b"}\n\n"))
