"""The ``ray`` executor: ``tensor_parallel_size`` ranks as Ray actors, on one node or several.

The ranks are placed with a placement group of one bundle each (``{"GPU": 1}`` on
CUDA, ``{"CPU": 1}`` on CPU), by ``ray_placement_strategy`` (``STRICT_PACK``: one
node; ``PACK`` / ``SPREAD``: across nodes, as vLLM's Ray executor places its
workers). Each actor hosts a :class:`~tandem.core.executor.rank_worker.RankWorker`;
they join one ``torch.distributed`` group (gloo on CPU, NCCL on CUDA) whose
rendezvous is rank 0's node address and a port free there, both asked of rank 0
by the driver. The step protocol is the ``mp`` executor's: the scheduler stays in
the driver; each step's ``SchedulerOutput`` is serialized once (``ray.put``) and
every rank runs it; rank 0 answers with the ``ModelRunnerOutput``.

Liveness: each actor also holds one call that never returns (its *sentinel*, in a
concurrency group of its own); Ray ends it with an error the moment the actor
dies. The driver waits on the step's answers *and* the sentinels, so a rank that
raises or dies makes the step raise ``EngineDeadError`` naming the rank, its
node and the cause, never a hang; :meth:`check_health` polls the sentinels
without a round trip. :meth:`shutdown` (also when the executor is collected and
at interpreter exit) lets the ranks leave their process group, then kills the
actors and removes the placement group. Actors are owned by the driver: Ray
ends them if the driver dies.

Ray is connected to with ``ray.init()`` when this process has not already: a
cluster started with ``ray start`` on this node (or ``RAY_ADDRESS``), else a
local one. Every node reads the checkpoint at the driver's path
(``docs/distributed.md``, "Ray").
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from typing import Any

from tandem.core.executor.base import Executor, WorkerSpec
from tandem.core.faults import EngineDeadError

logger = logging.getLogger(__name__)

# How long the placement group may wait for its resources before start-up fails.
PLACEMENT_TIMEOUT_S = float(os.environ.get("TANDEM_RAY_PLACEMENT_TIMEOUT_S", "120"))
# How long shutdown waits for the ranks to leave their process group before killing them.
_GRACE_S = 5.0
# How long a rank's failure waits for news of another rank's death (which it may be the echo of).
_BLAME_WAIT_S = 2.0


class _RankActor:
    """One rank in a Ray actor (made remote in :func:`_actor_class`)."""

    def __init__(self) -> None:
        self.rank_worker = None
        self.rank = -1
        self._never = threading.Event()

    def rendezvous(self) -> tuple[str, int]:
        """This node's address and a TCP port free on it, for the process group."""
        import socket

        import ray

        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            return ray.util.get_node_ip_address(), s.getsockname()[1]

    def start(self, spec: WorkerSpec, rank: int, size: int, init_method: str) -> dict[str, Any]:
        import socket

        from tandem.core.executor.rank_worker import RankWorker

        # On CUDA Ray shows each actor only its own GPU: it is device 0 here.
        self.rank = rank
        self.rank_worker = RankWorker(spec, rank, size, init_method, local_rank=0)
        return {"pid": os.getpid(), "host": socket.gethostname()}

    def call(self, method: str, args: tuple) -> Any:
        return getattr(self.rank_worker, method)(*args)

    def execute_model(self, out, sampling=None):
        result = self.rank_worker.execute_model(out, sampling)
        return result if self.rank == 0 else None  # only rank 0 samples

    def sentinel(self) -> None:
        """Never returns: while the actor lives this call is pending; Ray ends it with the actor."""
        self._never.wait()


def _actor_class():
    import ray

    return ray.remote(concurrency_groups={"sentinel": 1})(_RankActor)


def _describe_failure(e: BaseException) -> tuple[str, BaseException | None]:
    """(the cause in a few words, the rank's own exception when it raised one)."""
    import ray.exceptions as rex

    if isinstance(e, rex.RayTaskError):
        cause = e.cause if isinstance(getattr(e, "cause", None), BaseException) else None
        if cause is not None:
            return f"raised {type(cause).__name__}: {cause}", cause
        return f"raised: {str(e).splitlines()[0]}", None
    if isinstance(e, rex.RayActorError):
        first = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
        return f"died ({first})", None
    return f"failed: {type(e).__name__}: {e}", None


