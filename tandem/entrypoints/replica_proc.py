"""The body of an engine replica's process (``LLM(data_parallel_size=N)``; the parent's
side and the protocol are in ``replicas.py``): an ``LLM`` that adds what the parent
sends whenever it sends it, steps while anything is unfinished, and sends each
step's finished outputs back."""

from __future__ import annotations

import gc
import os
import pickle
import signal
import threading
from multiprocessing.connection import Connection

from tandem.core.executor.worker_proc import error_message, send
from tandem.core.faults import EngineDeadError
from tandem.core.outputs import rejected_output


def _watch_parent(life_fd: int) -> None:
    """End this process the moment the parent is gone: the parent holds the write end of
    the ``life_fd`` pipe, which reads EOF only once it has exited (however it exited)."""

    def watch() -> None:
        try:
            os.read(life_fd, 1)
        finally:
            os._exit(1)

    threading.Thread(target=watch, name="tandem-parent-watch", daemon=True).start()


def replica_main(conn_fd: int, life_fd: int) -> None:
    """The body of a replica's process: an ``LLM`` serving the parent's connection. The
    first message is ``(rank, model, engine_args, threads)``."""

    _watch_parent(life_fd)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: the parent aborts and stops us
    conn = Connection(conn_fd)
    try:
        rank, model, engine_args, threads = pickle.loads(conn.recv_bytes())
    except (EOFError, OSError):
        return
    import torch

    torch.set_num_threads(threads)
    from tandem.entrypoints.llm import LLM

    try:
        llm = LLM(model, **engine_args)
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises it
        send(conn, error_message(e))
        return
    # This process lives for its engine: what is alive now stays, out of the collector's way
    # (a full collection walked it all; docs/performance.md, issue 49).
    gc.collect()
    gc.freeze()
    if not send(conn, ("ready", os.getpid())):
        return
    _serve(llm, conn)


def _serve(llm, conn: Connection) -> None:
    """Add what the parent sends whenever it sends it, step while anything is unfinished,
    and send each step's finished outputs (with the engine's counters as they are then)."""
    engine = llm.llm_engine
    live: set[str] = set()
    while True:
        # Block for the parent while idle; between steps only read what is there already.
        while not live or conn.poll():
            try:
                kind, body = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                return
            if kind == "shutdown":
                os._exit(0)  # nothing here is worth tearing down piece by piece: the parent waits
            reply = None
            if kind == "add":
                refused = []
                with engine.core.adding():
                    for rid, prompt, params, lora in body:
                        try:
                            engine.add_request(rid, prompt, params, lora_request=lora)
                            live.add(rid)
                        except EngineDeadError:
                            raise
                        except Exception as e:  # noqa: BLE001 - this prompt alone cannot be served
                            refused.append(rejected_output(rid, prompt, e, params))
                reply = ("outputs", refused, llm.get_stats()) if refused else None
            elif kind == "abort":  # the call ended early (an exception or Ctrl-C in the parent)
                engine.abort_request(sorted(live))
                live.clear()
                reply = ("aborted", ())
            elif kind == "stats":
                reply = ("stats", llm.get_stats())
            if reply is not None and not send(conn, reply):
                return
        outs = engine.step()
        if outs:
            live.difference_update(o.request_id for o in outs if o.finished)
            if not send(conn, ("outputs", outs, llm.get_stats())):
                return
