"""How ``tandem serve`` stops: the cut event the handlers watch, and uvicorn's
server with tandem's signal handling.

The first SIGTERM / SIGINT stops taking connections and lets the running
requests finish for ``--drain-timeout`` seconds; then they are cut: each
handler answers a JSON 503 (a stream ends with a 503 error event). A second
signal, at any time after the first, cuts them at once. Either way the cut is
logged on one line, and a request that has not answered ``CUT_GRACE_SECONDS``
after the cut is cancelled (``Guard`` (guard.py) answers it a JSON 503). Then the engine
is shut down and the process exits with status 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

logger = logging.getLogger("tandem.serve")

# After the cut, how long the cut requests have to answer before they are cancelled.
CUT_GRACE_SECONDS = 5.0
SHUTTING_DOWN = "the server is shutting down: the request was cut off"
DRAIN_TIMEOUT = "the drain timeout passed"
FORCED = "a second signal forced the shutdown"


class DrainCut(asyncio.Event):
    """Set once the running requests are to be cut off; ``reason`` says why."""

    def __init__(self) -> None:
        super().__init__()
        self.reason = DRAIN_TIMEOUT

    def set(self, reason: str | None = None) -> None:  # noqa: A003 - asyncio.Event's name
        if reason is not None and not self.is_set():
            self.reason = reason
        super().set()

    @property
    def message(self) -> str:
        return f"{SHUTTING_DOWN} ({self.reason})"


CUT = object()  # queued into a stream's queue once the cut is set


async def watch(tasks: list[asyncio.Future], request, cut: asyncio.Event) -> str:
    """Wait until every task is done ("done"), the client disconnects
    ("disconnected"; ``request`` is the Starlette request, or None not to look)
    or the running requests are cut ("cut"). The disconnect is seen when the server
    sees it (the request's next ASGI message), so the caller aborts its engine
    requests before the engine's next step."""
    cut_wait = asyncio.ensure_future(cut.wait())
    gone = asyncio.ensure_future(_disconnected(request)) if request is not None else None
    try:
        while True:
            pending = [t for t in tasks if not t.done()]
            if not pending:
                return "done"
            if cut.is_set():
                return "cut"
            if gone is not None and gone.done():
                return "disconnected"
            await asyncio.wait([*pending, cut_wait, *((gone,) if gone is not None else ())],
                               return_when=asyncio.FIRST_COMPLETED)
    finally:
        cut_wait.cancel()
        if gone is not None:
            gone.cancel()


async def _disconnected(request) -> None:
    """Returns once the client has gone: the request's body is read, so the next
    message its ASGI server has for it is ``http.disconnect``."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _server_cls():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, but SIGTERM / SIGINT end it with status 0 (uvicorn
        re-raises the signal, which would exit with -15), a second signal of
        either kind forces (uvicorn forces only on a second SIGINT, and then
        drops the running requests' connections), and a drain or a force cuts
        the running requests with a JSON 503 (``cut``)."""

        cut: DrainCut
        drain_timeout: float | None = None

        def __init__(self, config) -> None:
            super().__init__(config)
            self._signals = 0
            self._loop: asyncio.AbstractEventLoop | None = None
            self._cut_at: asyncio.TimerHandle | None = None
            self._hard_stop: asyncio.TimerHandle | None = None

        @contextlib.contextmanager
        def capture_signals(self):
            self._loop = asyncio.get_running_loop()

            def on_signal(signum, frame):
                self._signals += 1
                self.should_exit = True
                if self._signals > 1:  # the loop's thread, between any two bytecodes: defer to the loop
                    self._loop.call_soon_threadsafe(self._cut, FORCED, f"a second {signal.Signals(signum).name}")

            old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for s, handler in old.items():
                    signal.signal(s, handler)

        def _cut(self, reason: str, why: str) -> None:
            if self.cut.is_set():
                return
            running = len(self.server_state.tasks)
            logger.warning("%s: shutting down now; %d running request(s) answered 503 (cut off)", why, running)
            self.cut.set(reason)
            self._hard_stop = asyncio.get_running_loop().call_later(CUT_GRACE_SECONDS, self._cancel_left)

        def _cancel_left(self) -> None:
            """The requests that have not answered since the cut: cancelled (``Guard`` (guard.py)
            answers each a JSON 503). A connection that still does not close (a client
            that reads nothing) is dropped a second later."""
            left = [t for t in self.server_state.tasks if not t.done()]
            if left:
                logger.warning("%d request(s) did not answer within %g s of the cut: cancelled", len(left),
                               CUT_GRACE_SECONDS)
                for t in left:
                    t.cancel()
            self._hard_stop = asyncio.get_running_loop().call_later(1.0, self._drop)

        def _drop(self) -> None:
            if self.server_state.connections:
                logger.warning("%d connection(s) still open after the cut: dropped", len(self.server_state.connections))
            self.force_exit = True

        async def shutdown(self, sockets=None):
            if self.drain_timeout is not None:
                self._cut_at = asyncio.get_running_loop().call_later(
                    self.drain_timeout, self._cut, DRAIN_TIMEOUT, f"--drain-timeout ({self.drain_timeout:g} s) passed")
            try:
                await super().shutdown(sockets=sockets)
                if self.force_exit:  # uvicorn skips the app's shutdown then: the engine still stops
                    await self.lifespan.shutdown()
            finally:
                for handle in (self._cut_at, self._hard_stop):
                    if handle is not None:
                        handle.cancel()

    return Server


def make_server(config, *, cut: DrainCut, drain_timeout: float | None = None):
    """uvicorn's server for ``config`` with the drain, the cut and the force above."""
    server = _server_cls()(config)
    server.cut, server.drain_timeout = cut, drain_timeout
    return server
