"""A model method run between engine steps, on every rank, through the executor.

Some per-request work needs the model itself, not a scheduled step: Whisper's
word timestamps recompute a finished window's cross-attention, its no-speech
probability reads the logits after a prompt. A model class names the methods a
frontend may call this way (``EncoderDecoderModel.model_calls``); the engine
sends a call to the workers as a request like a step
(``Executor.collective_rpc("call_model", ...)``), so every tensor-parallel rank
runs its shard and the collectives inside the method join them; rank 0's
answer comes back. Frontends never hold the model: the call is a name and
plain arguments, which also cross to worker processes and Ray actors.

The thread that owns the engine runs a call between two steps, so it never
races a step. ``LLM`` owns its engine on the caller's thread and calls
``LLMEngine.call_model`` directly; ``AsyncLLM`` queues a :class:`ModelCall`
like its other commands, its engine thread runs it, and the caller waits on
the call's future from its own thread. A call blocks the step loop for as
long as the method runs, no longer. Its failure is the caller's alone: it
comes back as :class:`ModelCallError` (a ``ValueError`` or ``TypeError`` as
raised) and the engine serves on.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from tandem.core.faults import EngineDeadError, describe


class ModelCallError(ValueError):
    """A model call raised; the message names the method and the exception. A
    ``ValueError`` so that the one request (or input) that asked fails, not its batch."""


def check_model_call(model_cls: type, method: Any) -> None:
    """``ValueError`` unless ``method`` is one of the names ``model_cls`` declares."""
    allowed = tuple(getattr(model_cls, "model_calls", ()))
    if not isinstance(method, str) or method not in allowed:
        raise ValueError(f"model call {method!r}: {model_cls.__name__} declares "
                         f"{', '.join(map(repr, allowed)) if allowed else 'no model calls'}")


def run_model_call(executor: Any, method: str, args: tuple) -> Any:
    """Rank 0's answer to ``method(*args)`` run on every rank. A ``ValueError`` or
    ``TypeError`` passes unchanged (it names a bad value already), a dead worker's
    ``EngineDeadError`` too; any other exception becomes :class:`ModelCallError`."""
    try:
        return executor.collective_rpc("call_model", (method, tuple(args)))[0]
    except (ValueError, TypeError, EngineDeadError):
        raise
    except Exception as e:  # noqa: BLE001 - the caller's request fails, the engine serves on
        raise ModelCallError(f"model call {method!r} failed: {describe(e)}") from e


@dataclass
class ModelCall:
    """One queued call: the engine thread runs it (:meth:`run`), the caller waits on ``future``."""

    method: str
    args: tuple
    future: Future = field(default_factory=Future)

    def run(self, engine: Any) -> None:
        """Run the call through ``engine`` (an ``LLMEngine``) on the engine thread; never
        raises an ``Exception`` (the future carries it). Skipped when the caller cancelled."""
        if not self.future.set_running_or_notify_cancel():
            return
        try:
            result = engine.call_model(self.method, *self.args)
        except EngineDeadError as e:  # a worker is gone: the caller learns it, the engine loop dies
            self.future.set_exception(e)
            raise
        except Exception as e:  # noqa: BLE001 - delivered to the caller
            self.future.set_exception(e)
        else:
            self.future.set_result(result)

    def fail(self, error: BaseException) -> None:
        """The engine cannot run it (dead or shutting down)."""
        if self.future.set_running_or_notify_cancel():
            self.future.set_exception(error)
