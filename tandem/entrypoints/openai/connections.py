"""How long ``tandem serve`` keeps a connection that sends too little: the header and body
timeouts uvicorn lacks, and its keep-alive timeout.

uvicorn's h11 protocol bounds a request head's size (16 KiB) but not its time: a client that
connects and sends nothing, or sends its headers a byte at a time (slowloris), holds a
connection for ever; so does one that stops part-way through a body. Its only timer is
``timeout_keep_alive``, between one response and the next request. The protocol here adds:

- the **header timeout**: a request head must be complete within this many seconds of the
  connection opening (or of the first byte of the next request on a kept-alive connection),
  however slowly its bytes come: a deadline, never pushed back by more bytes. Past it the
  client gets ``408`` (nothing sent yet: the connection is just closed);
- the **body timeout**: while a body is being read, the connection is closed when no byte has
  come for this many seconds (the handler sees a disconnect). Time the server itself is not
  reading (the handler is busy) never counts.

A request whose head and body are in is never timed: generating its answer takes what it takes.
"""

from __future__ import annotations

import json
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from tandem.entrypoints.openai.protocol import error_body

logger = logging.getLogger("tandem.serve")

DEFAULT_KEEP_ALIVE_TIMEOUT = 5.0  # uvicorn's
# A request head is at most 16 KiB, and any client sends it in one write: 10 s is long for a
# slow link, and less than the 20 s a probe held a byte-at-a-time connection open for.
DEFAULT_HEADER_TIMEOUT = 10.0
# nginx's client_body_timeout (60 s) halved: an upload that stalls this long is gone.
DEFAULT_BODY_TIMEOUT = 30.0

_REQUEST_TIMEOUT = json.dumps(error_body(408, "the request head was not complete in time (--header-timeout)")).encode()
_408 = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
        b"content-length: " + str(len(_REQUEST_TIMEOUT)).encode() + b"\r\n\r\n" + _REQUEST_TIMEOUT)


class TimedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the header and body timeouts (class attributes: uvicorn
    builds the protocol itself, so :func:`protocol_class` makes a subclass holding them)."""

    header_timeout: float = DEFAULT_HEADER_TIMEOUT
    body_timeout: float = DEFAULT_BODY_TIMEOUT

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self._timer = None
        self._head_bytes = 0
        super().connection_made(transport)
        self._arm(self.header_timeout, self._head_expired)

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE:
            if self._timer is None:  # a kept-alive connection's next request: its own deadline
                self._head_bytes = 0
                self._arm(self.header_timeout, self._head_expired)
            self._head_bytes += len(data)
        super().data_received(data)
        self._track()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may parse a pipelined request that was waiting
        if not self.transport.is_closing():
            self._track()

    def _track(self) -> None:
        state = self.conn.their_state
        if state is h11.SEND_BODY:  # the head is in: from now on, time between body bytes
            self._arm(self.body_timeout, self._body_expired)
        elif state is not h11.IDLE:  # the whole request is in (or the connection failed)
            self._disarm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self, seconds: float, callback) -> None:
        self._disarm()
        self._timer = self.loop.call_later(seconds, callback)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _head_expired(self) -> None:
        self._timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        logger.debug("%s: no complete request head in %g s (--header-timeout): closed", self._peer(),
                     self.header_timeout)
        if self._head_bytes:
            self.transport.write(_408)
        self.transport.close()

    def _body_expired(self) -> None:
        self._timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.SEND_BODY:
            return
        if self.flow.read_paused:  # the server is not reading (the handler is busy): not the client's fault
            self._arm(self.body_timeout, self._body_expired)
            return
        logger.debug("%s: no body bytes in %g s (--body-timeout): closed", self._peer(), self.body_timeout)
        self.transport.close()

    def _peer(self) -> str:
        return "%s:%d" % self.client if self.client else "a client"


def protocol_class(header_timeout: float = DEFAULT_HEADER_TIMEOUT,
                   body_timeout: float = DEFAULT_BODY_TIMEOUT) -> type[TimedH11Protocol]:
    """The protocol uvicorn's ``Config(http=...)`` takes, with these timeouts in seconds."""
    for name, value in (("header_timeout", header_timeout), ("body_timeout", body_timeout)):
        if not isinstance(value, (int, float)) or not 0 < value < float("inf"):
            raise ValueError(f"{name}={value!r}: must be a number of seconds > 0")
    return type("TimedH11Protocol", (TimedH11Protocol,),
                {"header_timeout": float(header_timeout), "body_timeout": float(body_timeout)})


def uvicorn_options(args) -> dict:
    """uvicorn ``Config`` keywords for the connection timeouts among ``tandem serve``'s ``args``."""
    return {
        "http": protocol_class(getattr(args, "header_timeout", DEFAULT_HEADER_TIMEOUT),
                               getattr(args, "body_timeout", DEFAULT_BODY_TIMEOUT)),
        "timeout_keep_alive": getattr(args, "keep_alive_timeout", DEFAULT_KEEP_ALIVE_TIMEOUT),
    }