def _check_reserved(pg, size: int, bundle: dict) -> None:
    """The current placement group holds a bundle with ``bundle``'s resources for every rank."""
    specs = pg.bundle_specs
    (key, need), = bundle.items()
    if len(specs) < size or any(b.get(key, 0) < need for b in specs[:size]):
        raise ValueError(
            f"tensor_parallel_size={size} with distributed_executor_backend='ray' inside a placement group: its "
            f"first {size} bundles must each hold {bundle} (one per rank), got {specs}"
        )


def _stop(state: dict) -> None:
    """Stop every rank: ask them to leave (when graceful), then kill them; remove the group."""
    import ray

    actors, pg = state.pop("actors", []), state.pop("pg", None)
    if not ray.is_initialized():
        return
    if actors and state.get("graceful"):
        try:
            ray.wait([a.call.remote("shutdown", ()) for a in actors], num_returns=len(actors), timeout=_GRACE_S)
        except Exception:  # noqa: BLE001 - the kill below ends them anyway
            pass
    for a in actors:
        try:
            ray.kill(a, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass
    if pg is not None:
        try:
            ray.util.remove_placement_group(pg)
        except Exception:  # noqa: BLE001 - already removed (the cluster is going away)
            pass


class RayExecutor(Executor):
    name = "ray"

    def __init__(self, spec: WorkerSpec) -> None:
        super().__init__(spec)
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        config = spec.config
        device = config.torch_device
        if device.type == "cuda" and device.index not in (None, 0):
            raise ValueError(f"device={config.device!r}: with distributed_executor_backend='ray' each rank gets the "
                             "GPU Ray assigns it; use device='cuda'")
        if not ray.is_initialized():
            ray.init()
        self._dead: EngineDeadError | None = None
        self._state: dict[str, Any] = {"graceful": True}
        self._finalizer = weakref.finalize(self, _stop, self._state)
        try:
            self._start(ray, PlacementGroupSchedulingStrategy, spec, device.type == "cuda")
        except BaseException:
            self._state["graceful"] = False
            self.shutdown()
            raise

    def _start(self, ray, strategy_cls, spec: WorkerSpec, cuda: bool) -> None:
        size = self.tp_size
        bundle = {"GPU": 1.0} if cuda else {"CPU": 1.0}
        pg = ray.util.get_current_placement_group()
        if pg is not None:  # reserved for us (a Serve replica's placement_group_bundles): rank i takes bundle i
            _check_reserved(pg, size, bundle)
            placed = "in this actor's placement group"
        else:
            pg = self._placement_group(ray, size, bundle, spec.config.ray_placement_strategy)
            placed = spec.config.ray_placement_strategy
        actor_cls = _actor_class()
        self._actors = [
            actor_cls.options(
                num_cpus=0 if cuda else 1, num_gpus=1 if cuda else 0, max_restarts=0,
                name=None, scheduling_strategy=strategy_cls(placement_group=pg, placement_group_bundle_index=rank),
            ).remote()
            for rank in range(size)
        ]
        self._state["actors"] = self._actors
        self._sentinels = [a.sentinel.options(concurrency_group="sentinel").remote() for a in self._actors]
        self._rank_of = {s: r for r, s in enumerate(self._sentinels)}
        host, port = self._gather([self._actors[0].rendezvous.remote()], "rendezvous", ranks=[0])[0]
        init_method = f"tcp://{host}:{port}"
        starts = [a.start.remote(spec, rank, size, init_method) for rank, a in enumerate(self._actors)]
        self.ranks = self._gather(starts, "start")  # each rank's pid and host, once it is ready
        self.pids = [r["pid"] for r in self.ranks]
        logger.info("Ray executor: %d rank(s), placed %s, rendezvous %s, on %s", size, placed, init_method,
                    ", ".join(f"rank {i} pid {r['pid']}@{r['host']}" for i, r in enumerate(self.ranks)))

    def _placement_group(self, ray, size: int, bundle: dict, strategy: str):
        pg = ray.util.placement_group([dict(bundle) for _ in range(size)], strategy=strategy,
                                      name=f"tandem-tp{size}-{os.getpid()}-{id(self):x}")
        self._state["pg"] = pg  # ours: removed on shutdown
        ready, _ = ray.wait([pg.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            raise RuntimeError(
                f"tensor_parallel_size={size} with distributed_executor_backend='ray' needs {size} bundles of "
                f"{bundle} placed {strategy}; the Ray cluster could not place them in {PLACEMENT_TIMEOUT_S:.0f} s "
                f"(its resources: {ray.cluster_resources()}, free now: {ray.available_resources()})"
                + ("; ray_placement_strategy='PACK' or 'SPREAD' lets the ranks span nodes"
                   if strategy == "STRICT_PACK" else "")
            )
        return pg

    # -- the step --------------------------------------------------------------------
    def execute_model(self, out, sampling=None):
        import ray

        self.count_swaps(out)
        if self._dead is not None:
            raise self._dead
        ref = ray.put(out)  # serialized once, read by every rank
        return self._gather([a.execute_model.remote(ref, sampling) for a in self._actors], "execute_model")[0]

    def collective_rpc(self, method: str, args: tuple = ()) -> list:
        if self._dead is not None:
            raise self._dead
        return self._gather([a.call.remote(method, args) for a in self._actors], method)

    def _gather(self, refs: list, method: str, ranks: list[int] | None = None) -> list:
        """The answers of ``refs`` (rank ``ranks[i]``'s call each), watching every rank's sentinel."""
        import ray

        ranks = list(range(len(refs))) if ranks is None else ranks
        rank_of = {ref: r for ref, r in zip(refs, ranks)}
        answers: dict[int, Any] = {}
        pending = list(refs)
        while pending:
            ready, _ = ray.wait(pending + self._sentinels, num_returns=1)
            obj = ready[0]
            if obj in self._rank_of:  # a sentinel ended: that actor is gone
                self._die(self._rank_of[obj], self._sentinel_cause(obj), method)
            rank = rank_of[obj]
            pending.remove(obj)
            try:
                answers[rank] = ray.get(obj)
            except Exception as e:  # noqa: BLE001 - the rank raised or died
                cause, exc = _describe_failure(e)
                if method in ("execute_model", "start", "rendezvous") or exc is None:
                    # A peer's death reaches the others as a failed collective, often before
                    # Ray reports the death itself: blame the rank that died, if one did.
                    gone, _ = ray.wait(self._sentinels, num_returns=1, timeout=_BLAME_WAIT_S)
                    if gone and self._rank_of[gone[0]] != rank:
                        dead = self._rank_of[gone[0]]
                        self._die(dead, f"{self._sentinel_cause(gone[0])}; rank {rank} then {cause}", method, exc)
                    self._die(rank, cause, method, exc)
                self._state["graceful"] = False  # a failed start-up step: the engine will not be built
                exc.add_note(f"(raised by tensor-parallel rank {rank} in {method}, distributed_executor_backend='ray')")
                raise exc from None
        return [answers[r] for r in ranks]

    def _where(self, rank: int) -> str:
        ranks = getattr(self, "ranks", None)
        if ranks:
            return f"pid {ranks[rank]['pid']} on {ranks[rank]['host']}"
        return f"actor {self._actors[rank]._actor_id.hex()[:12]}"

    def _die(self, rank: int, cause: str, method: str | None, exc: BaseException | None = None):
        """Declare the engine dead of rank ``rank``'s failure, stop the other ranks, raise."""
        during = f" during {method}" if method else ""
        self._dead = EngineDeadError(
            f"tensor-parallel rank {rank} ({self._where(rank)}, distributed_executor_backend='ray') {cause}{during}; "
            "the engine is dead: the other ranks were stopped"
        )
        self._state["graceful"] = False
        self.shutdown()
        raise self._dead from exc

    def _sentinel_cause(self, sentinel) -> str:
        import ray

        try:
            ray.get(sentinel)
            return "stopped"
        except Exception as e:  # noqa: BLE001 - how it ended is the cause
            return _describe_failure(e)[0]

    # -- health and shutdown ------------------------------------------------------------
    def check_health(self) -> None:
        import ray

        if self._dead is not None:
            raise self._dead
        gone, _ = ray.wait(self._sentinels, num_returns=1, timeout=0)
        if gone:
            self._die(self._rank_of[gone[0]], self._sentinel_cause(gone[0]), None)

    def shutdown(self) -> None:
        self._finalizer()
