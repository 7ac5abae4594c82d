"""Adapters read off the engine's step, and which of them the workers' CPU caches hold.

A request whose adapter is not in the CPU cache starts its read when it arrives:
:func:`read_lora` (resolve the directory or Hub id, read the safetensors, validate)
runs on a small thread pool in the engine's process, while the engine keeps
stepping the other requests. The scheduler asks :meth:`AdapterLoads.ready` before
it admits a group with an adapter; a group whose adapter is still being read stays
in the waiting queue holding nothing (no blocks, no adapter slot) and the groups
behind it go past (``lora_slots.py`` has the rule).

Mapping the adapter onto the model's layers (and cutting a tensor-parallel rank's
shard) needs the model: with the model in this process (one rank) the same thread
maps it too; otherwise each rank maps its own shard (in memory, no disk) when the
adapter is handed to it. Between steps, on the engine's thread,
:meth:`AdapterLoads.poll` hands each finished read to every worker (the executor's
``add_lora``), into its CPU cache; only moving it into a resident slot is left to the
step that first runs it. A
read or a mapping that fails fails the requests naming that adapter, with
"LoRA adapter 'NAME' (PATH): reason"; a later request with the same id tries again.

The CPU cache: at most ``max_cpu_loras`` adapters held or being read. An adapter
that a live request (waiting, running or swapped) names is pinned: it is never
evicted while such a request waits, so nothing waits on an adapter that is gone.
To make room the least recently used unpinned adapter is evicted; when every cached
adapter is pinned, the new read starts once one is unpinned (the pinned ones are
ready, so their requests run, finish and unpin them).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

from tandem.lora.adapter import Fits, PeftLoRA, read_adapter, why_failed
from tandem.lora.request import LoRARequest
from tandem.lora.source import resolve_adapter

logger = logging.getLogger(__name__)

# Reads that run at once: adapters are small, but a Hub download of one should not
# hold up all the others.
READ_THREADS = 2


def read_lora(req: LoRARequest, max_rank: int, prepare: Callable[[PeftLoRA], Any] | None = None,
              fits: Fits | None = None):
    """Everything about loading ``req``'s adapter that needs no model: find it, read it,
    check it (its shapes against the model by ``fits`` before reading, when given); then
    ``prepare`` (the in-process worker's mapping), when given."""
    adapter = read_adapter(resolve_adapter(req.lora_path), max_rank, fits)
    return adapter if prepare is None else prepare(adapter)


class AdapterLoads:
    """The engine's view of the workers' CPU caches of adapters, and the reads in flight.

    ``workers``: the executor (``collective_rpc("add_lora" | "drop_lora", ...)`` on
    every rank); ``live_ids``: the adapter ids that live requests name (the pins);
    ``prepare``: the in-process worker's mapping of an adapter (None: each rank maps);
    ``fits``: its check of an adapter's shapes from the header (``LoRAManager.fits``)."""

    def __init__(self, workers, *, max_cpu_loras: int, max_rank: int,
                 live_ids: Callable[[], Iterable[int]], prepare: Callable[[PeftLoRA], Any] | None = None,
                 fits: Fits | None = None) -> None:
        self.workers = workers
        self.prepare = prepare
        self.fits = fits
        self.capacity = max(1, max_cpu_loras)
        self.max_rank = max_rank
        self.live_ids = live_ids
        self.cached: OrderedDict[int, None] = OrderedDict()  # in every rank's CPU cache, least recent first
        self.reading: dict[int, tuple[LoRARequest, Future]] = {}
        self.loads = 0  # adapters read (tests and metrics read it)
        # Set when every cached adapter was pinned: pins only come and go with requests
        # between steps, so no scan of the live requests is repeated until the next poll.
        self._full = False
        self._pool: ThreadPoolExecutor | None = None

    def ready(self, req: LoRARequest | None) -> bool:
        """Whether a request with ``req`` may be admitted now: its adapter is in the CPU
        caches (None, the base weights, always is). If not, its read starts when there is room."""
        if req is None:
            return True
        lora_id = req.lora_int_id
        if lora_id in self.cached:
            self.cached.move_to_end(lora_id)
            return True
        if lora_id not in self.reading and self._make_room():
            if self._pool is None:
                self._pool = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="tandem-lora-read")
            self.reading[lora_id] = (req, self._pool.submit(read_lora, req, self.max_rank, self.prepare,
                                                                      self.fits))
        return False

    def _make_room(self) -> bool:
        if len(self.cached) + len(self.reading) < self.capacity:
            return True
        if self._full:
            return False
        live = set(self.live_ids())
        victim = next((i for i in self.cached if i not in live), None)
        if victim is None:
            self._full = True
            return False
        del self.cached[victim]
        self.workers.collective_rpc("drop_lora", (victim,))
        return True

    def poll(self) -> dict[int, str]:
        """Hand every finished read to the workers (on the engine's thread, between
        steps). Returns, per adapter id whose read or mapping failed, why."""
        self._full = False
        failed = {}
        for lora_id, (req, future) in list(self.reading.items()):
            if not future.done():
                continue
            del self.reading[lora_id]
            try:
                adapter = future.result()
            except Exception as e:  # noqa: BLE001 - the adapter's own fault: its requests fail
                failed[lora_id] = why_failed(req, e)
                continue
            self.loads += 1
            # Each rank answers None or why its model cannot take the adapter (the same on every rank).
            why = next((w for w in self.workers.collective_rpc("add_lora", (req, adapter)) if w), None)
            if why is None:
                self.cached[lora_id] = None
            else:
                failed[lora_id] = why_failed(req, why)
        for why in failed.values():
            logger.warning("%s", why)
        return failed

    def has_pending(self) -> bool:
        """Reads not yet handed to the workers (finished ones too: :meth:`poll` has not taken them)."""
        return bool(self.reading)

    def wait(self, timeout: float) -> None:
        """Block until a read finishes, at most ``timeout`` seconds."""
        if self.reading:
            wait([f for _, f in self.reading.values()], timeout=timeout, return_when=FIRST_COMPLETED)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
