"""How a step's ``SchedulerOutput`` is best sent to the ranks: the per-step cost of three
broadcasts, measured as the round trip the ``mp`` executor makes each step (driver sends
to every rank, every rank decodes it, rank 0 answers on its pipe).

- ``pipe``: pickled once, the bytes written to one pipe per rank (what ``multiproc.py`` does)
- ``shm``: pickled once into the next slot of a shared-memory ring; ranks poll its
  sequence number (spinning with ``sched_yield``), as vLLM's shared-memory broadcast does
- ``dist``: ``torch.distributed.broadcast_object_list`` from the driver as rank 0 of a
  gloo group of ranks + 1

Steps are built as the scheduler builds them at batch ``--batch`` (default 64): a decode
step (one token per sequence, no new requests) and a prefill step (every request new, with
its sampling params and encoder ids).

    python benchmarks/broadcast.py --ranks 2 --batch 64 --iters 2000
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import struct
import time
from multiprocessing import get_context
from multiprocessing.shared_memory import SharedMemory

from tandem.core.inputs import EncoderInputs
from tandem.core.sampling_params import SamplingParams
from tandem.core.scheduler_output import NewRequestData, ScheduledGroup, ScheduledSequence, SchedulerOutput

P = pickle.HIGHEST_PROTOCOL
_SEQ = struct.Struct("q")  # a slot's sequence number, at its offset 0: written last, read first
_LEN = struct.Struct("q")  # its payload's length, at offset 8
_HDR_SIZE = 16
# A ring of slots, so a rank still reading step k is not overwritten by step k + 1
# (the driver waits only for rank 0); each slot: sequence number, length, payload.
SLOTS, SLOT_BYTES = 8, 1 << 20
SHM_BYTES = SLOTS * SLOT_BYTES


def make_step(batch: int, prefill: bool) -> SchedulerOutput:
    groups, new = [], []
    for i in range(batch):
        rid = f"req-{i}"
        if prefill:
            enc = list(range(4, 4 + 128))
            seq = ScheduledSequence(i, [2, 0], 0, list(range(i * 16, i * 16 + 2)), True, 0)
            groups.append(ScheduledGroup(rid, [seq], EncoderInputs.from_token_ids(enc), len(enc),
                                         list(range(5000 + i * 8, 5008 + i * 8))))
            new.append(NewRequestData(rid, SamplingParams(temperature=0.0, max_tokens=64)))
        else:
            seq = ScheduledSequence(i, [1234], 40, [], False, 38)
            groups.append(ScheduledGroup(rid, [seq], None, 128, list(range(5000 + i * 8, 5008 + i * 8))))
    return SchedulerOutput(groups, batch * (130 if prefill else 1), [], [], new_requests=new)


def _rank_pipe(rank, conn):
    while True:
        data = conn.recv_bytes()
        if data == b"stop":
            return
        pickle.loads(data)
        if rank == 0:
            conn.send_bytes(b"ok")


def _rank_shm(rank, name, conn):
    shm = SharedMemory(name=name)
    buf, last = shm.buf, 0
    try:
        while True:
            base = ((last + 1) % SLOTS) * SLOT_BYTES
            if _SEQ.unpack_from(buf, base)[0] != last + 1:
                os.sched_yield()
                continue
            last += 1
            n = _LEN.unpack_from(buf, base + 8)[0]  # x86 keeps stores in order: written before seq
            if n < 0:
                return
            pickle.loads(buf[base + _HDR_SIZE : base + _HDR_SIZE + n])
            if rank == 0:
                conn.send_bytes(b"ok")
    finally:
        del buf
        shm.close()


def _rank_dist(rank, world, port, conn):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank + 1, world_size=world)
    box = [None]
    while True:
        dist.broadcast_object_list(box, src=0)
        if box[0] is None:
            break
        if rank == 0:
            conn.send_bytes(b"ok")
    dist.destroy_process_group()


def bench(kind: str, ranks: int, steps: dict, iters: int) -> dict[str, float]:
    ctx = get_context("spawn")
    pipes = [ctx.Pipe() for _ in range(ranks)]
    shm = SharedMemory(create=True, size=SHM_BYTES) if kind == "shm" else None
    port = None
    if kind == "dist":
        from tandem.core.executor.rank_worker import free_port

        port = free_port()
    procs = []
    for r in range(ranks):
        args = {"pipe": (r, pipes[r][1]), "shm": (r, shm.name if shm else None, pipes[r][1]),
                "dist": (r, ranks + 1, port, pipes[r][1])}[kind]
        target = {"pipe": _rank_pipe, "shm": _rank_shm, "dist": _rank_dist}[kind]
        p = ctx.Process(target=target, args=args, daemon=True)
        p.start()
        procs.append(p)
    if kind == "dist":
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=ranks + 1)
    ack = pipes[0][0]
    seq = 0

    def send(out) -> None:
        nonlocal seq
        if kind == "pipe":
            data = pickle.dumps(out, protocol=P)
            for mine, _ in pipes:
                mine.send_bytes(data)
        elif kind == "shm":
            data = pickle.dumps(out, protocol=P)
            seq += 1
            base = (seq % SLOTS) * SLOT_BYTES
            shm.buf[base + _HDR_SIZE : base + _HDR_SIZE + len(data)] = data
            _LEN.pack_into(shm.buf, base + 8, len(data))
            _SEQ.pack_into(shm.buf, base, seq)
        else:
            dist.broadcast_object_list([out], src=0)

    results = {}
    try:
        for name, out in steps.items():
            for _ in range(min(50, iters)):  # warm up
                send(out)
                ack.recv_bytes()
            times = []
            for _ in range(iters):
                t = time.perf_counter()
                send(out)
                ack.recv_bytes()
                times.append(time.perf_counter() - t)
            results[name] = statistics.median(times) * 1e6
    finally:
        if kind == "pipe":
            for mine, _ in pipes:
                mine.send_bytes(b"stop")
        elif kind == "shm":
            seq += 1
            base = (seq % SLOTS) * SLOT_BYTES
            _LEN.pack_into(shm.buf, base + 8, -1)
            _SEQ.pack_into(shm.buf, base, seq)
        else:
            dist.broadcast_object_list([None], src=0)
        for p in procs:
            p.join(10)
        if kind == "dist":
            dist.destroy_process_group()
        if shm is not None:
            shm.close()
            shm.unlink()
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--kinds", default="pipe,shm,dist")
    args = ap.parse_args()
    steps = {"decode": make_step(args.batch, False), "prefill": make_step(args.batch, True)}
    sizes = {k: len(pickle.dumps(v, protocol=P)) for k, v in steps.items()}
    print(f"batch {args.batch}, {args.ranks} ranks; pickled step: decode {sizes['decode']:,} B, "
          f"prefill {sizes['prefill']:,} B; median round trip over {args.iters} steps (us)")
    print("| broadcast | decode step | prefill step |\n|---|---|---|")
    for kind in args.kinds.split(","):
        r = bench(kind, args.ranks, steps, args.iters)
        print(f"| {kind} | {r['decode']:.0f} | {r['prefill']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
