"""``AsyncLLM``: the engine for asyncio services.

The engine loop runs in a background thread that owns the ``LLMEngine``
(which is single-threaded). Nothing heavy runs there: a request's own work
(tokenizing, decoding audio, validating: ``LLMEngine.process_request``) runs
first on the input threads (``input_pool.InputPool``), and only the processed
request reaches the engine thread. Requests, aborts, stop-string hits and
failures reach it through a command queue (so do model calls between steps,
``call_model``, which the engine sends to the workers through its executor).
Each step's plain per-request results (``tandem.core.core_outputs``) go to the
output loop on the event loop (``loop.call_soon_threadsafe``, one batch per
step): the engine's one ``OutputProcessor`` (the same ``LLM`` uses: detokenizing,
stop strings) turns them into ``RequestOutput``s and puts each in its request's
own ``asyncio.Queue``, so the engine thread never detokenizes. The event loop
only enqueues, detokenizes and awaits, so it stays responsive while the engine
computes (torch releases the GIL in its kernels). Nothing here reads the
scheduler or the model: queue figures come from the core's published snapshot.

Admission is fair between client requests: requests given the same
``queue_group`` (a server passes one per HTTP request) take turns with other
groups, both on the input threads and into the scheduler's waiting queue, which
the engine thread keeps no longer than ``max_num_seqs`` (what one step could
admit) and fills from the groups in turn. A request of 5,000 prompts thus delays
a later request of one prompt by one turn, not by 5,000 prompts.

>>> engine = AsyncLLM(model="path/to/bart")
>>> async for out in engine.generate("the rain in spain", SamplingParams(max_tokens=8), "req-1"):
...     print(out.outputs[0].text)

Cancelling the consumer (or ``await engine.abort(request_id)``) frees the
request's blocks on the engine's next pass. If the engine loop dies, every
waiting request raises ``EngineDeadError`` and later calls refuse at once; a
request the engine rejects (bad prompt or sampling value) raises that
``ValueError`` / ``TypeError`` in its own consumer only.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import itertools
import logging
import os
import queue
import threading
from collections import deque
from collections.abc import AsyncIterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tandem.core.config import EngineConfig
from tandem.core.engine_args import check_kwargs, signature as engine_signature
from tandem.core.engine import LLMEngine
from tandem.core.core_outputs import RequestResult
from tandem.core.inputs import PromptType
from tandem.core.model_call import ModelCall
from tandem.core.outputs import RequestOutput
from tandem.core.faults import EngineDeadError, EngineHealth, describe
from tandem.core.request_processor import ProcessedRequest
from tandem.core.sampling_params import SamplingParams
from tandem.entrypoints.input_pool import InputPool, RoundRobin

if TYPE_CHECKING:
    from tandem.core.structured_params import StructuredOutputsParams

logger = logging.getLogger(__name__)


# Threads that process requests' inputs: tokenizing runs in Rust without the GIL, so
# more than one keeps a long prompt from holding up short ones; a few are enough.
INPUT_THREADS = min(4, max(2, os.cpu_count() or 2))


@dataclass
class _Add:
    request_id: str
    request: ProcessedRequest
    stream: "_Stream"
    group: Any  # whose turn it takes (RoundRobin)


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Stop:
    """Stop strings the output loop found: request id -> completion index -> the stop string."""

    stops: dict[str, dict[int, str]]


@dataclass
class _Fail:
    """Requests whose outputs could not be built: request id -> why."""

    why: dict[str, str]


class _Stream:
    """One request's queue: its outputs (put by the output loop) or the error that
    ends it (put from the engine thread)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> None:  # called from the engine thread
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the consumer's loop is closed: nobody is waiting
            pass


