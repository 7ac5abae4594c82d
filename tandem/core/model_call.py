"""A function run against the loaded model between engine steps.

Some per-request work needs the model itself, not a scheduled step: Whisper's
word timestamps recompute a finished window's cross-attention on it. The
thread that owns the engine runs such a call between two steps, so it never
races a step and the model is never run by two threads at once. ``LLM``
owns its engine on the caller's thread and calls :func:`call_model` directly;
``AsyncLLM`` queues a :class:`ModelCall` like its other commands, its engine
thread runs it, and the caller waits on the call's future from its own thread.

A call blocks the step loop for as long as the function runs, no longer (the
caller does the rest of its work on its own thread). Its failure is the
caller's alone: it comes back as :class:`ModelCallError` and the engine serves on.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from tandem.core.faults import describe


class ModelCallError(ValueError):
    """A function run on the model raised; the message names the exception. A
    ``ValueError`` so that the one request (or input) that asked fails, not its batch."""


def call_model(fn: Callable[[Any], Any], model: Any) -> Any:
    """``fn(model)``; a ``ValueError`` or ``TypeError`` it raises passes unchanged (it
    names a bad value already), any other exception becomes :class:`ModelCallError`."""
    try:
        return fn(model)
    except (ValueError, TypeError):
        raise
    except Exception as e:  # noqa: BLE001 - the caller's request fails, the engine serves on
        raise ModelCallError(f"running on the model failed: {describe(e)}") from e


@dataclass
class ModelCall:
    """One queued call: the engine thread runs it (:meth:`run`), the caller waits on ``future``."""

    fn: Callable[[Any], Any]
    future: Future = field(default_factory=Future)

    def run(self, model: Any) -> None:
        """Run the call against ``model`` on the engine thread; never raises an
        ``Exception`` (the future carries it). Skipped when the caller cancelled."""
        if not self.future.set_running_or_notify_cancel():
            return
        try:
            result = call_model(self.fn, model)
        except Exception as e:  # noqa: BLE001 - delivered to the caller
            self.future.set_exception(e)
        else:
            self.future.set_result(result)

    def fail(self, error: BaseException) -> None:
        """The engine cannot run it (dead or shutting down)."""
        if self.future.set_running_or_notify_cancel():
            self.future.set_exception(error)
