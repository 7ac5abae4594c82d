"""The engine's structured-output manager: grammars compiled off the step loop,
one mask per step for the rows that need one.

``grammar(so)`` returns a future: the compile runs in a worker thread, cached
by (kind, spec), so identical specs compile once and a request joins a compile
already under way. Until its future is done a request is not scheduled (its
strategy says it is not ready) while every other request runs; a compile that
fails is that request's ``error``. Each step ``grammar_bitmask`` fills one
bitmask with the next-token masks of the step's structured rows (one batched
call into xgrammar) for the worker to apply before the logits processors.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
from collections import OrderedDict
from collections.abc import Mapping
from typing import TYPE_CHECKING

from tandem.core.faults import describe
from tandem.core.scheduler_output import GrammarBitmask, SchedulerOutput
from tandem.core.strategies.structured import StructuredStrategy
from tandem.core.structured_output.backend import XgrammarBackend, fill_bitmask, import_xgrammar, new_bitmask

if TYPE_CHECKING:
    from tandem.core.sequence import SequenceGroup
    from tandem.core.structured_output.params import StructuredOutputsParams

logger = logging.getLogger(__name__)

# Compiled grammars kept (least recently asked for dropped first).
CACHE_SIZE = 512


class StructuredOutputManager:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], max_workers: int = 1) -> None:
        """``vocab_size``: the LM head's (masks cover every id the model can score);
        ``stop_token_ids``: the engine's EOS ids. Nothing is imported or built until
        the first structured request."""
        self._tokenizer, self.vocab_size, self._stop_ids = tokenizer, vocab_size, list(stop_token_ids)
        self._max_workers = max_workers
        self._backend: XgrammarBackend | None = None
        self._executor: cf.ThreadPoolExecutor | None = None
        self._cache: OrderedDict[tuple, cf.Future] = OrderedDict()
        # grammar() may be called from a frontend thread (a server checking a spec before
        # it queues the request) while the engine thread adds requests.
        self._lock = threading.Lock()
        self._bitmask = None  # reused across steps, grown on demand: [rows, ceil(vocab / 32)]
        self._batch = None  # xgrammar's BatchGrammarMatcher

    @property
    def backend(self) -> XgrammarBackend:
        """Raises ``ImportError`` naming the extra without xgrammar, ``ValueError`` for a
        model structured output cannot serve (no tokenizer, no EOS)."""
        if self._backend is None:
            import_xgrammar()
            self._backend = XgrammarBackend(self._tokenizer, self.vocab_size, self._stop_ids)
        return self._backend

    # -- requests ------------------------------------------------------------
    def grammar(self, so: "StructuredOutputsParams") -> cf.Future:
        """A future of ``so``'s compiled grammar (failing with ``GrammarCompileError``);
        the compile starts now unless one for an equal spec is done or under way.
        Thread-safe."""
        key = so.cache_key
        with self._lock:
            backend = self.backend
            future = self._cache.get(key)
            if future is not None and not (future.done() and future.exception() is not None):
                self._cache.move_to_end(key)
                return future
            if self._executor is None:
                self._executor = cf.ThreadPoolExecutor(self._max_workers, thread_name_prefix="tandem-grammar")
            future = self._executor.submit(backend.compile, so)
            self._cache[key] = future
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
            return future

    def strategy(self, so: "StructuredOutputsParams", inner) -> StructuredStrategy:
        """The request's strategy: ``inner`` (plain sampling), constrained to ``so``."""
        return StructuredStrategy(self.grammar(so), self.backend.matcher, inner)

    def has_pending(self) -> bool:
        with self._lock:
            return any(not f.done() for f in self._cache.values())

    def wait(self, timeout: float) -> None:
        """Block until a compile under way finishes, or ``timeout`` seconds."""
        with self._lock:
            pending = [f for f in self._cache.values() if not f.done()]
        if pending:
            cf.wait(pending, timeout, return_when=cf.FIRST_COMPLETED)

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    # -- the step ------------------------------------------------------------
    def grammar_bitmask(
        self, sched: SchedulerOutput, groups: Mapping[str, "SequenceGroup"]
    ) -> tuple[GrammarBitmask | None, dict[str, str]]:
        """The step's mask for its structured rows (None when it has none), and the
        requests whose matcher failed to give one, with why (they fail alone)."""
        if self._backend is None:
            return None, {}
        rows, matchers, owners = [], [], []
        row = 0
        for sg in sched.scheduled:
            group = groups.get(sg.request_id)
            strategy = group.strategy if group is not None else None
            if isinstance(strategy, StructuredStrategy):
                for ss in sg.seqs:
                    rows.append(row)  # the worker's row: groups in order, their sequences in order
                    matchers.append(strategy.matchers[ss.seq_id])
                    owners.append(sg.request_id)
                    row += 1
            else:  # a sequence verifying draft tokens has a row per position
                row += sum(ss.num_logits for ss in sg.seqs)
        if not rows:
            return None, {}
        bitmask = self._buffer(row)
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
            rows = [rows[i] for i in keep]
            if not rows:
                return None, failed
        return GrammarBitmask(bitmask, rows), failed

    def _buffer(self, num_rows: int):
        if self._bitmask is None or self._bitmask.shape[0] < num_rows:
            cap = max(num_rows, 2 * (0 if self._bitmask is None else self._bitmask.shape[0]), 8)
            self._bitmask = new_bitmask(cap, self.vocab_size)
            xgr = import_xgrammar()
            if self._batch is None and hasattr(xgr, "BatchGrammarMatcher"):  # xgrammar >= 0.1.26
                self._batch = xgr.BatchGrammarMatcher()  # threads: half the cores
        return self._bitmask[:num_rows]
