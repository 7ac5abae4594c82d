"""The body of one ``mp`` worker process: a :class:`RankWorker` serving the driver's pipe.

Messages are pickled once by the driver and sent as bytes: ``(method, args)``
in, ``("ok", result)`` or ``("error", ...)`` out. For ``execute_model`` only
rank 0 answers (with the step's ``ModelRunnerOutput``); another rank writes only
when it fails. A worker that fails a step exits: its peers' collectives are out
of step, and the driver declares the engine dead.

The worker never outlives the driver: a watchdog thread waits on the parent's
sentinel and ends the process the moment the driver is gone, even mid-step or
inside a collective (the driver killed by ``SIGTERM`` / ``SIGKILL`` runs no
clean-up of its own).
"""

from __future__ import annotations

import os
import pickle
import signal
import threading
import traceback
from multiprocessing import parent_process
from multiprocessing.connection import Connection, wait

from tandem.core.executor.base import WorkerSpec


def _watch_parent() -> None:
    parent = parent_process()
    if parent is None:
        return

    def watch() -> None:
        wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="tandem-parent-watch", daemon=True).start()


def error_message(e: BaseException) -> tuple:
    """``("error", cause, exception or None, traceback)``: the exception itself when it
    pickles (so the driver can re-raise its type), its description always."""
    tb = "".join(traceback.format_exception(e))
    try:
        exc = pickle.loads(pickle.dumps(e))
    except Exception:  # noqa: BLE001 - an exception type that does not survive pickling
        exc = None
    return ("error", f"{type(e).__name__}: {e}", exc, tb)


def send(conn: Connection, msg) -> bool:
    """Write ``msg`` pickled, as bytes; False when the other end is gone (also the
    engine replicas' messages: ``tandem/entrypoints/replicas.py``)."""
    try:
        conn.send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))
        return True
    except (OSError, EOFError):  # the driver is gone
        return False


def worker_main(rank: int, size: int, init_method: str, conn: Connection, spec: WorkerSpec) -> None:
    _watch_parent()
    # Ctrl-C reaches the whole process group: the driver handles it and stops the workers.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from tandem.core.executor.rank_worker import RankWorker

    try:
        worker = RankWorker(spec, rank, size, init_method)
    except BaseException as e:  # noqa: BLE001 - reported to the driver, which raises it
        send(conn, error_message(e))
        return
    if not send(conn, ("ok", os.getpid())):
        return
    while True:
        try:
            method, args = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return  # the driver closed the pipe
        try:
            result = getattr(worker, method)(*args)
        except BaseException as e:  # noqa: BLE001 - the driver decides
            send(conn, error_message(e))
            if method == "execute_model":
                return
            continue
        if method == "execute_model" and rank:
            continue
        if not send(conn, ("ok", result)):
            return
        if method == "shutdown":
            # Nothing of this process is worth tearing down piece by piece (torch's
            # interpreter-exit clean-up takes seconds): the driver is waiting.
            os._exit(0)
