"""Data parallelism for ``LLM.generate``: engine replicas in processes of their own.

``LLM(model, data_parallel_size=N)`` builds N whole engines on one checkpoint: the
``LLM``'s own (replica 0, in the caller's process, which every other ``LLM`` method
uses) and N - 1 in processes of their own (:class:`ReplicaPool`; their side is
``replica_proc.py``). ``generate`` deals its prompts out (:func:`serve_call`) and
each replica serves its share as one engine does, concurrently with the others;
outputs come back in prompt order. The torch threads are split between them
(``threads_each``; replica 0's for the length of the call only), so each replica's
small ops run on a core of their own instead of every op being split over all of
them: where a step's arithmetic is small (a small model, a CPU with few cores), N
engines of one thread each serve more than one engine of N threads (CTranslate2's
``inter_threads`` is the same idea). Each replica keeps its own KV pool, so the
memory they take is N times one engine's.

Faults stay per request and per replica: a prompt a replica refuses comes back with
``error`` set, as ``generate`` always does; a replica process that dies (killed, out
of memory) answers each of its unfinished prompts with an output whose ``error``
names it and how it died, and is not used again; the other replicas go on. Replicas
never outlive the ``LLM``'s process (each watches its parent) and are stopped when
it shuts down.

The protocol: pickled tuples over a socket pair. To a replica: first ``(rank, model,
engine_args, threads)``, then ``("add", [(request id, prompt, params, lora), ...])``,
``("abort", ())``, ``("stats", ())``, ``("shutdown", ())``. From it: ``("ready", pid)``
or ``("error", ...)`` once built, ``("outputs", [RequestOutput, ...], stats)`` after
each step that finished requests (and for requests it refused), with its
``get_stats()`` as of then, ``("aborted", ())`` and
``("stats", dict)`` in answer.
"""

from __future__ import annotations

import itertools
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
import weakref
from collections import deque
from multiprocessing.connection import Connection, wait
from pathlib import Path

from tandem.core.executor.worker_proc import send
from tandem.core.faults import EngineDeadError
from tandem.core.outputs import RequestOutput, rejected_output

logger = logging.getLogger(__name__)
_PROTOCOL = pickle.HIGHEST_PROTOCOL
_START_TIMEOUT_S = 600.0  # a replica loads the checkpoint (and may build its C++ ops once)
_GRACE_S = 5.0


def check_size(data_parallel_size) -> int:
    if isinstance(data_parallel_size, bool) or not isinstance(data_parallel_size, int) or data_parallel_size < 1:
        raise ValueError(f"data_parallel_size={data_parallel_size!r}: must be an integer >= 1 (engine replicas)")
    return data_parallel_size


def threads_each(total: int, size: int) -> int:
    """Torch threads per replica: the threads there are, shared out (at least one)."""
    return max(1, total // size)


# Ratios among the counters: (numerator, denominator, added), recomputed from the replicas' sums.
_RATIOS = {
    "prefix_cache_hit_rate": ("prefix_cache_hit_tokens", "prefix_cache_queried_tokens", 0),
    "spec_acceptance_rate": ("spec_accepted_tokens", "spec_draft_tokens", 0),
    "spec_mean_accepted_length": ("spec_accepted_tokens", "spec_verify_steps", 1),
}


def combined_stats(each: list[dict]) -> dict:
    """The replicas' ``get_stats()`` as one engine's: counters summed, the known ratios
    recomputed from the sums, any other float the replicas' mean."""
    out: dict = {}
    for name in each[0]:
        values = [s.get(name, 0) for s in each]
        out[name] = sum(values) if all(isinstance(v, int) for v in values) else sum(values) / len(values)
    for name, (num, den, added) in _RATIOS.items():
        if name in out and den in out:
            out[name] = added + out[num] / out[den] if out[den] else 0.0
    return out


def _picklable(items: list) -> tuple[list, list]:
    """``(those that do not pickle, those that do)``."""
    stay, go = [], []
    for item in items:
        try:
            pickle.dumps(item, protocol=_PROTOCOL)
        except Exception:  # noqa: BLE001 - whatever pickling raises, the item stays here
            stay.append(item)
        else:
            go.append(item)
    return stay, go


class _Replica:
    def __init__(self, rank: int, proc: subprocess.Popen, conn: Connection, life_fd: int) -> None:
        self.rank, self.proc, self.conn, self.life_fd = rank, proc, conn, life_fd
        self.dead: str | None = None  # why it is no longer used


def _exit_cause(proc: subprocess.Popen) -> str:
    try:
        code = proc.wait(0.5)
    except subprocess.TimeoutExpired:
        return "stopped answering"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _stop(replicas: list[_Replica]) -> None:
    for r in replicas:
        send(r.conn, ("shutdown", ()))
    deadline = time.monotonic() + _GRACE_S
    for r in replicas:
        try:
            r.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            r.proc.kill()
            r.proc.wait()
        r.conn.close()
        try:
            os.close(r.life_fd)
        except OSError:
            pass


def _spawn(rank: int, threads: int) -> _Replica:
    """A fresh interpreter running ``replica_main`` (not ``multiprocessing``'s spawn, which
    re-imports the caller's ``__main__``: a script without an ``if __name__ ==
    "__main__"`` guard would build its ``LLM`` again in every replica)."""
    ours, theirs = socket.socketpair()
    life_r, life_w = os.pipe()
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(threads)
    root = str(Path(__file__).resolve().parents[2])  # where ``tandem`` is imported from here
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    code = f"from tandem.entrypoints.replica_proc import replica_main; replica_main({theirs.fileno()}, {life_r})"
    try:
        proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=(theirs.fileno(), life_r), env=env)
    finally:
        theirs.close()
        os.close(life_r)
    return _Replica(rank, proc, Connection(ours.detach()), life_w)


