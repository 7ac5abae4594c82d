"""The bf16 flash op for encoder attention (tandem/backends/cpu_flash) against
SDPA in bfloat16 and float32 on Whisper's shape, and against this machine's
bfloat16 matmul rate measured in the same run.

Each round times, in turn: ``torch.mm`` 2048^3 in bfloat16, SDPA float32, SDPA
bfloat16 (both over ``[clips, heads, length, head_size]`` views of packed
``[clips x length, heads, head_size]`` tensors, as tandem's encoder calls it) and
the op. Prints GFLOP/s (4 x length^2 x heads x head_size per clip) as best /
median over the rounds, and each as a share of ``torch.mm``'s rate (best of
best, median of the per-round ratios). The machine may be shared: the load
average is printed before and after.

  python benchmarks/bf16_encoder_attention.py --clips 2 --heads 8 --length 1500 --rounds 10
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import cpu_flags  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clips", type=int, default=2)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--length", type=int, default=1500)
    ap.add_argument("--head-size", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from tandem.backends.cpu_flash import ops

    op = ops.load()  # raises with the reason where the CPU lacks avx512_bf16
    R, H, L, D = args.clips, args.heads, args.length, args.head_size
    g = torch.Generator().manual_seed(0)
    qkv32 = torch.randn(R * L, 3, H, D, generator=g)
    qkv16 = qkv32.bfloat16()
    scale = D**-0.5
    runs = torch.tensor([(i * L, L) for i in range(R)])

    def heads_first(t):  # [R * L, H, D] -> [R, H, L, D], a view
        return t.view(R, L, H, D).transpose(1, 2)

    def sdpa(qkv):
        q, k, v = (heads_first(qkv[:, i]) for i in range(3))
        return lambda: F.scaled_dot_product_attention(q, k, v, scale=scale)

    out = torch.empty(R * L, H, D, dtype=torch.bfloat16)
    a = torch.randn(2048, 2048, generator=g).bfloat16()
    b = torch.randn(2048, 2048, generator=g).bfloat16()
    attn = 4 * L * L * H * D * R
    cases = {
        "torch.mm 2048^3 bfloat16": (lambda: torch.mm(a, b), 2 * 2048**3),
        "SDPA float32": (sdpa(qkv32), attn),
        "SDPA bfloat16": (sdpa(qkv16), attn),
        "cpu_flash op bfloat16": (lambda: op(qkv16[:, 0], qkv16[:, 1], qkv16[:, 2], out, runs, scale), attn),
    }
    for fn, _ in cases.values():  # warm-up
        fn()
    load_before = os.getloadavg()
    rates = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, (fn, flops) in cases.items():
            t = time.perf_counter()
            fn()
            rates[name].append(flops / (time.perf_counter() - t) / 1e9)
    mm = rates["torch.mm 2048^3 bfloat16"]
    print(f"cpu_flags={cpu_flags()}  cpu_capability={torch.backends.cpu.get_cpu_capability()}  "
          f"threads={torch.get_num_threads()}  shape=[{R}, {H}, {L}, {D}]  rounds={args.rounds}")
    print(f"load average before {load_before[0]:.2f} {load_before[1]:.2f}, after "
          f"{os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} ({os.cpu_count()} CPUs)")
    print(f"{'':28s} {'GFLOP/s best / median':>22s}  {'of bf16 torch.mm best / median':>31s}")
    for name, r in rates.items():
        ratio = statistics.median(x / m for x, m in zip(r, mm))
        print(f"{name:28s} {max(r):9.1f} / {statistics.median(r):7.1f}  {100 * max(r) / max(mm):17.0f}% / {100 * ratio:4.0f}%")


if __name__ == "__main__":
    main()
