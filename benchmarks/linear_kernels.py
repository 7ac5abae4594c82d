"""Dense ``F.linear`` against the oneDNN packed kernel, layer shape by layer shape.

``prepare_linear_kernels`` gives each linear layer one kernel after loading:
``PackedCPUKernel`` (weights reordered once into oneDNN's blocked layout,
``mkldnn._linear_pointwise``) or ``DenseKernel`` (``F.linear``). oneDNN costs
a fixed ~15-25 us a call on a 2-core Xeon, more than a small GEMM's whole
arithmetic; ``linear_kernels.packed_beats_dense`` is the rule that chooses by
the layer's shape, and this script is its evidence: for every ``in x out`` of
``--dims`` (and ``--extra`` shapes such as an LM head), every row count of
``--rows``, each thread count and dtype, it times both kernels (bias on, no
activation) in interleaved rounds (every cell once a round, the two kernels
in alternating order). A round's figure is the fastest of its calls, each
timed alone: on a shared machine a preempted call is slower, never faster.
It prints the best and the median round in microseconds per call, packed
over dense (best rounds; below 1: packed faster), the faster kernel, and what
the rule picks. The packed weight is packed for ``min(rows, 128)`` rows, as
the engine packs a decoder for ``min(max_num_seqs, 128)``. Each round rotates
over copies of the weight (``--working-set-mib`` in all, at least one copy),
so a small layer is not timed from L1 alone.

A line per grid then compares three choices over the cells of at most
``--summary-rows`` rows (decode batches): packing everything, the rule, and
``F.linear`` everywhere, each as its time over the faster kernel's (best
rounds), averaged over the cells, and how many cells it picks the slower one.

    python benchmarks/linear_kernels.py                          # the full grid
    python benchmarks/linear_kernels.py --threads 2 --dtypes float32 --rows 1,32,256
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \\
        python benchmarks/linear_kernels.py --dtypes float32       # an AVX2 CPU, roughly
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from packing import cpu_flags  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def shapes_of(dims: list[int], extra: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(in, out) of every pair of ``dims``, then ``extra`` (duplicates dropped, order kept)."""
    seen, out = set(), []
    for shape in [(k, n) for k in dims for n in dims] + extra:
        if shape not in seen:
            seen.add(shape)
            out.append(shape)
    return out


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """"64x2000,768x50265" -> [(64, 2000), (768, 50265)] (in x out)."""
    shapes = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        k, _, n = item.partition("x")
        shapes.append((int(k), int(n)))
    return shapes


def _sample(fn, calls: int) -> float:
    """The fastest of ``calls`` calls, each timed alone (microseconds): on a shared machine a
    call that another process preempted is slower, never faster, so each round's minimum
    is its uncontended time and the rounds' median is robust to a busy minute."""
    best = float("inf")
    for i in range(calls):
        t0 = time.perf_counter()
        fn(i)
        best = min(best, time.perf_counter() - t0)
    return best * 1e6


