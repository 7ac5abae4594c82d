"""The executor: what runs the model for the engine core, in this process or in workers.

The core hands it one ``SchedulerOutput`` (plain data) per step and gets back the
``ModelRunnerOutput`` of tensor-parallel rank 0 (every rank computes the forward
pass; only rank 0 samples). Implementations:

- ``uniproc.UniProcExecutor``: one :class:`~tandem.core.worker.Worker` in this
  process (the default at ``tensor_parallel_size=1``): ``execute_model`` calls the
  worker's, nothing in between.
- ``multiproc.MultiprocExecutor`` (``"mp"``): ``tensor_parallel_size`` worker
  processes on one machine, joined by ``torch.distributed``.
- A Ray executor (``ray_executor.RayExecutor``, registered in ``__init__.py``)
  places the same rank workers (``rank_worker.RankWorker``) as Ray actors; it
  implements :meth:`Executor.collective_rpc`, :meth:`check_health` and
  :meth:`shutdown`, and inherits the rest.

Everything but :meth:`execute_model` goes through :meth:`collective_rpc`: a
method of ``RankWorker`` called on every rank, its answers in rank order.
"""

from __future__ import annotations

import pickle
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from tandem.core.executor.kv_sizing import RankMemory, size_kv_pools
from tandem.core.scheduler_output import ModelRunnerOutput, SamplingInputs, SchedulerOutput


@dataclass(frozen=True)
class WorkerSpec:
    """What every rank builds its worker from (picklable: it crosses to worker
    processes and Ray actors). ``model_cls`` and ``attn_backend`` are classes that
    must be importable by name where the worker runs."""

    config: Any  # EngineConfig
    hf_config: Any  # transformers PretrainedConfig
    model_cls: type
    attn_backend: type
    eos_token_ids: tuple[int, ...]


@dataclass(frozen=True)
class KVPools:
    """The pools every rank allocated: the same block ids on every rank, each holding
    that rank's heads."""

    num_blocks: int
    num_cpu_blocks: int
    block_bytes: int  # one block across the decoder layers, on one rank


class Executor(ABC):
    """Runs steps for the engine core. Lifecycle: construct (starts the workers),
    :meth:`initialize` (loads the model and the KV pools, sized collectively), then
    :meth:`execute_model` per step, :meth:`check_health` whenever, :meth:`shutdown` once."""

    #: ``distributed_executor_backend`` value this executor serves (None: in-process)
    name: str | None = None

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.tp_size: int = spec.config.tensor_parallel_size
        self._swapped = [0, 0]  # blocks swapped out, in
        self.pools: KVPools | None = None

    # -- what an implementation provides ------------------------------------------
    @abstractmethod
    def collective_rpc(self, method: str, args: tuple = ()) -> list[Any]:
        """Call ``RankWorker.<method>(*args)`` on every rank; their answers in rank order.
        A rank that raises makes this raise (its exception, naming the rank)."""
        ...

    @abstractmethod
    def check_health(self) -> None:
        """Raise ``EngineDeadError`` naming the rank and the cause when a worker is gone;
        cheap (no round trip to the workers), so a health endpoint may call it often."""
        ...

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the workers and free their resources; idempotent. No worker process
        outlives it."""
        ...

    # -- the step ------------------------------------------------------------------
    def execute_model(self, out: SchedulerOutput, sampling: SamplingInputs | None = None) -> ModelRunnerOutput | None:
        """Run one step on every rank; rank 0's answer (None when nothing was scheduled).
        ``sampling``: the modes' inputs of sampling, beside the scheduler output.
        A worker that raised or died raises ``EngineDeadError`` naming its rank and cause."""
        self.count_swaps(out)
        return self.collective_rpc("execute_model", (out, sampling))[0]

    def count_swaps(self, out: SchedulerOutput) -> None:
        self._swapped[0] += len(out.blocks_to_swap_out)
        self._swapped[1] += len(out.blocks_to_swap_in)

    @property
    def swapped_out_blocks(self) -> int:
        return self._swapped[0]

    @property
    def swapped_in_blocks(self) -> int:
        return self._swapped[1]

    def lm_head_screen_rows(self) -> tuple[int, int]:
        """(rows whose token the int8 LM-head screen decided, rows that needed their
        whole float32 row) so far, where the worker runs in this process; (0, 0) where
        it does not (its counters stay with the rank)."""
        worker = getattr(self, "worker", None)
        stats = getattr(worker, "screen_stats", None)
        return (0, 0) if stats is None else (stats.rows_screened, stats.rows_full)

    def check_request(self, params) -> None:
        """``ValueError`` naming the field when a request's ``SamplingParams`` cannot reach
        the workers: out of process they are pickled with the step (a ``lambda`` or a
        local function as a logits processor does not pickle). Checked when the request
        is added, so it fails alone; in-process executors accept everything."""
        if self.name is None:
            return
        try:
            pickle.dumps(params, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:  # noqa: BLE001 - pickling raises whatever the object's reduce raises
            what = "SamplingParams.logits_processors" if getattr(params, "logits_processors", None) else "SamplingParams"
            raise ValueError(
                f"{what}: cannot be sent to the worker processes (distributed_executor_backend={self.name!r}): "
                f"{type(e).__name__}: {e}; define processors at module level (a lambda or a local function "
                "does not pickle)"
            ) from e

    # -- start-up ------------------------------------------------------------------
    def initialize(self) -> KVPools:
        """Size the KV pools from every rank's memory (the block count is the least
        any rank can hold), check they fit, load the model, allocate the pools."""
        reports: list[RankMemory] = self.collective_rpc("memory_report")
        num_blocks, num_cpu_blocks = size_kv_pools(self.spec.config, self.spec.model_cls, self.spec.hf_config, reports)
        self.collective_rpc("load_model")
        self.collective_rpc("initialize_cache", (num_blocks, num_cpu_blocks))
        self.pools = KVPools(num_blocks, num_cpu_blocks, max(r.block_bytes for r in reports))
        return self.pools

    def describe(self) -> dict[str, str]:
        """Rank 0's start-up facts (linear kernels, host malloc) for the engine's log line."""
        return self.collective_rpc("describe")[0]

    # -- what only an in-process executor has ---------------------------------------
    @property
    def worker(self):
        """The in-process worker, or None when the ranks run elsewhere."""
        return None

    @property
    def model(self):
        # A ValueError: what asks for it (Whisper's word timestamps recompute attention on
        # the model between steps) is refused per request, the engine serves on.
        raise ValueError(
            f"the model runs in {self.tp_size} worker process(es) (distributed_executor_backend={self.name!r}), "
            "not in this process; this needs the in-process executor (tensor_parallel_size=1, "
            "distributed_executor_backend=None)"
        )

    @property
    def kv_caches(self):
        raise RuntimeError(
            f"the KV pool lives in the worker processes (distributed_executor_backend={self.name!r}), not in this one"
        )