class ReplicaPool:
    """Replicas 1 .. ``size - 1``, each an ``LLM`` of ``model`` / ``engine_args`` in a
    process of its own with ``threads`` torch threads, replica r's engine seed ``seed ^ r``.
    Construction starts them; :meth:`wait_ready` waits until each has built its engine and
    raises what one raised building it."""

    def __init__(self, model: str, engine_args: dict, size: int, threads: int, seed: int) -> None:
        self.replicas: list[_Replica] = []
        self.last_stats: dict[int, dict] = {}  # rank -> its counters as its last outputs came
        self._finalizer = weakref.finalize(self, _stop, self.replicas)
        for rank in range(1, size):
            # Each replica's own random stream for requests without a seed (equal streams would
            # draw equal samples for equal prompts served at the same step on two replicas).
            args = {**engine_args, "seed": seed ^ rank}
            try:
                first = pickle.dumps((rank, model, args, threads), protocol=_PROTOCOL)
            except Exception as e:  # noqa: BLE001 - an option another process cannot be given
                bad = [k for k, v in args.items() if not _picklable([v])[1]]
                self.shutdown()
                raise ValueError(f"data_parallel_size > 1: the engine option(s) {', '.join(map(repr, bad))} cannot be "
                                 f"sent to a replica's process ({type(e).__name__}: {e})") from None
            r = _spawn(rank, threads)
            self.replicas.append(r)
            try:
                r.conn.send_bytes(first)
            except (OSError, EOFError):
                pass  # it died at once: wait_ready says how

    def wait_ready(self) -> None:
        deadline = time.monotonic() + _START_TIMEOUT_S
        for r in self.replicas:
            if not r.conn.poll(max(0.0, deadline - time.monotonic())):
                self.shutdown()
                raise RuntimeError(f"engine replica {r.rank} failed to start: did not start in time")
            try:
                msg = pickle.loads(r.conn.recv_bytes())
            except (EOFError, OSError):
                cause = _exit_cause(r.proc)
                self.shutdown()
                raise RuntimeError(f"engine replica {r.rank} failed to start: {cause}") from None
            if msg[0] == "error":
                self.shutdown()
                _, what, exc, tb = msg
                if isinstance(exc, Exception):
                    raise exc
                raise RuntimeError(f"engine replica {r.rank} failed to start: {what}\n{tb}")

    def live(self) -> list[_Replica]:
        return [r for r in self.replicas if r.dead is None]

    def add(self, r: _Replica, items: list) -> list:
        """Give replica ``r`` requests: ``[(request id, prompt, params, lora), ...]``.
        Returns those that cannot travel to another process (params holding a user logits
        processor that does not pickle, say), for this process's engine to serve."""
        try:
            data = pickle.dumps(("add", items), protocol=_PROTOCOL)
        except Exception:  # noqa: BLE001 - one of them does not pickle: find which, send the rest
            kept, items = _picklable(items)
            data = pickle.dumps(("add", items), protocol=_PROTOCOL)
        else:
            kept = []
        try:
            r.conn.send_bytes(data)
        except (OSError, EOFError):
            self._declare_dead(r)
        return kept

    def poll(self, timeout: float | None) -> tuple[list[tuple[int, RequestOutput]], dict[int, str]]:
        """What the live replicas sent: ``(rank, output)`` pairs, waiting up to ``timeout``
        for the first (None: until one comes, 0: not at all), and the replicas found dead
        (``rank -> why``)."""
        outs: list[tuple[int, RequestOutput]] = []
        dead: dict[int, str] = {}
        by_conn = {r.conn: r for r in self.live()}
        # A replica that dies closes its end of the connection: it reads EOF after what it sent.
        for conn in wait(list(by_conn), timeout=timeout) if by_conn else []:
            r = by_conn[conn]
            try:
                while conn.poll():
                    kind, body, *rest = pickle.loads(conn.recv_bytes())
                    if kind == "outputs":
                        outs.extend((r.rank, o) for o in body)
                        self.last_stats[r.rank] = rest[0]
            except (EOFError, OSError):
                dead[r.rank] = self._declare_dead(r)
        return outs, dead

    def _declare_dead(self, r: _Replica) -> str:
        if r.dead is None:
            r.dead = f"engine replica {r.rank} (pid {r.proc.pid}) died: {_exit_cause(r.proc)}"
            r.conn.close()
            logger.error("%s; its unfinished prompts are answered with that error and it is not used again", r.dead)
        return r.dead

    def abort(self) -> None:
        """Abort every replica's requests; what they sent before is dropped."""
        asked = [r for r in self.live() if send(r.conn, ("abort", ()))]
        for r in asked:
            try:
                while r.conn.poll(_GRACE_S):
                    if pickle.loads(r.conn.recv_bytes())[0] == "aborted":
                        break
                else:
                    self._declare_dead(r)  # no answer: it is stuck, not used again
            except (EOFError, OSError):
                self._declare_dead(r)

    def stats(self, ask: bool) -> list[dict]:
        """The live replicas' counters: asked for now (``ask``: no call is being served,
        so nothing else reads their connections), else as their last outputs brought them."""
        for r in self.live() if ask else []:
            try:
                if send(r.conn, ("stats", ())) and r.conn.poll(_GRACE_S):
                    kind, body = pickle.loads(r.conn.recv_bytes())
                    if kind == "stats":
                        self.last_stats[r.rank] = body
            except (EOFError, OSError):
                self._declare_dead(r)
        return [self.last_stats[r.rank] for r in self.live() if r.rank in self.last_stats]

    def shutdown(self) -> None:
        self._finalizer()


