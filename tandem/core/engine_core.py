"""The engine core: scheduler, block manager and worker, one step at a time.

A step is three calls: ``Scheduler.schedule()`` decides what runs (plain data),
``Worker.execute_model()`` runs it (swaps, copies, forward, sampling), and
``Scheduler.update_from_output()`` applies the result through each request's
strategy. The core returns plain per-request results (``core_outputs``) and
keeps no output state: detokenizing, stop strings and ``RequestOutput``s are the
frontend's (``output_processor``). Counters are published as an immutable
snapshot after every change, so other threads read them without touching the
scheduler's live structures.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from operator import attrgetter
from dataclasses import dataclass, fields

from tandem.core.kv.block_manager import BlockManager

from tandem.core.kv.block_pool import Device
from tandem.core.core_outputs import RequestResult
from tandem.core.faults import EngineDeadError, EngineHealth, KVTransferError, StepFaults, describe
from tandem.core.sched.scheduler import Scheduler, SchedulerConfig
from tandem.core.sequence import SequenceGroup
from tandem.core.strategies.modes import Modes
from tandem.core.executor import Executor

logger = logging.getLogger(__name__)
_params = attrgetter("sampling_params")
# How long a step with nothing to run waits for a mode's pending work before it returns.
_PENDING_WAIT_S = 0.05


@dataclass(frozen=True)
class EngineStats:
    """Counters since construction, as of the engine's last step (or add / abort)."""

    encoder_tokens_computed: int = 0
    encoder_tokens_reused: int = 0
    # Admissions that ran the encoder, and those that did not: they shared a live
    # request's cross table or took one the encoder cache kept (a hit; a miss is a run).
    encoder_runs: int = 0
    encoder_runs_saved: int = 0
    encoder_cache_hits: int = 0
    encoder_cache_misses: int = 0
    encoder_cache_evictions: int = 0  # kept tables evicted
    encoder_cache_blocks: int = 0  # device blocks kept now (counted in kv_blocks_free)
    # Decoder prompt tokens of admitted sequences looked up in the prefix cache, those
    # found there (not computed), their ratio, blocks evicted and blocks kept now.
    prefix_cache_queried_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    prefix_cache_hit_rate: float = 0.0
    prefix_cache_evictions: int = 0
    prefix_cache_blocks: int = 0  # counted in kv_blocks_free
    num_preemptions: int = 0
    kv_blocks_total: int = 0
    kv_blocks_free: int = 0
    swapped_out_blocks: int = 0
    swapped_in_blocks: int = 0
    num_requests_finished: int = 0
    num_requests_unfinished: int = 0
    num_requests_waiting: int = 0
    num_requests_running: int = 0
    num_requests_swapped: int = 0
    # kv_compress: requests whose cross table was compressed, and the device blocks that freed.
    kv_compress_requests: int = 0
    kv_compress_blocks_freed: int = 0
    # LoRA: distinct adapters among the requests of the last step.
    lora_adapters_running: int = 0
    # The int8 LM-head screen (in-process worker): rows it decided, rows it sent to float32.
    lm_head_screen_rows: int = 0
    lm_head_screen_full_rows: int = 0
    # The ids of the requests the core holds, and the sampling params of those that
    # wait or are swapped out (an admission limit counts their sequences; params are
    # immutable, so reading them from another thread is safe).
    # The modes' own counters (``Mode.stats``), by name.
    mode_stats: tuple[tuple[str, int | float], ...] = ()
    live_request_ids: frozenset[str] = frozenset()
    queued_params: tuple = ()

    def as_dict(self) -> dict[str, int | float]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.type in ("int", "float")}
        out.update(self.mode_stats)
        return out