class AsyncLLM:
    def __init__(self, model: str, *, start: bool = True, **engine_args: Any) -> None:
        """``engine_args``: the same options as :class:`tandem.LLM` (``help(LLM)`` lists them);
        ``start=False`` leaves the engine thread to :meth:`start`."""
        from tandem.plugins import default_backend_registry, default_mode_registry, default_model_registry

        check_kwargs("AsyncLLM", engine_args)
        self.engine = LLMEngine(EngineConfig(model=model, **engine_args), default_model_registry(), default_backend_registry(),
                                 default_mode_registry())
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._model_calls: deque[ModelCall] = deque()  # queued by call_model, run by the engine thread
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._inputs = InputPool(INPUT_THREADS)
        # Engine thread only: processed requests not yet in the scheduler, and their turns.
        self._held: dict[str, _Add] = {}
        self._turns: RoundRobin[str] = RoundRobin()
        self._num_held = 0  # len(_held), published by the engine thread for get_stats
        self._ids = itertools.count()
        self._dead: BaseException | None = None
        self._stopping = False
        self._thread: threading.Thread | None = None
        if start:
            self.start()

    __init__.__signature__ = engine_signature(
        inspect.Parameter("start", inspect.Parameter.KEYWORD_ONLY, default=True, annotation=bool)
    )

    # -- state -------------------------------------------------------------------------
    @property
    def errored(self) -> bool:
        return self._dead is not None

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def health(self) -> EngineHealth:
        """``ok``, ``degraded`` (recent steps failed; it serves on) or ``dead``: the
        engine thread's published snapshot (``tandem/core/faults.py``)."""
        h = self.engine.health()
        if self._dead is not None and h.status != "dead":
            return EngineHealth("dead", h.consecutive_step_failures, h.failed_steps, describe(self._dead))
        if not self.is_running and h.status != "dead":
            return EngineHealth("dead", h.consecutive_step_failures, h.failed_steps, "the engine loop is not running")
        return h

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        return self.engine.get_default_sampling_params()

    def get_stats(self) -> dict[str, int | float]:
        """Engine counters (read from the snapshot the engine thread publishes); waiting
        requests include those processed and held for their turn."""
        stats = self.engine.get_stats()
        held = self._num_held
        if held:
            stats["num_requests_waiting"] += held
            stats["num_requests_unfinished"] += held
        return stats

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tandem-engine", daemon=True)
            self._thread.start()

    async def shutdown(self, timeout: float | None = None) -> None:
        """Stop the engine loop (unfinished requests are aborted) and wait for it."""
        self._stopping = True
        self._inputs.shutdown(EngineDeadError("the engine is shutting down"))
        self._wake.set()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, timeout)
        if self._thread is None or not self._thread.is_alive():
            self.engine.shutdown()  # the executor's worker processes, if any

    # -- requests ----------------------------------------------------------------------
    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        prompt_slot=None,
        queue_group: str | None = None,
        lora_request=None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs as the engine produces them (per its
        ``output_kind``: cumulative, delta, or only the final one); the last has
        ``finished`` set. Leaving the loop early aborts the request. Requests with
        the same ``queue_group`` (the prompts of one client request) queue in order
        and take turns with other groups; without one a request is its own group.
        ``lora_request``: the :class:`tandem.LoRARequest` it runs with (``enable_lora=True``;
        None: the base model); a refused one raises ``ValueError`` as a bad prompt does."""
        self._check_alive()
        rid = request_id if request_id is not None else f"async-{next(self._ids)}"
        group = ("request", rid) if queue_group is None else ("group", queue_group)
        # Tokenizing, audio decoding and validation: on an input thread, never the engine's.
        job = functools.partial(self.engine.process_request, prompt, sampling_params, prompt_slot=prompt_slot,
                                lora_request=lora_request)
        try:
            processed = await asyncio.wrap_future(self._inputs.submit(group, job))
        except (ValueError, TypeError, EngineDeadError):
            raise
        except RuntimeError:  # the pool is shut down
            self._check_alive()
            raise
        except Exception as e:  # noqa: BLE001 - this request alone cannot be served
            raise ValueError(f"the request cannot be served: {describe(e)}") from e
        so = processed.params.structured_outputs
        if so is not None:
            # Compiled before the request reaches the scheduler: a request waiting for its
            # grammar would sit in the waiting queue that the engine thread fills only up to
            # max_num_seqs, holding plain requests behind its compile. A spec that fails
            # (bad, over a budget) goes on to the engine, which fails the request with it.
            try:
                await self.compile_structured_outputs(so)
            except (ValueError, ImportError):
                pass
        self._check_alive()
        stream = _Stream(asyncio.get_running_loop())
        self._send(_Add(rid, processed, stream, group))
        if self._dead is not None or self._stopping:  # the loop may have drained its commands already
            self._drain_commands(self._stopped_error())
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:  # the consumer left early (cancelled, disconnected, broke out)
                self._send(_Abort(rid))

    async def compile_structured_outputs(self, so: StructuredOutputsParams) -> None:
        """Wait until ``so`` has compiled, so a frontend can refuse a bad spec before it
        queues the request (the compile is cached: the request that follows reuses it).
        Raises ``ValueError`` naming the field and the cause, ``ImportError`` naming the
        ``structured`` extra without xgrammar. Cancelling the wait cancels the compile if
        it has not started and nobody else waits for it; one under way runs on (it cannot
        be stopped, and its time budget bounds it) for whoever asks for the same spec next."""
        future = self.engine.compile_structured_outputs(so, may_release=True)
        try:
            await asyncio.shield(asyncio.wrap_future(future))
        finally:
            self.engine.release_structured_outputs(so)

    def call_model(self, method: str, *args: Any) -> Future:
        """Run one of the model's declared calls (``LLMEngine.call_model``) between two
        steps, on every rank through the executor; callable from any thread. The future
        gets rank 0's answer, or a ``ValueError`` (``ModelCallError``) when it fails, or
        ``EngineDeadError``; the engine serves on after a failed call. Cancelling the
        future before it runs skips it."""
        self._check_alive()
        call = ModelCall(method, args)
        self._send(call)
        if self._dead is not None or self._stopping:  # the loop may have drained its commands already
            self._drain_commands(self._stopped_error())
        return call.future

    def _stopped_error(self) -> EngineDeadError:
        return EngineDeadError("the engine is shutting down" if self._dead is None
                               else f"the engine loop stopped: {describe(self._dead)}")

    def _send(self, cmd) -> None:
        self._commands.put(cmd)
        self._wake.set()

    async def abort(self, request_id: str) -> None:
        """Abort a request; its blocks are freed on the engine's next pass and its
        consumer receives the aborted output."""
        self._send(_Abort(request_id))

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine loop stopped: {type(self._dead).__name__}: {self._dead}") from self._dead
        if self._stopping:
            raise EngineDeadError("the engine is shutting down")
        if not self.is_running:
            raise EngineDeadError("the engine loop is not running (call start())")

    # -- the engine thread -------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stopping:
                self._apply_commands()
                if self._model_calls:  # one per pass: steps go on between queued calls
                    self._model_calls.popleft().run(engine)
                if not engine.has_unfinished_requests():
                    if not self._model_calls:
                        self._wake.wait(0.5)
                        self._wake.clear()
                    continue
                self._deliver(engine.core.step())
        except BaseException as e:  # the loop is dead: every waiting request learns why
            logger.exception("engine loop died")
            self._dead = e
            dead = EngineDeadError(f"the engine loop stopped: {type(e).__name__}: {e}")
            for stream in self._streams.values():
                stream.put(dead)
            self._streams.clear()
            engine.output_processor.requests.clear()
            self._held.clear()
            self._num_held = 0
            self._drain_commands(dead)
            return
        # Shutting down: abort what is left (what never reached the scheduler gets an error).
        for rid, cmd in self._held.items():
            cmd.stream.put(EngineDeadError("the engine is shutting down"))
            del self._streams[rid]
        self._held.clear()
        self._num_held = 0
        if self._streams:
            self._deliver(engine.core.abort(set(self._streams)))
        self._drain_commands(EngineDeadError("the engine is shutting down"))

    def _apply_commands(self) -> None:
        self._take_commands()
        self._feed()
        self._num_held = len(self._held)

    def _take_commands(self) -> None:
        engine = self.engine
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, _Add):
                if cmd.request_id in self._streams:
                    cmd.stream.put(ValueError(f"request id {cmd.request_id!r} is already in use"))
                    continue
                self._streams[cmd.request_id] = cmd.stream
                self._held[cmd.request_id] = cmd
                self._turns.push(cmd.group, cmd.request_id)
            elif isinstance(cmd, ModelCall):
                self._model_calls.append(cmd)
            elif isinstance(cmd, _Stop):
                engine.core.stop(cmd.stops)
                live = engine.core.stats.live_request_ids  # published by stop()
                for rid in cmd.stops:
                    if rid not in live:  # it ended: nothing more to send
                        self._streams.pop(rid, None)
            elif isinstance(cmd, _Fail):  # its consumer has its error output already
                for rid in cmd.why:
                    self._streams.pop(rid, None)
                engine.core.fail(cmd.why)
            else:
                held = self._held.pop(cmd.request_id, None)
                if held is not None:  # into the engine and out: its consumer gets the aborted output
                    self._admit(held)
                self._deliver(engine.core.abort({cmd.request_id}))
                self._streams.pop(cmd.request_id, None)

    def _feed(self) -> None:
        """Move held requests into the scheduler, groups in turn, while its waiting queue
        is shorter than what one step could admit (so the scheduler always has enough
        to choose from, and a later group never queues behind an earlier one's backlog)."""
        core, cap = self.engine.core, self.engine.config.max_num_seqs
        while len(self._turns) and core.stats.num_requests_waiting < cap:  # the snapshot add() publishes
            cmd = self._held.pop(self._turns.pop(), None)
            if cmd is not None:  # else: aborted while held
                self._admit(cmd)

    def _admit(self, cmd: _Add) -> None:
        try:
            self.engine.add_request(cmd.request_id, cmd.request, queue=cmd.stream.queue)
        except EngineDeadError:
            raise
        except (ValueError, TypeError) as e:
            self._streams.pop(cmd.request_id, None)
            cmd.stream.put(e)
            return
        except Exception as e:  # noqa: BLE001 - this request alone cannot be served
            self._streams.pop(cmd.request_id, None)
            cmd.stream.put(ValueError(f"the request cannot be served: {describe(e)}"))

    def _deliver(self, results: list[RequestResult]) -> None:
        """Hand the results to the output loop of each consumer's event loop, one batch
        per loop (most often the one loop)."""
        batches: dict[asyncio.AbstractEventLoop, list[RequestResult]] = {}
        for res in results:
            stream = self._streams.get(res.request_id)
            if stream is not None:
                if res.finished:
                    del self._streams[res.request_id]
                batches.setdefault(stream.loop, []).append(res)
        for loop, batch in batches.items():
            try:
                loop.call_soon_threadsafe(self._process_outputs, batch)
            except RuntimeError:  # the consumers' loop is closed: nobody is waiting
                for res in batch:
                    self.engine.output_processor.forget(res.request_id)

    def _process_outputs(self, results: list[RequestResult]) -> None:
        """The output loop, on the consumers' event loop: the engine's output processor
        puts each output in its request's queue; stop strings found and outputs that
        could not be built go back to the engine thread."""
        done = self.engine.output_processor.process(results)
        if done.stops:  # the core frees those sequences (and the request, once all ended)
            self._send(_Stop(done.stops))
        if done.failed:  # the core logs each with why
            self._send(_Fail(done.failed))

    def _drain_commands(self, error: BaseException) -> None:
        while True:  # the caller's thread may drain too (call_model): pop, never peek
            try:
                call = self._model_calls.popleft()
            except IndexError:
                break
            call.fail(error)
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, _Add):
                cmd.stream.put(error)
            elif isinstance(cmd, ModelCall):
                cmd.fail(error)
