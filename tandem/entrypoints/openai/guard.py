"""The server's pure-ASGI guard, in front of every route: the API key, the body
limit, a JSON 503 for a request cancelled at shutdown, and quiet for a client that
left mid-body."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

from starlette.requests import ClientDisconnect

from tandem.entrypoints.openai.protocol import error_body
from tandem.entrypoints.openai.shutdown import SHUTTING_DOWN

logger = logging.getLogger("tandem.serve")

# Paths that need no API key (a load balancer's probes and Prometheus scrapes).
OPEN_PATHS = frozenset({"/health", "/version", "/metrics"})


class BodyTooLarge(Exception):
    """Raised into the app from ``receive`` once the body passes the limit."""


def _json_response_messages(status: int, message: str, headers: dict | None = None) -> tuple[dict, dict]:
    body = json.dumps(error_body(status, message)).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), str(v).encode()) for k, v in (headers or {}).items()]
    return ({"type": "http.response.start", "status": status, "headers": raw},
            {"type": "http.response.body", "body": body, "more_body": False})


class Guard:
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
                    raise BodyTooLarge()
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
        except ClientDisconnect:
            # The client left (or --body-timeout closed it) while its body was read: nobody
            # to answer, and nothing went wrong on this side worth a traceback.
            logger.debug("%s %s: the client left before its body was read", scope.get("method"), scope["path"])
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
