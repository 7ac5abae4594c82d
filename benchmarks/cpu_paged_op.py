"""cpu_paged's C++ decode op alone, on the decode shapes of issue 40's workloads,
optionally against another version of its source (an A/B of a kernel change).

Cases (bart-base heads: 12 x 64, blocks of 16 scattered over the cache):

  beam4 cross, grouped   16 requests x 4 beams over their encoder output (64-512
                         keys), each request's rows passed as one group (kv_groups)
  beam4 cross, per row   the same rows, one attention each
  256 short              256 rows over 10-60 keys (a 256-translation step)
  batch 1                one row over 40 keys

Each case checks that both versions agree (1e-5) and prints the best / median ms
per call over interleaved rounds, and the K/V bytes read per call over the median
time (the op is bound by that read where the figure nears the machine's stream rate).

  python benchmarks/cpu_paged_op.py --threads 2
  git show HEAD~1:tandem/backends/cpu_paged/paged_decode.cpp > /tmp/old.cpp
  python benchmarks/cpu_paged_op.py --against /tmp/old.cpp --threads 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import cpu_flags  # noqa: E402

from tandem.backends.cpu_paged import ops  # noqa: E402

HEADS, HEAD_SIZE, BLOCK = 12, 64, 16


def load_other(source: str):
    """The op built from ``source`` under its own library namespace, so both load in one process."""
    from torch.utils import cpp_extension

    ns = f"tandem_cpu_ab_{abs(hash(Path(source).read_text())) % 10 ** 8}"
    text = Path(source).read_text().replace("TORCH_LIBRARY(tandem_cpu,", f"TORCH_LIBRARY({ns},")
    text = text.replace("TORCH_LIBRARY_IMPL(tandem_cpu,", f"TORCH_LIBRARY_IMPL({ns},")
    copy = Path(cpp_extension._get_build_directory(ns, verbose=False)) / f"{ns}.cpp"
    copy.write_text(text)
    flags = ["-O3", *ops._ISA_FLAGS.get(ops.cpu_capability(), [])]
    ld = []
    if torch.backends.openmp.is_available():
        flags.append("-fopenmp")
        ld.append("-fopenmp")
    cpp_extension.load(name=ns, sources=[str(copy)], extra_cflags=flags, extra_ldflags=ld, is_python_module=False)
    return getattr(torch.ops, ns).paged_decode_attention


def layout(lens: list[int], g: torch.Generator):
    """A cache holding each sequence's keys in scattered blocks, and the block tables."""
    blocks = [-(-n // BLOCK) for n in lens]
    total = sum(blocks) + 3
    cache = torch.randn(2, total, BLOCK, HEADS, HEAD_SIZE, generator=g)
    perm = torch.randperm(total, generator=g).tolist()
    tables = torch.full((len(lens), max(blocks) + 1), perm[-1], dtype=torch.long)
    for i, n in enumerate(blocks):
        tables[i, :n] = torch.tensor(perm[:n])
        del perm[:n]
    return cache, tables


def cases(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    out = {}
    lens = torch.randint(64, 513, (16,), generator=g).tolist()
    cache, tables = layout(lens, g)
    seqs, rows = torch.arange(16).repeat_interleave(4), torch.arange(64)
    q = torch.randn(64, HEADS, HEAD_SIZE, generator=g)
    read = sum(lens) * 2 * HEADS * HEAD_SIZE * 4
    out["beam4 cross, grouped"] = ((q, cache, rows, seqs, torch.tensor(lens), tables, torch.arange(0, 65, 4)), read)
    out["beam4 cross, per row"] = ((q, cache, rows, seqs, torch.tensor(lens), tables, None), 4 * read)
    lens = torch.randint(10, 61, (256,), generator=g).tolist()
    cache, tables = layout(lens, g)
    q = torch.randn(256, HEADS, HEAD_SIZE, generator=g)
    out["256 short"] = ((q, cache, torch.arange(256), torch.arange(256), torch.tensor(lens), tables, None),
                        sum(lens) * 2 * HEADS * HEAD_SIZE * 4)
    cache, tables = layout([40], g)
    q = torch.randn(1, HEADS, HEAD_SIZE, generator=g)
    out["batch 1"] = ((q, cache, torch.arange(1), torch.arange(1), torch.tensor([40]), tables, None),
                      40 * 2 * HEADS * HEAD_SIZE * 4)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--against", help="another paged_decode.cpp to time beside this checkout's")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--seed", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    fns = {"this checkout": ops.load()}
    if args.against:
        fns[f"--against {Path(args.against).name}"] = load_other(args.against)
    rows = []
    for name, ((q, cache, r, seqs, lens, tables, groups), read) in cases(args.seed).items():
        outs = {}
        for label, fn in fns.items():
            outs[label] = torch.zeros_like(q)
            fn(q, cache, outs[label], r, seqs, lens, tables, HEAD_SIZE ** -0.5, None, groups)
        first = next(iter(outs.values()))
        for label, o in outs.items():
            diff = float((o - first).abs().max())
            if diff > 1e-5:
                raise SystemExit(f"{name}: {label} differs from this checkout's op by {diff:.3g}")
        reps = 200 if name == "batch 1" else 20
        times = {label: [] for label in fns}
        for _ in range(args.rounds):
            for label, fn in fns.items():
                o = torch.zeros_like(q)
                t = time.perf_counter()
                for _ in range(reps):
                    fn(q, cache, o, r, seqs, lens, tables, HEAD_SIZE ** -0.5, None, groups)
                times[label].append((time.perf_counter() - t) / reps * 1e3)
        for label, ts in times.items():
            med = statistics.median(ts)
            rows.append((name, label, min(ts), med, read / med / 1e6))
    print(f"cpu_flags={cpu_flags()}  cpu_capability={ops.cpu_capability()}  build={ops.library_name()}  "
          f"threads={args.threads}  rounds={args.rounds}  load={os.getloadavg()[0]:.2f}  torch={torch.__version__}")
    print(f"{'case':<22}  {'op':<28}  {'best ms':>8}  {'median ms':>9}  {'K/V GB/s (median)':>17}")
    for name, label, best, med, gbs in rows:
        print(f"{name:<22}  {label:<28}  {best:>8.3f}  {med:>9.3f}  {gbs:>17.1f}")


if __name__ == "__main__":
    main()
