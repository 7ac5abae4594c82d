"""The ``mp`` executor: ``tensor_parallel_size`` worker processes on this machine.

Each rank is a spawned process (``worker_proc.worker_main``) joined to the others
by ``torch.distributed`` (gloo on CPU, NCCL on CUDA) and to the driver by a pipe.
The scheduler stays in the driver; each step's ``SchedulerOutput`` is pickled
once and its bytes written to every rank's pipe (``benchmarks/broadcast.py``
measures this against a shared-memory ring and ``broadcast_object_list``; see
``docs/distributed.md``). Rank 0 answers with the ``ModelRunnerOutput``.

Liveness: the driver waits on the ranks' pipes *and* their process sentinels,
so a rank that raises (it reports, then exits) or dies (killed, out of memory)
makes the step raise ``EngineDeadError`` naming the rank and the cause at once,
never a hang. The workers are stopped on :meth:`shutdown`, when the executor is
collected, and at interpreter exit; a driver killed outright leaves none behind
(each worker watches its parent).
"""

from __future__ import annotations

import logging
import multiprocessing
import pickle
import signal
import time
import weakref
from multiprocessing.connection import wait

from tandem.core.executor.base import Executor, WorkerSpec
from tandem.core.executor.rank_worker import free_port
from tandem.core.executor.worker_proc import worker_main
from tandem.core.faults import EngineDeadError
from tandem.core.scheduler_output import ModelRunnerOutput, SamplingInputs, SchedulerOutput

logger = logging.getLogger(__name__)
_PROTOCOL = pickle.HIGHEST_PROTOCOL
# How long shutdown waits for the ranks to leave their process group before killing them.
_GRACE_S = 5.0


def _exit_cause(proc: multiprocessing.Process) -> str:
    proc.join(0.5)
    code = proc.exitcode
    if code is None:
        return "stopped answering"
    if code < 0:
        try:
            return f"died: killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"died: killed by signal {-code}"
    return f"died: exit code {code}"


def _stop(procs: list, conns: list, graceful: list) -> None:
    """Stop every rank: ask them to leave (when ``graceful[0]``), then terminate, then kill."""
    if graceful[0]:
        msg = pickle.dumps(("shutdown", ()), protocol=_PROTOCOL)
        for c in conns:
            try:
                c.send_bytes(msg)
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + _GRACE_S
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(1.0)
        if p.is_alive():
            p.kill()
            p.join(1.0)
    for c in conns:
        c.close()


class MultiprocExecutor(Executor):
    name = "mp"

    def __init__(self, spec: WorkerSpec) -> None:
        super().__init__(spec)
        ctx = multiprocessing.get_context("spawn")
        init_method = f"tcp://127.0.0.1:{free_port()}"
        self._procs: list[multiprocessing.Process] = []
        self._conns = []
        self._dead: EngineDeadError | None = None
        self._graceful = [True]
        for rank in range(self.tp_size):
            mine, theirs = ctx.Pipe(duplex=True)
            proc = ctx.Process(target=worker_main, args=(rank, self.tp_size, init_method, theirs, spec),
                               name=f"tandem-rank{rank}", daemon=True)
            proc.start()
            theirs.close()
            self._procs.append(proc)
            self._conns.append(mine)
        # Runs on shutdown(), when the executor is collected, and at interpreter exit.
        self._finalizer = weakref.finalize(self, _stop, self._procs, self._conns, self._graceful)
        self._sentinels = [p.sentinel for p in self._procs]
        self._rank_of = {c: r for r, c in enumerate(self._conns)}
        self._rank_of.update({s: r for r, s in enumerate(self._sentinels)})
        self.pids = self._collect(range(self.tp_size), "start")  # each rank's pid, once it is ready

    # -- the step --------------------------------------------------------------------
    def execute_model(self, out: SchedulerOutput, sampling: SamplingInputs | None = None) -> ModelRunnerOutput | None:
        self.count_swaps(out)
        self._broadcast(("execute_model", (out, sampling)), "execute_model")
        return self._collect((0,), "execute_model")[0]

    def collective_rpc(self, method: str, args: tuple = ()) -> list:
        self._broadcast((method, args), method)
        return self._collect(range(self.tp_size), method)

    def _broadcast(self, msg, method: str) -> None:
        if self._dead is not None:
            raise self._dead
        data = pickle.dumps(msg, protocol=_PROTOCOL)
        for rank, conn in enumerate(self._conns):
            try:
                conn.send_bytes(data)
            except OSError:
                self._die(rank, _exit_cause(self._procs[rank]), method)

    def _collect(self, ranks, method: str) -> list:
        """Wait for the answers of ``ranks``, watching every rank's pipe and process."""
        pending = set(ranks)
        answers = {}
        waitables = self._conns + self._sentinels
        while pending:
            for obj in wait(waitables):
                rank = self._rank_of[obj]
                if obj is self._sentinels[rank]:
                    if not self._conns[rank].poll():
                        self._die(rank, _exit_cause(self._procs[rank]), method)
                    continue  # its last words are in the pipe: read them first
                try:
                    kind, *rest = pickle.loads(obj.recv_bytes())
                except (EOFError, OSError):
                    self._die(rank, _exit_cause(self._procs[rank]), method)
                if kind == "ok":
                    answers[rank] = rest[0]
                    pending.discard(rank)
                    continue
                cause, exc, tb = rest
                if method in ("execute_model", "start"):
                    self._die(rank, f"raised {cause}", method, tb, exc)
                if method != "call_model":  # a model call fails its caller alone; the ranks serve on
                    self._graceful[0] = False  # a failed start-up step: the engine will not be built
                if exc is not None:
                    exc.add_note(f"(raised by tensor-parallel rank {rank} in {method})")
                    raise exc
                raise RuntimeError(f"tensor-parallel rank {rank} raised in {method}: {cause}\n{tb}")
        return [answers[r] for r in ranks]

    def _die(self, rank: int, cause: str, method: str, tb: str | None = None, exc: BaseException | None = None):
        pid = self._procs[rank].pid
        self._dead = EngineDeadError(
            f"tensor-parallel rank {rank} (pid {pid}, distributed_executor_backend='mp') {cause} during {method}; "
            "the engine is dead: the other ranks were stopped"
        )
        if tb:
            logger.error("tensor-parallel rank %d failed:\n%s", rank, tb)
        self._graceful[0] = False
        self.shutdown()
        raise self._dead from exc

    # -- health and shutdown ------------------------------------------------------------
    def check_health(self) -> None:
        if self._dead is not None:
            raise self._dead
        gone = wait(self._sentinels, timeout=0)
        if gone:
            rank = self._sentinels.index(gone[0])
            self._dead = EngineDeadError(
                f"tensor-parallel rank {rank} (pid {self._procs[rank].pid}, distributed_executor_backend='mp') "
                f"{_exit_cause(self._procs[rank])}; the engine is dead"
            )
            raise self._dead

    def shutdown(self) -> None:
        self._finalizer()