def run_grid(shapes, rows, threads: int, dtype: torch.dtype, rounds: int, sample_ms: float,
             working_set_mib: float) -> list[dict]:
    """One dict per (in, out, rows) cell: the microseconds per call of each round, per kernel."""
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    cells = []
    with torch.inference_mode():
        for k, n in shapes:
            bytes_per = k * n * torch.finfo(dtype).bits // 8
            copies = max(1, min(64, int(working_set_mib * 2**20 // bytes_per)))
            weights = [(torch.randn(n, k, generator=g) / k ** 0.5).to(dtype) for _ in range(copies)]
            bias = torch.randn(n, generator=g).to(dtype)
            packs = {}
            for m in rows:
                hint = min(m, 128)
                if hint not in packs:
                    packs[hint] = [torch.ops.mkldnn._reorder_linear_weight(w, hint) for w in weights]
                x = torch.randn(m, k, generator=g).to(dtype)
                ws, ps = weights, packs[hint]

                def dense(i, x=x, ws=ws, bias=bias):
                    F.linear(x, ws[i % len(ws)], bias)

                def packed(i, x=x, ps=ps, bias=bias):
                    torch.ops.mkldnn._linear_pointwise(x, ps[i % len(ps)], bias, "none", [], "")

                cells.append({"in": k, "out": n, "rows": m, "fns": {"dense": dense, "packed": packed},
                              "dense": [], "packed": []})
        for cell in cells:  # calls per sample, from a warm-up call of each kernel
            per = []
            for name in ("dense", "packed"):
                cell["fns"][name](0)
                per.append(_sample(cell["fns"][name], 3))
            cell["calls"] = max(3, min(2000, int(sample_ms * 1e3 / max(max(per), 1.0))))
        for r in range(rounds):
            for cell in cells:
                order = ("dense", "packed") if r % 2 == 0 else ("packed", "dense")
                for name in order:
                    cell[name].append(_sample(cell["fns"][name], cell["calls"]))
    for cell in cells:
        del cell["fns"]
    return cells


def summarize(cells: list[dict], rule, summary_rows: int) -> dict:
    """Per cell: the faster kernel and packed over dense (best rounds), the rule's pick. Over
    the cells of at most ``summary_rows`` rows: for packing everything, the rule and dense
    everywhere, the mean of picked time over the faster kernel's, and the slower picks."""
    choices = {"all packed": lambda c: "packed", "rule": rule, "all dense": lambda c: "dense"}
    if rule is None:
        del choices["rule"]
    totals = {name: [0.0, 0] for name in choices}
    counted = 0
    for c in cells:
        d, p = min(c["dense"]), min(c["packed"])
        c["faster"] = "packed" if p < d else "dense"
        c["ratio"] = p / d
        c["rule"] = rule(c) if rule else None
        if c["rows"] > summary_rows:
            continue
        counted += 1
        for name, choose in choices.items():
            picked = p if choose(c) == "packed" else d
            totals[name][0] += picked / min(p, d)
            totals[name][1] += picked > min(p, d)
    return {"cells": counted, **{name: {"over_faster": t / max(counted, 1), "slower_picks": n}
                                 for name, (t, n) in totals.items()}}


def print_table(cells: list[dict], header: str) -> None:
    print(f"\n{header}")
    print("   in    out  rows |   dense best    median |  packed best    median | packed/dense | faster  rule")
    for c in cells:
        d, p = c["dense"], c["packed"]
        mark = "" if c["rule"] in (None, c["faster"]) else "  <- miss"
        print(f"{c['in']:5d} {c['out']:6d} {c['rows']:5d} | {min(d):12.1f} {statistics.median(d):9.1f} | "
              f"{min(p):12.1f} {statistics.median(p):9.1f} | {c['ratio']:12.2f} | {c['faster']:6s}  "
              f"{c['rule'] or '-'}{mark}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dims", default="64,128,256,512,768,1024", help="in and out features (every pair)")
    p.add_argument("--extra", default="64x192,64x2000,768x2304,768x3072,3072x768,768x50265",
                   help="more in x out shapes (fused QKV, FFN, LM heads)")
    p.add_argument("--rows", default="1,4,16,64,128,256,1024", help="rows of x per call")
    p.add_argument("--threads", default="1,2", help="torch thread counts")
    p.add_argument("--dtypes", default="float32,bfloat16", help="float32, bfloat16 (skipped where oneDNN has none)")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--sample-ms", type=float, default=1.0, help="time per sample (calls are repeated to fill it)")
    p.add_argument("--working-set-mib", type=float, default=8.0,
                   help="weight copies rotated through per sample, in MiB (at most 64 copies; at least one)")
    p.add_argument("--summary-rows", type=int, default=256,
                   help="the summary line counts cells of at most this many rows (default 256)")
    p.add_argument("--json", metavar="PATH", help="also write every cell's samples as JSON")
    args = p.parse_args()
    dims = [int(d) for d in args.dims.split(",") if d]
    shapes = shapes_of(dims, parse_shapes(args.extra))
    rows = [int(r) for r in args.rows.split(",")]
    try:
        from tandem.core.layers.linear_kernels import packed_beats_dense
    except ImportError:  # a checkout without the rule: timings only
        packed_beats_dense = None

    env = {"python": platform.python_version(), "torch": torch.__version__,
           "cpu_capability": torch.backends.cpu.get_cpu_capability(), "cpu_flags": cpu_flags(),
           "onednn_isa_cap": os.environ.get("ONEDNN_MAX_CPU_ISA", ""),
           "mkl_instructions": os.environ.get("MKL_ENABLE_INSTRUCTIONS", ""),
           "load_avg": "/".join(f"{x:.2f}" for x in os.getloadavg())}
    print("  ".join(f"{k}={v}" for k, v in env.items()))
    print(f"shapes={len(shapes)} rows={args.rows} rounds={args.rounds} sample_ms={args.sample_ms} "
          f"working_set_mib={args.working_set_mib}; microseconds per call, best / median of the rounds")
    results = []
    for dname in args.dtypes.split(","):
        dtype = DTYPES[dname]
        if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            print(f"\n{dname}: skipped (oneDNN has no bfloat16 GEMM on this CPU)")
            continue
        for threads in (int(t) for t in args.threads.split(",")):
            started = time.perf_counter()
            cells = run_grid(shapes, rows, threads, dtype, args.rounds, args.sample_ms, args.working_set_mib)
            rule = None if packed_beats_dense is None else (
                lambda c, dtype=dtype, threads=threads:
                "packed" if packed_beats_dense(c["in"], c["out"], dtype) else "dense")
            s = summarize(cells, rule, args.summary_rows)
            print_table(cells, f"{dname}, {threads} thread{'s' if threads > 1 else ''} "
                               f"({time.perf_counter() - started:.0f} s, load {os.getloadavg()[0]:.2f})")
            print(f"rows <= {args.summary_rows}, {s['cells']} cells: time over the faster kernel's (mean), "
                  "slower picks: " + "; ".join(f"{name} {v['over_faster']:.3f}x, {v['slower_picks']}"
                                              for name, v in s.items() if name != "cells"))
            results.append({"dtype": dname, "threads": threads, "summary": s, "cells": cells})
    print(f"\nload_avg at the end={'/'.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.json:
        Path(args.json).write_text(json.dumps({"env": env, "args": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()
