"""What the engine does when a step fails, and how healthy it is.

Policy (``EngineConfig.max_consecutive_step_failures``, default 3):

- An exception attributable to one request (its logits processor, its beam
  update, its detokenizing) fails that request alone: it ends with ``error``
  set and its blocks freed; the step's other requests go on.
- An exception in the step itself (the forward pass, an attention backend,
  a KV copy, a worker-side ``MemoryError``) cannot be pinned on one request:
  every request scheduled in that step fails with the cause (and, when a swap
  was under way, every swapped-out request, whose CPU copy may be torn). No
  request is re-run automatically: re-running the request that caused the
  fault would take the next step's requests down with it; a client may retry.
  Requests not in the step wait untouched and the engine serves on.
- A worker process that raised or died (``EngineDeadError`` from the executor)
  makes the engine dead at once: the ranks' collectives are out of step.
- After that many failed steps in a row, with no good step between, the fault
  is taken as the engine's, not a request's: the engine declares itself dead
  (``EngineDeadError`` from then on; ``/health`` answers 503).

``KeyboardInterrupt`` and ``SystemExit`` are not faults: they propagate, and
the caller's own clean-up aborts its requests.
"""

from __future__ import annotations

from dataclasses import dataclass


class EngineDeadError(RuntimeError):
    """The engine stopped on an error; no request can be served any more."""


class KVTransferError(RuntimeError):
    """Swapping KV blocks between the device and the CPU pool failed part of the way."""


@dataclass(frozen=True)
class EngineHealth:
    """A snapshot, replaced (never mutated) after each step, so another thread may
    read it without a lock. ``status``: ``ok``; ``degraded`` (the last step failed,
    fewer than the limit in a row); ``dead``."""

    status: str = "ok"
    consecutive_step_failures: int = 0
    failed_steps: int = 0
    last_error: str | None = None


def describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


class StepFaults:
    """Counts failed steps and decides when the engine is dead."""

    def __init__(self, max_consecutive: int) -> None:
        self.max_consecutive = max_consecutive
        self.health = EngineHealth()
        self.cause: BaseException | None = None  # what killed the engine

    @property
    def dead(self) -> bool:
        return self.health.status == "dead"

    def check_alive(self) -> None:
        if self.dead:
            raise EngineDeadError(f"the engine is dead: {self.health.last_error}") from self.cause

    def step_ok(self) -> None:
        h = self.health
        if h.consecutive_step_failures:
            self.health = EngineHealth("ok", 0, h.failed_steps, h.last_error)

    def step_failed(self, e: BaseException) -> bool:
        """Record a failed step; True when it makes the engine dead."""
        h = self.health
        n = h.consecutive_step_failures + 1
        # A worker that raised or died (the executor's EngineDeadError) is dead at once.
        dead = n >= self.max_consecutive or isinstance(e, EngineDeadError)
        self.health = EngineHealth("dead" if dead else "degraded", n, h.failed_steps + 1, describe(e))
        if dead:
            self.cause = e
        return dead
