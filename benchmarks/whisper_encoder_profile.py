"""Where tandem's Whisper encoder step spends its time, against this machine's
matmul rate measured in the same run.

Runs ``--num-clips`` 30 s clips through ``llm.transcribe(..., max_tokens=1)``
(log-mel, the encoder, each decoder layer's cross K/V projection of the encoder
output, one decoder step) under ``torch.profiler``, after a warm-up on other
clips, and prints:

- the rate of ``torch.mm`` at 2048^3 in the run's dtype (the machine's GEMM
  rate; bfloat16 runs at oneDNN's bf16 rate only on avx512_bf16 / AMX CPUs),
  and ``torch.mm`` / ``torch.bmm`` at the encoder's own shapes: each linear
  layer's ``[clips x 1500, in] @ [in, out]`` (weighted by its FLOPs) and
  attention's ``Q K^T`` and ``P V`` per head (``[clips x heads, 1500, 64]``);
- self time per op class (GEMMs, attention, convolutions, layer norms, GELU,
  copies, other), the share of the profiled time, and for the three classes
  that do the arithmetic their FLOPs (counted from the model's shapes, not the
  profiler) and GFLOP/s, also as a fraction of the ``torch.mm`` 2048^3 rate
  and of the same-shape rate;
- ``--rounds R`` interleaved rounds (default 3: references, one unprofiled
  step, one profiled step, in turn, each step on clips not seen before, so the
  engine's encoder cache never serves one), each figure the best and the median over
  the rounds, each ratio taken within its round; the load average (the
  machine may be shared) before and after;
- an op census from a ``TorchDispatchMode`` over one more encoder step: each
  op that touches a ``[.., 1500 or 3000, ..]`` tensor, with its input dtypes
  and whether they are contiguous, so a bfloat16 run shows at a glance any op
  that runs in float32 (an upcast in the hot path) or takes a strided input.

  python benchmarks/whisper_encoder_profile.py --size base --num-clips 4 --dtype float32
  python benchmarks/whisper_encoder_profile.py --size base --num-clips 4 --quantization int8
  python benchmarks/whisper_encoder_profile.py --size base --num-clips 4 --dtype bfloat16   # avx512_bf16 CPU
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import whisper as clips_bench  # noqa: E402

# Op classes, first match wins (profiler names, lower case).
CLASSES = (
    ("GEMMs (linear layers)", ("linear", "addmm", "aten::mm", "aten::bmm", "aten::matmul")),
    ("attention (SDPA)", ("scaled_dot_product", "flash_attention", "bf16_encoder_attention")),
    ("convolutions", ("convolution", "conv1d", "conv2d")),
    ("layer norm", ("layer_norm",)),
    ("GELU", ("gelu",)),
    ("copies (copy_, index_copy_ to the cross cache, cat)", ("copy_", "index_copy", "aten::cat", "clone")),
)


def classify(name: str) -> str:
    low = name.lower()
    for label, keys in CLASSES:
        if any(k in low for k in keys):
            return label
    return "other"


def flops_per_clip(c) -> dict[str, float]:
    """Multiply-adds x 2 of one clip's encoder step, by class (log-mel and the one
    decoder step's small GEMMs left out)."""
    d, f, n, L = c.d_model, c.encoder_ffn_dim, c.encoder_layers, c.max_source_positions
    return {
        "GEMMs (linear layers)": n * 2 * L * (d * 3 * d + d * d + 2 * d * f)  # qkv, out, fc1, fc2
        + c.decoder_layers * 2 * L * d * 2 * d,  # each decoder layer's cross K/V of the encoder output
        "attention (SDPA)": n * 4 * L * L * d,  # QK^T and PV
        "convolutions": 2 * 2 * L * c.num_mel_bins * d * 3 + 2 * L * d * d * 3,
    }


def _best_seconds(fn, repeats: int = 3) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def mm_rate(dtype: torch.dtype) -> float:
    a, b = torch.randn(2048, 2048, dtype=dtype), torch.randn(2048, 2048, dtype=dtype)
    return 2 * 2048**3 / _best_seconds(lambda: a @ b) / 1e9