class EngineCore:
    def __init__(self, scheduler_config: SchedulerConfig, block_manager: BlockManager, executor: Executor,
                 scheduler: Scheduler, max_consecutive_step_failures: int,
                 modes: Modes | None = None, lora_loads=None) -> None:
        self.scheduler_config = scheduler_config
        self.block_manager = block_manager
        self.executor = executor  # runs the step: the in-process worker, or the ranks' workers
        self.scheduler = scheduler
        # The modes' batch hooks: pending work, the logits transforms passed beside
        # the scheduler output, their counters.
        self.modes = modes if modes is not None else Modes(())
        # LoRA adapters read off the step (tandem.lora.loader.AdapterLoads); None without enable_lora.
        self.lora_loads = lora_loads
        self.faults = StepFaults(max_consecutive_step_failures)
        self.num_requests_finished = 0
        self.stats = EngineStats()
        self._adding = False  # inside adding(): adds publish once, at its end
        self._publish()

    # -- requests ------------------------------------------------------------------
    def add(self, group: SequenceGroup) -> None:
        self.faults.check_alive()
        self.scheduler.add(group)
        if self.lora_loads is not None:
            self.lora_loads.ready(group.lora_request)  # its adapter's read starts now if it must
        if not self._adding:
            self._publish()

    @contextmanager
    def adding(self) -> Iterator[None]:
        """Adds inside publish one snapshot at the end, not one each: a snapshot lists
        every live request, so publishing per add made adding n requests cost n^2
        (``LLM.generate`` over 20,000 prompts). Not to be nested."""
        if self._adding:
            raise RuntimeError("EngineCore.adding() is already open")
        self._adding = True
        try:
            yield
        finally:
            self._adding = False
            self._publish()

    def abort(self, request_ids: set[str]) -> list[RequestResult]:
        """Drop the requests and free their blocks; returns their final (aborted) results."""
        results = self.scheduler.abort(request_ids)
        # No pool check here: an abort may be the cleanup after an error (a step that
        # could not progress), which must reach the caller as it is; the next step checks.
        self._after_change(check_blocks=False)
        return results

    def stop(self, stops: dict[str, dict[int, str]]) -> None:
        """Finish sequences the frontend found a stop string in (request id ->
        completion index -> the stop string), freeing their blocks."""
        for rid, by_index in stops.items():
            if self.scheduler.stop_seqs(rid, by_index):
                self.num_requests_finished += 1
        self._after_change()

    def has_request(self, request_id: str) -> bool:
        return request_id in self.scheduler.groups

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def health(self) -> EngineHealth:
        """The engine's health after its last step (a snapshot other threads may read)."""
        return self.faults.health

    # -- the step --------------------------------------------------------------------
    def step(self) -> list[RequestResult]:
        """Run one scheduled forward pass. Returns the progress of every request that
        advanced, and a final result with ``error`` set for every request that failed
        in it (``tandem/core/faults.py``: a request's own fault fails it alone, a fault
        of the step fails the step's requests, and ``max_consecutive_step_failures``
        failed steps in a row make the engine dead)."""
        self.faults.check_alive()
        lora_failed = self._take_adapters()
        # Before scheduling: pending work that finishes after schedule() passed its
        # request over explains an idle step as well as work still pending (the step
        # takes a round trip to the workers under the mp executor, which widens the window).
        pending = self.modes.has_pending() or self._adapters_pending()
        sched = self.scheduler.schedule()
        # Requests that cannot run (their strategy could not get ready) fail alone.
        cannot_run = self.scheduler.take_failures()
        sampling, no_transform = self.modes.sampling_inputs(sched, self.scheduler.groups)
        cannot_run.update(no_transform)  # their rows run untransformed; their results are dropped
        block_fault = self.scheduler.block_fault
        failed = lora_failed + self.fail(cannot_run, check_blocks=not block_fault)
        if block_fault:
            self._check_pool_after_fault()
        try:
            result = self.executor.execute_model(sched, sampling)
        except Exception as e:  # noqa: BLE001 - the forward, a backend, a KV copy: the step's fault
            return failed + self._step_failed(sched, e)
        if result is None:
            if not (sched.blocks_to_swap_out or sched.blocks_to_swap_in):
                if self._adapters_pending():
                    self.lora_loads.wait(_PENDING_WAIT_S)  # only requests waiting for adapters are left
                elif pending or self.modes.has_pending():
                    self.modes.wait(_PENDING_WAIT_S)  # only requests waiting for it are left to admit
                else:
                    self._no_progress()
            self._publish()
            return failed
        self.faults.step_ok()
        # Per-request faults in the update (a strategy's update) join the worker's.
        results = failed + self.scheduler.update_from_output(sched, result)
        self.num_requests_finished += sum([r.finished for r in results])  # a list: no generator resumed per request
        results += self.fail(result.failed_requests)
        self._after_change()
        return results

    def _take_adapters(self) -> list[RequestResult]:
        """Hand the adapters read since the last step to the workers; the requests
        naming one whose read or mapping failed end with why."""
        if self.lora_loads is None:
            return []
        bad = self.lora_loads.poll()
        if not bad:
            return []
        return self.fail({rid: bad[g.lora_id] for rid, g in self.scheduler.groups.items() if g.lora_id in bad})

    def _adapters_pending(self) -> bool:
        return self.lora_loads is not None and self.lora_loads.has_pending()

    def fail(self, why_by_id: dict[str, str], check_blocks: bool = True) -> list[RequestResult]:
        """End each request with its reason as ``error``, freeing its blocks
        (``check_blocks``: check no block is held once no request is left)."""
        failed = []
        for rid, why in why_by_id.items():
            logger.warning("request %r failed: %s", rid, why)
            for res in self.scheduler.abort({rid}):
                failed.append(RequestResult(rid, res.completions, True, error=why))
                self.num_requests_finished += 1
        if why_by_id:
            self._after_change(check_blocks)
        return failed

    def _step_failed(self, sched, e: Exception) -> list[RequestResult]:
        ids = {g.request_id for g in sched.scheduled}
        if isinstance(e, KVTransferError):  # a swap-out torn part of the way
            ids |= {g.request_id for g in self.scheduler.swapped}
        dead = self.faults.step_failed(e)
        logger.error("a step of %d requests failed (%d in a row%s): %s", len(ids),
                     self.faults.health.consecutive_step_failures, "; the engine is dead" if dead else "",
                     describe(e), exc_info=e)
        failed = self.fail(dict.fromkeys(sorted(ids), f"the step serving it failed: {describe(e)}"))
        # A torn swap or forward may have left a cross table half written that the
        # failed requests' cleanup just kept: keep none.
        self.block_manager.clear_encoder_cache()
        self._publish()
        if dead:
            self.faults.check_alive()  # raises EngineDeadError
        return failed

    def _check_pool_after_fault(self) -> None:
        """The block manager raised while scheduling: its requests failed and were
        freed, but the fault may have left a change half made. Serve on only if the
        pools' accounting still holds; otherwise the engine is dead (a broken pool is
        never repaired silently)."""
        self.scheduler.block_fault = False
        errors = self.block_manager.accounting_errors()
        if errors:
            e = EngineDeadError("KV block accounting is broken after a block manager fault while scheduling: "
                                + "; ".join(errors))
            self.faults.step_failed(e)
            logger.error("%s", e)
            self._publish()
            raise e

    def _after_change(self, check_blocks: bool = True) -> None:
        if not self.scheduler.groups:
            if check_blocks:
                self._check_no_blocks_held()
            self.scheduler.clear()
        self._publish()

    def _check_no_blocks_held(self) -> None:
        """With no request left, every block must be free: a block still held is an
        accounting bug, reported rather than papered over."""
        bm = self.block_manager
        held = {d.value: bm.num_total_blocks(d) - bm.num_free_blocks(d) for d in Device}
        if any(held.values()):
            raise RuntimeError(f"KV block accounting is broken: no request is left but blocks are held ({held})")

    def _publish(self) -> None:
        bm, sch, w = self.block_manager, self.scheduler, self.executor
        compress = sch.cross_compress
        screened, screened_full = w.lm_head_screen_rows()
        self.stats = EngineStats(
            kv_compress_requests=0 if compress is None else compress.num_compressed,
            kv_compress_blocks_freed=0 if compress is None else compress.blocks_freed,
            lora_adapters_running=len(sch.lora_slots.active),
            lm_head_screen_rows=screened,
            lm_head_screen_full_rows=screened_full,
            encoder_tokens_computed=sch.encoder_tokens_computed,
            encoder_tokens_reused=sch.encoder_tokens_reused,
            encoder_runs=bm.encoder_runs,
            encoder_runs_saved=bm.encoder_live_shares + bm.encoder_cache_hits,
            encoder_cache_hits=bm.encoder_cache_hits,
            encoder_cache_misses=bm.encoder_runs,
            encoder_cache_evictions=bm.encoder_cache.evictions,
            encoder_cache_blocks=bm.num_cached_blocks(),
            prefix_cache_queried_tokens=bm.prefix_queried_tokens,
            prefix_cache_hit_tokens=bm.prefix_hit_tokens,
            prefix_cache_hit_rate=bm.prefix_hit_tokens / max(1, bm.prefix_queried_tokens),
            prefix_cache_evictions=bm.prefix_cache.evictions,
            prefix_cache_blocks=bm.num_prefix_cached_blocks(),
            num_preemptions=sch.num_preemptions,
            kv_blocks_total=bm.num_total_blocks(),
            kv_blocks_free=bm.num_free_blocks(),
            swapped_out_blocks=w.swapped_out_blocks,
            swapped_in_blocks=w.swapped_in_blocks,
            num_requests_finished=self.num_requests_finished,
            num_requests_unfinished=sch.num_unfinished(),
            num_requests_waiting=len(sch.waiting),
            num_requests_running=len(sch.running),
            num_requests_swapped=len(sch.swapped),
            mode_stats=tuple(self.modes.stats().items()),
            live_request_ids=frozenset(sch.groups),
            # map + attrgetter: no per-group Python frame on the step's path.
            queued_params=(*map(_params, sch.waiting), *map(_params, sch.swapped)),
        )

    def _no_progress(self) -> None:
        """Requests wait, nothing runs and nothing was admitted: every later step would
        do the same, so say why instead of spinning."""
        sch, bm = self.scheduler, self.block_manager
        if not sch.waiting or sch.running or sch.swapped:
            return
        head = sch.waiting[0]
        raise RuntimeError(
            f"the scheduler cannot admit request {head.request_id!r} although nothing runs: it needs "
            f"{bm.blocks_needed(head)} KV blocks and {head.encoder_len + sum(len(s) for s in head.seqs)} "
            f"tokens; {bm.num_free_blocks()} of {bm.num_total_blocks()} blocks are free "
            f"(watermark {bm.watermark_blocks}), max_num_batched_tokens="
            f"{self.scheduler_config.max_num_batched_tokens}; {len(sch.waiting)} requests wait"
        )
