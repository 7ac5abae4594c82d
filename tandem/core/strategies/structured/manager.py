"""The engine's structured-output manager: grammars compiled off the step loop,
within a size and a time budget, and one mask per step for the rows that need one.

``grammar(so)`` returns a future: the compile runs in a worker thread, cached
by (kind, spec), so identical specs compile once and a request joins a compile
already under way. Until its future is done a request is not scheduled (its
strategy says it is not ready) while every other request runs; a compile that
fails is that request's ``error``. Each step ``grammar_bitmask`` fills one
bitmask with the next-token masks of the step's structured rows (one batched
call into xgrammar) for the worker to apply before the logits processors.

Budgets. A spec longer than ``max_chars`` is refused before compiling. A compile
not done ``timeout`` seconds after it was asked for fails its future, naming the
budget. xgrammar's compile is one native call that cannot be interrupted, so the
workers are daemon threads: one past its budget runs on until xgrammar returns
(its result then goes to the cache, never to the request that gave up) holding
one of the ``max_workers`` slots, and never holds the engine or the process's
exit. A killable compile process was the alternative; it would need every
compiled grammar (and its token-mask cache, megabytes for a large vocabulary)
serialised back across a pipe, and a second copy of the vocabulary: the size
budget is what bounds how long a runaway compile can run, and both ways need it.
"""

from __future__ import annotations

import concurrent.futures as cf
import heapq
import logging
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tandem.core.faults import describe
from tandem.core.strategies.base import LogitsTransform
from tandem.core.strategies.structured.bounds import DEFAULT_MAX_REPEAT
from tandem.core.strategies.structured.backend import (
    DEFAULT_MAX_WHITESPACE, GrammarCompileError, XgrammarBackend, apply_bitmask, fill_bitmask, import_xgrammar, new_bitmask,
)

if TYPE_CHECKING:
    import torch

    from tandem.core.structured_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

# Compiled grammars kept (least recently asked for dropped first).
CACHE_SIZE = 512
# The engine options' defaults (EngineConfig.structured_outputs_compile_timeout / _max_chars).
DEFAULT_COMPILE_TIMEOUT_S = 30.0
DEFAULT_MAX_CHARS = 64 * 1024


@dataclass(frozen=True)
class GrammarMask(LogitsTransform):
    """The step's structured-output masks, sent beside the scheduler output: bit ``t``
    of ``bitmask[j]`` (int32 ``[len(seq_ids), ceil(vocab / 32)]``) is set where token
    ``t`` is allowed for sequence ``seq_ids[j]``."""

    seq_ids: list[int]
    bitmask: "torch.Tensor"

    def apply(self, logits, rows, owners, num_output_tokens) -> None:
        # Disallowed tokens to -inf on a copy of the rows (the mask's rows are its own).
        sub = logits[rows]
        apply_bitmask(sub, self.bitmask[owners], list(range(len(rows))))
        logits[rows] = sub


@dataclass
class _Compile:
    so: "StructuredOutputsParams"
    future: cf.Future
    waiters: int = 0  # frontends waiting that may still give up (release)
    pinned: bool = False  # an engine request waits for it: never cancelled
    running: bool = False  # in a worker (maybe past its budget: xgrammar cannot be stopped)


@dataclass(order=True)
class _Deadline:
    at: float
    entry: _Compile = field(compare=False)
    future: cf.Future = field(compare=False)  # the entry's future it bounds