def gemm_shapes(c, clips: int) -> list[tuple[int, int, int, int]]:
    """The encoder step's linear layers as ``(count, M, K, N)``."""
    m, d, f = clips * c.max_source_positions, c.d_model, c.encoder_ffn_dim
    n = c.encoder_layers
    return [(n, m, d, 3 * d), (n, m, d, d), (n, m, d, f), (n, m, f, d), (c.decoder_layers, m, d, 2 * d)]


def same_shape_rates(c, clips: int, dtype: torch.dtype) -> dict[str, float]:
    """GFLOP/s of ``torch.mm`` at the encoder's linear-layer shapes (all of them, FLOP-weighted)
    and of ``torch.bmm`` at attention's per-head ``Q K^T`` and ``P V`` shapes."""
    seconds = flops = 0.0
    for count, m, k, n in gemm_shapes(c, clips):
        x, w = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
        seconds += count * _best_seconds(lambda: torch.mm(x, w), 2)
        flops += count * 2 * m * k * n
    heads, length = clips * c.encoder_attention_heads, c.max_source_positions
    dh = c.d_model // c.encoder_attention_heads
    q, kt = torch.randn(heads, length, dh, dtype=dtype), torch.randn(heads, dh, length, dtype=dtype)
    p = torch.randn(heads, length, length, dtype=dtype)
    attn = _best_seconds(lambda: torch.bmm(q, kt), 2) + _best_seconds(lambda: torch.bmm(p, q), 2)
    return {"GEMMs (linear layers)": flops / seconds / 1e9,
            "attention (SDPA)": 4 * heads * length * length * dh / attn / 1e9}


def census(llm, clips) -> collections.Counter:
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    counts: collections.Counter = collections.Counter()

    class Census(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            tensors = [t for t in tree_flatten((args, kwargs or {}))[0] if isinstance(t, torch.Tensor)]
            if any(s in (1500, 3000) or s % 1500 == 0 and s > 0 for t in tensors for s in t.shape) \
                    and not func.is_view and "empty" not in str(func):
                desc = ", ".join(f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}"
                                 f"{'' if t.is_contiguous() else ' strided'}" for t in tensors[:3])
                counts[(str(func.overloadpacket), desc)] += 1
            return func(*args, **(kwargs or {}))

    with Census():
        run(llm, clips)
    return counts


def load_average() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg()) + f" ({os.cpu_count()} CPUs)"
    except OSError:
        return "unknown"


def run(llm, clips) -> None:
    llm.transcribe([{"audio": c, "sampling_rate": clips_bench.SAMPLING_RATE} for c in clips], language="en",
                   use_tqdm=False, temperature=0.0, max_tokens=1)


