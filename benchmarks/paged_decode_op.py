"""cpu_paged's C++ decode op alone over a grid of shapes: rows x keys x head size x
dtype (tiny heads included), microseconds per call.

Every row is its own sequence whose keys lie in scattered blocks of the paged cache
([2, num_blocks, block_size, H_kv, D]); ``--hot`` makes every row read the same
blocks instead (then the K/V stays in cache and the figure is the op's arithmetic
and overhead alone). Prints the CPU's vector flags, torch's capability and the
build variant, then one line a case: best and median us per call over interleaved
rounds, and the median's ns per (row, head, key).

  python benchmarks/paged_decode_op.py                      # 256 rows, 20/40/64 keys, heads 16/32/64, float32
  python benchmarks/paged_decode_op.py --head-sizes 16 --keys 40 --dtypes float32,bfloat16 --kv fp8_e4m3
  python benchmarks/paged_decode_op.py --against /tmp/old.cpp   # another paged_decode.cpp beside this one

``--against FILE`` builds that source under its own op namespace and times it in the
same rounds (after checking both agree to 1e-5 relative); every case then prints one
line per version.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_paged_op import load_other  # noqa: E402
from throughput import cpu_flags  # noqa: E402

from tandem.backends.cpu_paged import ops  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KV = {"same": None, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def case(rows: int, keys: int, heads: int, head_size: int, dtype: torch.dtype, kv: torch.dtype | None,
         block: int, hot: bool, g: torch.Generator):
    """The op's arguments: ``rows`` sequences of ``keys`` keys each, in scattered blocks
    (or all in the same blocks with ``hot``)."""
    per = -(-keys // block)
    total = per * (1 if hot else rows) + 1
    cache = torch.randn(2, total, block, heads, head_size, generator=g)
    cache = cache.to(kv) if kv is not None else cache.to(dtype)
    perm = torch.randperm(total, generator=g)
    tables = perm[:per].repeat(rows, 1) if hot else perm[: rows * per].view(rows, per)
    q = torch.randn(rows, heads, head_size, generator=g).to(dtype)
    idx = torch.arange(rows)
    return q, cache, idx, idx, torch.full((rows,), keys, dtype=torch.long), tables.contiguous()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="256", help="comma list (default 256)")
    p.add_argument("--keys", default="20,40,64", help="comma list of keys per row (default 20,40,64)")
    p.add_argument("--head-sizes", default="16,32,64", help="comma list (default 16,32,64)")
    p.add_argument("--heads", type=int, default=4, help="query = KV heads (default 4)")
    p.add_argument("--dtypes", default="float32", help="comma list of " + "/".join(DTYPES))
    p.add_argument("--kv", default="same", choices=list(KV), help="the cache's dtype (default: the query's)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--hot", action="store_true", help="every row reads the same blocks")
    p.add_argument("--against", help="another paged_decode.cpp to time beside this checkout's")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--round-ms", type=float, default=40.0, help="time per version per case per round")
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="cpu: the process's CPU time (all its threads), steadier on a shared machine "
                        "(with --threads 1 it excludes the time other processes hold the core)")
    p.add_argument("--seed", type=int, default=5)
    args = p.parse_args()
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    torch.set_num_threads(args.threads)
    fns = {"this checkout": ops.load()}
    if args.against:
        fns[f"--against {Path(args.against).name}"] = load_other(args.against)
    kv = KV[args.kv]
    print(f"cpu_flags={cpu_flags()}  cpu_capability={ops.cpu_capability()}  build={ops.library_name()}  "
          f"threads={args.threads}  rounds={args.rounds}  heads={args.heads}  block={args.block_size}  "
          f"kv={args.kv}  hot={args.hot}  clock={args.clock}  load={os.getloadavg()[0]:.2f}  torch={torch.__version__}")
    label_w = max(len(x) for x in fns)
    print(f"{'rows':>5} {'keys':>5} {'hs':>4} {'dtype':>9}  {'op':<{label_w}}  {'best us':>9} {'median us':>9} "
          f"{'ns/(row,head,key)':>17}")
    g = torch.Generator().manual_seed(args.seed)
    for rows, keys, hs, dname in itertools.product(ints(args.rows), ints(args.keys), ints(args.head_sizes),
                                                    args.dtypes.split(",")):
        q, cache, r, seqs, lens, tables = case(rows, keys, args.heads, hs, DTYPES[dname], kv, args.block_size,
                                               args.hot, g)
        scale, scales = hs ** -0.5, ((0.7, 1.3) if kv is not None else (1.0, 1.0))

        def call(fn, o):
            fn(q, cache, o, r, seqs, lens, tables, scale, None, None, *scales)

        outs = {}
        for label, fn in fns.items():
            outs[label] = torch.zeros_like(q)
            call(fn, outs[label])
        first = next(iter(outs.values())).float()
        for label, o in outs.items():
            diff = float(((o.float() - first).abs() / (first.abs() + 1e-3)).max())
            if diff > (1e-5 if q.dtype == torch.float32 else 1e-2):
                raise SystemExit(f"{rows}x{keys}x{hs} {dname}: {label} differs from this checkout's op by {diff:.3g}")
        o = torch.zeros_like(q)
        t = time.perf_counter()
        call(fns["this checkout"], o)
        reps = max(1, int(args.round_ms * 1e-3 / max(time.perf_counter() - t, 1e-6)))
        times = {label: [] for label in fns}
        for _ in range(args.rounds):
            for label, fn in fns.items():
                t = clock()
                for _ in range(reps):
                    call(fn, o)
                times[label].append((clock() - t) / reps * 1e6)
        for label, ts in times.items():
            med = statistics.median(ts)
            print(f"{rows:>5} {keys:>5} {hs:>4} {dname:>9}  {label:<{label_w}}  {min(ts):>9.1f} {med:>9.1f} "
                  f"{med * 1e3 / (rows * args.heads * keys):>17.2f}", flush=True)


if __name__ == "__main__":
    main()
