"""One tensor-parallel rank: joins the process group, builds its worker, answers the executor.

Whatever hosts a rank (a process of the ``mp`` executor, a Ray actor) builds a
:class:`RankWorker` and calls its methods by name: ``memory_report``,
``load_model``, ``initialize_cache``, ``execute_model``, ``call_model``, ``add_lora``,
``drop_lora``, ``describe``, ``shutdown``.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch

from tandem.core.executor.base import WorkerSpec
from tandem.core.executor.kv_sizing import RankMemory
from tandem.core.layers.parallel_state import TensorParallelGroup
from tandem.core.memory import available_bytes
from tandem.core.scheduler_output import ModelRunnerOutput, SamplingInputs, SchedulerOutput
from tandem.core.worker.worker import Worker

# Long enough for the slowest step; a dead peer is found by the driver, not by this.
_COLLECTIVE_TIMEOUT = timedelta(minutes=30)


def rank_device(device: torch.device, local_rank: int) -> torch.device:
    """Rank ``local_rank``'s device on its machine: ``cuda:(base + local_rank)``; CPU is shared."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + local_rank)


def free_port() -> int:
    """A TCP port free on this machine now, for a process group's rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankWorker:
    def __init__(self, spec: WorkerSpec, rank: int, size: int, init_method: str | None = None,
                 local_rank: int | None = None) -> None:
        """``init_method``: the ``torch.distributed`` rendezvous (``tcp://host:port``)
        when ``size > 1``; ``local_rank``: this rank's index on its machine (default
        ``rank``), which picks its GPU."""
        config = spec.config
        self.rank, self.size = rank, size
        if size == 1 and local_rank is None:  # the config's device as given ("cuda": the current one)
            self.device = config.torch_device
        else:
            self.device = rank_device(config.torch_device, rank if local_rank is None else local_rank)
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
        if self.device.type == "cpu" and size > 1 and "OMP_NUM_THREADS" not in os.environ:
            # Ranks on one CPU share its cores: each takes its share, not all of them.
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
        tp = TensorParallelGroup(size, rank)
        if size > 1:
            import torch.distributed as dist

            backend = "nccl" if self.device.type == "cuda" else "gloo"
            dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                                    timeout=_COLLECTIVE_TIMEOUT)
        self.worker = Worker(config, spec.hf_config, spec.model_cls, spec.attn_backend, list(spec.eos_token_ids),
                             tp=tp, device=self.device)

    def memory_report(self) -> RankMemory:
        import psutil

        host_free = int(psutil.virtual_memory().available)
        free = host_free if self.device.type == "cpu" else available_bytes(self.device)
        return RankMemory(self.rank, str(self.device), self.worker.block_bytes, free, socket.gethostname(), host_free)

    def load_model(self) -> None:
        self.worker.load_model()

    def initialize_cache(self, num_blocks: int, num_cpu_blocks: int) -> None:
        self.worker.initialize_cache(num_blocks, num_cpu_blocks)

    def execute_model(self, out: SchedulerOutput, sampling: SamplingInputs | None = None) -> ModelRunnerOutput | None:
        return self.worker.execute_model(out, sampling)

    def call_model(self, method: str, args: tuple):
        """One of the model's declared calls (``tandem/core/model_call.py``), run on this
        rank's shard; rank 0 answers (on the CPU, so it crosses to the driver as is)."""
        from tandem.core.model_call import check_model_call

        check_model_call(self.worker.model_cls, method)
        result = getattr(self.worker.model, method)(*args)
        if self.rank:
            return None
        return result.cpu() if isinstance(result, torch.Tensor) else result

    def add_lora(self, req, adapter) -> str | None:
        """Take a LoRA adapter the engine read (``tandem.lora.loader``) into this rank's CPU
        cache, cut to this rank; None, or why this model cannot take it (it fails only the
        requests naming it, so it is an answer, not an exception)."""
        from tandem.lora.adapter import AdapterError

        try:
            self.worker.lora.add(req, adapter)
        except AdapterError as e:
            return str(e)
        except Exception as e:  # noqa: BLE001 - the adapter's tensors against this model: its requests fail
            return f"{type(e).__name__}: {e}"
        return None

    def drop_lora(self, lora_id: int) -> None:
        self.worker.lora.drop(lora_id)

    def describe(self) -> dict[str, str]:
        w = self.worker
        return {"linear_kernels": str(getattr(w, "linear_kernels", "")), "host_malloc": str(getattr(w, "host_malloc", ""))}

    def shutdown(self) -> None:
        if self.size > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                # Without the barrier a rank that leaves first closes its gloo pairs while
                # another still reads the last collective's message, which aborts that process.
                dist.barrier()
                dist.destroy_process_group()