def main(argv=None) -> int:
    from torch.profiler import ProfilerActivity, profile

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="local Whisper checkpoint directory")
    p.add_argument("--size", choices=sorted(clips_bench.MODEL_SIZES), default="base")
    p.add_argument("--num-clips", type=int, default=4)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--quantization", choices=("int8",), help="int8 linear layers (float32 around them)")
    p.add_argument("--threads", type=int)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (best and median reported)")
    p.add_argument("--no-census", action="store_true", help="skip the op census")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from tandem import LLM

    with tempfile.TemporaryDirectory(prefix="tandem-bench-whisper-") as tmp:
        model_dir = args.model or clips_bench.make_model(args.size, tmp, args.seed)
        config = clips_bench.load_config(model_dir)
        dtype = "float32" if args.quantization else args.dtype
        llm = LLM(model=model_dir, dtype=dtype, device="cpu", quantization=args.quantization)
        torch_dtype = getattr(torch, dtype)
        print(f"cpu_flags={clips_bench.throughput.cpu_flags()}  "
              f"cpu_capability={torch.backends.cpu.get_cpu_capability()}"
              f"  threads={torch.get_num_threads()}  dtype={dtype}  quantization={args.quantization}  "
              f"clips={args.num_clips}  rounds={args.rounds}  {llm.llm_engine.worker.linear_kernels}")
        print(f"load average before: {load_average()}")
        # New clips for every run: the engine's encoder cache would serve a repeated clip
        # without running the encoder.
        run(llm, clips_bench.make_clips(args.num_clips, args.seed + 1))  # warm-up
        fresh = [(clips_bench.make_clips(args.num_clips, args.seed + 10 + 2 * i),
                  clips_bench.make_clips(args.num_clips, args.seed + 11 + 2 * i)) for i in range(args.rounds)]
        flops = {k: v * args.num_clips for k, v in flops_per_clip(config).items()}
        labels = [c for c, _ in CLASSES] + ["other"]
        rounds = []  # per round: mm rate, same-shape rates, unprofiled seconds, class seconds, top ops
        for timed_clips, clips in fresh:
            rate = mm_rate(torch_dtype)
            same = {} if args.quantization else same_shape_rates(config, args.num_clips, torch_dtype)
            start = time.perf_counter()
            run(llm, timed_clips)
            plain = time.perf_counter() - start
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                run(llm, clips)
            times: dict[str, float] = collections.defaultdict(float)
            for e in prof.key_averages():
                times[classify(e.key)] += e.self_cpu_time_total / 1e6
            top = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:12]
            rounds.append((rate, same, plain, times, top))

        def best_median(values, fmt: str, lower_is_better: bool = False) -> str:
            best = min(values) if lower_is_better else max(values)
            return f"{best:{fmt}} / {statistics.median(values):{fmt}}"

        print(f"torch.mm 2048^3 {dtype} (best / median GFLOP/s): {best_median([r[0] for r in rounds], '.1f')}")
        for label in ("GEMMs (linear layers)", "attention (SDPA)"):
            if rounds[0][1]:
                print(f"torch.mm at the same shapes, {label}: {best_median([r[1][label] for r in rounds], '.1f')}"
                      f" GFLOP/s ({best_median([r[1][label] / r[0] for r in rounds], '.0%')} of 2048^3)")
        plains = [r[2] for r in rounds]
        totals = [sum(r[3].values()) for r in rounds]
        print(f"encoder step, {args.num_clips} clips (best / median of {args.rounds}): "
              f"{best_median(plains, '.3f', True)} s unprofiled "
              f"({best_median([30 * args.num_clips / t for t in plains], '.1f')} audio s/s), "
              f"{best_median(totals, '.3f', True)} s of op self time profiled")
        print(f"{'op class':<52} {'seconds':>13} {'share':>6} {'GFLOP':>6} {'GFLOP/s':>13} "
              f"{'of mm 2048':>11} {'of mm same shape':>17}")
        for label in labels:
            ts = [r[3].get(label, 0.0) for r in rounds]
            share = statistics.median(t / total for t, total in zip(ts, totals))
            fl = flops.get(label)
            cols = ""
            if fl and min(ts) > 0:
                gf = [fl / 1e9 / t for t in ts]
                cols = f" {best_median(gf, '5.1f')} {best_median([g / r[0] for g, r in zip(gf, rounds)], '4.0%')}"
                if rounds[0][1].get(label):
                    cols += f" {best_median([g / r[1][label] for g, r in zip(gf, rounds)], '4.0%')}"
            print(f"{label:<52} {best_median(ts, '6.3f', True)} {share:6.1%} "
                  f"{'' if fl is None else f'{fl / 1e9:6.1f}':>6}{cols}")
        arith = sum(flops.values()) / 1e9
        print(f"all arithmetic: {arith:.1f} GFLOP in {min(plains):.3f} s (best) = {arith / min(plains):.1f} GFLOP/s "
              f"({best_median([arith / r[2] / r[0] for r in rounds], '.0%')} of mm 2048, best / median)")
        top = rounds[-1][4]
        print("top ops (self time, last round): "
              + ", ".join(f"{e.key} {e.self_cpu_time_total / 1e6:.3f} s x{e.count}" for e in top))
        print(f"load average after: {load_average()}")
        if not args.no_census:
            print("\nop census (one more encoder step, new clips: ops on [.., 1500 | 3000, ..] tensors)")
            for (name, desc), n in sorted(census(llm, clips_bench.make_clips(args.num_clips, args.seed + 2)).items()):
                print(f"{n:5d}  {name:<40} {desc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
