"""The in-process executor: one worker, the whole model, in the engine's own process."""

from __future__ import annotations

from tandem.core.executor.base import Executor, WorkerSpec
from tandem.core.executor.rank_worker import RankWorker


class UniProcExecutor(Executor):
    name = None

    def __init__(self, spec: WorkerSpec) -> None:
        super().__init__(spec)
        self.rank_worker = RankWorker(spec, 0, 1)

    def execute_model(self, out, sampling=None):
        return self.rank_worker.worker.execute_model(out, sampling)  # the worker counts its swaps itself

    def collective_rpc(self, method: str, args: tuple = ()) -> list:
        return [getattr(self.rank_worker, method)(*args)]

    def check_health(self) -> None:
        pass  # nothing can die without this process dying with it

    def shutdown(self) -> None:
        pass

    @property
    def worker(self):
        return self.rank_worker.worker

    @property
    def model(self):
        return self.rank_worker.worker.model

    @property
    def kv_caches(self):
        return self.rank_worker.worker.kv_caches

    @property
    def swapped_out_blocks(self) -> int:
        return self.rank_worker.worker.swapped_out_blocks

    @property
    def swapped_in_blocks(self) -> int:
        return self.rank_worker.worker.swapped_in_blocks