class StructuredOutputManager:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], max_workers: int = 2, *,
                 timeout: float = DEFAULT_COMPILE_TIMEOUT_S, max_chars: int = DEFAULT_MAX_CHARS,
                 max_repeat: int = DEFAULT_MAX_REPEAT, max_whitespace: int = DEFAULT_MAX_WHITESPACE) -> None:
        """``vocab_size``: the LM head's (masks cover every id the model can score);
        ``stop_token_ids``: the engine's EOS ids; ``timeout`` (seconds) and
        ``max_chars``: the compile budgets; ``max_repeat``: the grammar cost bound
        (``bounds.py``); ``max_whitespace``: JSON whitespace run (0: any). Nothing is
        imported or built until the first structured request."""
        self._tokenizer, self.vocab_size, self._stop_ids = tokenizer, vocab_size, list(stop_token_ids)
        self.max_repeat, self.max_whitespace = max_repeat, max_whitespace
        self._max_workers, self.timeout, self.max_chars = max_workers, timeout, max_chars
        self._backend: XgrammarBackend | None = None
        self._cache: OrderedDict[tuple, _Compile] = OrderedDict()
        # grammar() may be called from a frontend thread (a server checking a spec before
        # it queues the request) while the engine thread adds requests.
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)  # the queue and the deadlines changed
        self._queue: deque[_Compile] = deque()
        self._deadlines: list[_Deadline] = []
        self._workers = 0
        self._watchdog: threading.Thread | None = None
        self._closed = False
        self._bitmask = None  # reused across steps, grown on demand: [rows, ceil(vocab / 32)]
        self._batch = None  # xgrammar's BatchGrammarMatcher

    @property
    def backend(self) -> XgrammarBackend:
        """Raises ``ImportError`` naming the extra without xgrammar, ``ValueError`` for a
        model structured output cannot serve (no tokenizer, no EOS)."""
        if self._backend is None:
            import_xgrammar()
            self._backend = XgrammarBackend(self._tokenizer, self.vocab_size, self._stop_ids,
                                            max_repeat=self.max_repeat, max_whitespace=self.max_whitespace)
        return self._backend

    # -- requests ------------------------------------------------------------
    def grammar(self, so: "StructuredOutputsParams", *, may_release: bool = False) -> cf.Future:
        """A future of ``so``'s compiled grammar (failing with ``GrammarCompileError``:
        it does not compile, it is over the size budget, or it missed the time budget);
        the compile starts now unless one for an equal spec is done or under way.
        ``may_release``: the caller calls ``release(so)`` once it stops waiting, and a
        compile nobody waits for any more is cancelled before it starts. Thread-safe."""
        size = _chars(so)
        if size > self.max_chars:
            failed: cf.Future = cf.Future()
            failed.set_exception(GrammarCompileError(
                f"StructuredOutputsParams.{so.kind}: {size} characters, over the grammar size budget of "
                f"{self.max_chars} (engine option structured_outputs_max_chars); it was not compiled"))
            return failed
        key = so.cache_key
        with self._lock:
            backend = self.backend
            entry = self._cache.get(key)
            if entry is not None and _failed(entry.future) and entry.running:
                # Its compile is past the budget but runs on: a new asker waits for that one.
                entry.future = cf.Future()
                entry.future.set_running_or_notify_cancel()
                self._add_deadline(entry)
            elif entry is None or _failed(entry.future):
                if self._closed:
                    raise RuntimeError("the engine is shut down")
                entry = _Compile(so, cf.Future())
                self._cache[key] = entry
                while len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
                self._queue.append(entry)
                self._add_deadline(entry)
                self._start_threads(backend)
            self._cache.move_to_end(key)
            if may_release:
                entry.waiters += 1
            else:
                entry.pinned = True
            return entry.future

    def _add_deadline(self, entry: _Compile) -> None:
        heapq.heappush(self._deadlines, _Deadline(time.monotonic() + self.timeout, entry, entry.future))
        self._work.notify_all()

    def release(self, so: "StructuredOutputsParams") -> None:
        """A frontend that asked with ``may_release`` stopped waiting (its client left):
        the compile, if nobody else waits and it has not started, is cancelled."""
        with self._lock:
            entry = self._cache.get(so.cache_key)
            if entry is None or entry.waiters <= 0:
                return
            entry.waiters -= 1
            if entry.waiters == 0 and not entry.pinned and entry.future.cancel():  # False once running or done
                self._cache.pop(so.cache_key, None)

    def has_pending(self) -> bool:
        with self._lock:
            return any(not e.future.done() for e in self._cache.values())

    def wait(self, timeout: float) -> None:
        """Block until a compile under way finishes, or ``timeout`` seconds."""
        with self._lock:
            pending = [e.future for e in self._cache.values() if not e.future.done()]
        if pending:
            cf.wait(pending, timeout, return_when=cf.FIRST_COMPLETED)

    def shutdown(self) -> None:
        """Fails the compiles not yet started; one running ends in its daemon thread,
        which holds nothing."""
        with self._lock:
            self._closed = True
            while self._queue:
                self._queue.popleft().future.cancel()
            self._work.notify_all()

    # -- the workers ---------------------------------------------------------
    def _start_threads(self, backend: XgrammarBackend) -> None:
        # Under self._lock. Daemon threads: xgrammar's compile cannot be interrupted, and a
        # non-daemon thread in one would hold the interpreter's exit until it returns.
        if self._workers < self._max_workers and len(self._queue) > 0:
            self._workers += 1
            threading.Thread(target=self._worker, args=(backend,), name="tandem-grammar", daemon=True).start()
        if self._watchdog is None:
            self._watchdog = threading.Thread(target=self._watch, name="tandem-grammar-budget", daemon=True)
            self._watchdog.start()

    def _worker(self, backend: XgrammarBackend) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._closed:
                    self._work.wait()
                if self._closed:
                    self._workers -= 1
                    return
                entry = self._queue.popleft()
                # Not when released or past its budget while queued.
                if entry.future.done() or not entry.future.set_running_or_notify_cancel():
                    continue
                entry.running = True
            try:
                result, error = backend.compile(entry.so), None
            except Exception as e:  # noqa: BLE001 - the request's error (GrammarCompileError, MemoryError)
                result, error = None, e
            with self._lock:
                entry.running = False
                if not _settle(entry.future, result=result, exception=error) and error is None:
                    entry.future = cf.Future()  # past its budget: the cache keeps the result for a retry
                    entry.future.set_result(result)

    def _watch(self) -> None:
        """Fails each compile still not done at its deadline, naming the budget."""
        while True:
            with self._lock:
                if self._closed:
                    return
                now = time.monotonic()
                while self._deadlines and (self._deadlines[0].at <= now or self._deadlines[0].future.done()):
                    d = heapq.heappop(self._deadlines)
                    if _settle(d.future, exception=GrammarCompileError(
                            f"StructuredOutputsParams.{d.entry.so.kind}: did not compile within the grammar compile "
                            f"time budget of {self.timeout:g} s (engine option structured_outputs_compile_timeout)")):
                        logger.warning("a %s grammar compile passed its %g s budget: its requests fail (a compile "
                                       "under way runs on in its daemon thread)", d.entry.so.kind, self.timeout)
                self._work.wait(None if not self._deadlines else max(0.0, self._deadlines[0].at - now))

    # -- the step ------------------------------------------------------------
    def grammar_mask(self, items: list[tuple[str, list[int], list]]) -> tuple["GrammarMask | None", dict[str, str]]:
        """The step's mask (None when no row needs one) from ``(request id, seq ids,
        their matchers)`` of the scheduled structured requests, and the requests whose
        matcher failed to give one, with why (they fail alone)."""
        owners, seq_ids, matchers = [], [], []
        for rid, ids, ms in items:
            owners += [rid] * len(ids)
            seq_ids += ids
            matchers += ms
        if not seq_ids:
            return None, {}
        rows = list(range(len(seq_ids)))  # the mask's own rows: the worker maps seq ids to its rows
        bitmask = self._buffer(len(rows))
        failed: dict[str, str] = {}
        try:
            fill_bitmask(matchers, bitmask, rows, self._batch)
        except Exception:  # noqa: BLE001 - find whose matcher it was, fail those alone
            for r, m, rid in zip(rows, matchers, owners):
                try:
                    m.fill_next_token_bitmask(bitmask, r)
                except Exception as e:  # noqa: BLE001
                    failed.setdefault(rid, f"its grammar could not give the next-token mask: {describe(e)}")
            keep = [i for i, rid in enumerate(owners) if rid not in failed]
            if not keep:
                return None, failed
            bitmask = bitmask[keep]
            seq_ids = [seq_ids[i] for i in keep]
        return GrammarMask(seq_ids, bitmask.clone()), failed

    def _buffer(self, num_rows: int):
        if self._bitmask is None or self._bitmask.shape[0] < num_rows:
            cap = max(num_rows, 2 * (0 if self._bitmask is None else self._bitmask.shape[0]), 8)
            self._bitmask = new_bitmask(cap, self.vocab_size)
            xgr = import_xgrammar()
            if self._batch is None and hasattr(xgr, "BatchGrammarMatcher"):  # xgrammar >= 0.1.26
                self._batch = xgr.BatchGrammarMatcher()  # threads: half the cores
        return self._bitmask[:num_rows]


def _settle(future: cf.Future, *, result=None, exception: BaseException | None = None) -> bool:
    """Set ``future``'s outcome unless it has one (a budget or a release got there first)."""
    try:
        if exception is not None:
            future.set_exception(exception)
        else:
            future.set_result(result)
        return True
    except cf.InvalidStateError:
        return False


def _failed(future: cf.Future) -> bool:
    return future.done() and (future.cancelled() or future.exception() is not None)


def _chars(so: "StructuredOutputsParams") -> int:
    spec = so.spec
    if isinstance(spec, str):
        return len(spec)
    if isinstance(spec, tuple):
        return sum(len(c) for c in spec)
    return 0