def serve_call(pool: ReplicaPool, engine, items: list, window: int, on_output) -> None:
    """Serve one ``generate`` call's ``items`` (``(request id, prompt, params, lora)``)
    on replica 0 (``engine``, stepped here) and the pool's live replicas, calling
    ``on_output(output)`` for each finished request, a refused or lost one included.

    The first items are dealt out in turn (item i to replica i mod N), as many as the
    replicas hold at once (``window`` requests each) or an equal share of all; the rest
    wait here and each replica is topped up as its requests finish, so a replica that
    runs slower (a loaded core) is given less. A replica that dies answers its
    unfinished requests with an error output naming it."""
    pending = deque(items)
    replicas = {r.rank: r for r in pool.live()}
    ranks = [0, *replicas]
    held: dict[int, dict[str, tuple]] = {rank: {} for rank in ranks}  # rank -> its unfinished requests
    refill = max(1, window // 8)  # top up in batches, not a message per finished request

    def give(rank: int, batch: list) -> None:
        for rid, prompt, params, _ in batch:
            held[rank][rid] = (prompt, params)
        if rank:
            stay = pool.add(replicas[rank], batch)
            if not stay:
                return
            for rid, *_ in stay:  # they cannot leave this process: its engine serves them
                del held[rank][rid]
            rank, batch = 0, stay
            for rid, prompt, params, _ in batch:
                held[0][rid] = (prompt, params)
        with engine.core.adding():
            for rid, prompt, params, lora in batch:
                try:
                    engine.add_request(rid, prompt, params, lora_request=lora)
                except EngineDeadError:
                    raise
                except Exception as e:  # noqa: BLE001 - this prompt alone cannot be served
                    del held[0][rid]
                    on_output(rejected_output(rid, prompt, e, params))

    first = min(window, -(-len(pending) // len(ranks)))
    deal: dict[int, list] = {rank: [] for rank in ranks}
    for i in range(min(len(pending), first * len(ranks))):
        deal[ranks[i % len(ranks)]].append(pending.popleft())
    for rank, batch in deal.items():
        if batch:
            give(rank, batch)

    def lost(rank: int, error: Exception) -> None:
        for rid, (prompt, params) in held[rank].items():
            on_output(rejected_output(rid, prompt, error, params))
        held[rank].clear()
        if rank:
            ranks.remove(rank)

    while pending or any(held.values()):
        for rank in ranks:
            room = window - len(held[rank])
            if pending and room >= min(refill, len(pending)):
                give(rank, [pending.popleft() for _ in range(min(room, len(pending)))])
        for rank in [r for r in ranks[1:] if replicas[r].dead is not None]:  # found dead while given work
            lost(rank, EngineDeadError(replicas[rank].dead))
        stepping = engine.has_unfinished_requests()
        finished = [(0, o) for o in engine.step()] if stepping else []
        if not stepping and held[0]:  # never left without an answer, even by an engine fault
            lost(0, RuntimeError("the engine ended the request without an output"))
        if not stepping and not any(held[r] for r in ranks[1:]):
            continue  # nothing out there: what is left goes to replica 0
        got, dead = pool.poll(0 if stepping else None)
        for rank, out in itertools.chain(finished, got):
            if out.finished and held[rank].pop(out.request_id, None) is not None:
                on_output(out)
        for rank, why in dead.items():
            lost(rank, EngineDeadError(why))
