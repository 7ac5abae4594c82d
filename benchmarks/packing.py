"""How oneDNN's weight packing depends on the rows it was packed for.

``PackedCPUKernel`` reorders each weight once into oneDNN's blocked layout for a
row count (``batch_hint``): tandem packs the decoder's layers and the LM head for
``min(max_num_seqs, 128)`` rows (one row per running sequence in a decode step)
and the encoder's for whole inputs (``kernel_setup.ENCODER_BATCH_HINT``). This
script times one decode step's GEMMs of a model shape (every decoder layer's
projections in order, then the LM head: weights read from memory, not cache, as
in a step) at several row counts, for each packing, in interleaved rounds, and
prints the best and median per cell.

    python benchmarks/packing.py                       # bart-base's shapes
    python benchmarks/packing.py --d-model 1024 --ffn 4096 --layers 12 --vocab 256206
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch


def cpu_flags() -> str:
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16")
    try:
        with open("/proc/cpuinfo") as f:
            flags = next(line for line in f if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return "unknown"
    return ",".join(flag for flag in wanted if flag in flags)


def step_shapes(d_model: int, ffn: int, layers: int, vocab: int) -> list[tuple[str, int, int]]:
    """(name, out, in) of one BART-style decode step's GEMMs: fused QKV, self out,
    cross q, cross out, fc1, fc2 per layer (the cross K/V run once per request),
    then the LM head."""
    per_layer = [("qkv", 3 * d_model, d_model), ("self_out", d_model, d_model), ("cross_q", d_model, d_model),
                 ("cross_out", d_model, d_model), ("fc1", ffn, d_model), ("fc2", d_model, ffn)]
    return per_layer * layers + [("lm_head", vocab, d_model)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--ffn", type=int, default=3072)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--vocab", type=int, default=50265)
    p.add_argument("--rows", default="1,4,16,128", help="decode batch sizes to time")
    p.add_argument("--hints", default="1,16,128", help="row counts to pack for")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    hints = [int(h) for h in args.hints.split(",")]
    shapes = step_shapes(args.d_model, args.ffn, args.layers, args.vocab)
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(o, i, generator=g) / i ** 0.5 for _, o, i in shapes]
    packed = {h: [torch.ops.mkldnn._reorder_linear_weight(w, h) for w in weights] for h in hints}
    del weights
    mb = sum(o * i for _, o, i in shapes) * 4 / 2**20
    lm_mb = shapes[-1][1] * shapes[-1][2] * 4 / 2**20
    print(f"python={platform.python_version()} torch={torch.__version__} threads={args.threads} "
          f"cpu_capability={torch.backends.cpu.get_cpu_capability()} cpu_flags={cpu_flags()} "
          f"load_avg={'/'.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"shapes: d_model={args.d_model} ffn={args.ffn} layers={args.layers} vocab={args.vocab}: "
          f"{mb:.0f} MiB of float32 weights per step ({lm_mb:.0f} MiB LM head)")
    step: dict[tuple[int, int], list[float]] = {(m, h): [] for m in rows for h in hints}
    head: dict[tuple[int, int], list[float]] = {(m, h): [] for m in rows for h in hints}
    with torch.inference_mode():
        xs = {m: {i: torch.randn(m, i, generator=g) for i in {i for _, _, i in shapes}} for m in rows}
        for _ in range(args.rounds):
            for m in rows:
                for h in hints:  # interleaved: every cell once per round
                    t0 = time.perf_counter()
                    for (_, _, i), w in zip(shapes[:-1], packed[h][:-1]):
                        torch.ops.mkldnn._linear_pointwise(xs[m][i], w, None, "none", [], "")
                    t1 = time.perf_counter()
                    torch.ops.mkldnn._linear_pointwise(xs[m][shapes[-1][2]], packed[h][-1], None, "none", [], "")
                    t2 = time.perf_counter()
                    step[m, h].append((t2 - t0) * 1e3)
                    head[m, h].append((t2 - t1) * 1e3)
    print(f"\nms per decode step's GEMMs (all layers + LM head; LM head alone in brackets), "
          f"best / median of {args.rounds} interleaved rounds")
    print("rows  " + "  ".join(f"{'packed for ' + str(h):>30}" for h in hints))
    for m in rows:
        cells = []
        for h in hints:
            s, lm = step[m, h], head[m, h]
            cells.append(f"{min(s):6.2f} / {statistics.median(s):6.2f} ({min(lm):5.2f}/{statistics.median(lm):5.2f})")
        print(f"{m:4d}  " + "  ".join(f"{c:>30}" for c in cells))


if __name__ == "__main__":
    main()
