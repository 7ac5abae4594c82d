"""Where tandem's Whisper encoder step spends its time, against this machine's
matmul rate measured in the same run.

Runs ``--num-clips`` 30 s clips through ``llm.transcribe(..., max_tokens=1)``
(log-mel, the encoder, each decoder layer's cross K/V projection of the encoder
output, one decoder step) under ``torch.profiler``, after a warm-up on other
clips, and prints:

- the rate of ``torch.mm`` at 2048^3 in the run's dtype (the machine's GEMM
  rate; bfloat16 runs at oneDNN's bf16 rate only on avx512_bf16 / AMX CPUs);
- self time per op class (GEMMs, attention, convolutions, layer norms, GELU,
  copies, other), the share of the profiled time, and for the three classes
  that do the arithmetic their FLOPs (counted from the model's shapes, not the
  profiler) and GFLOP/s, also as a fraction of the ``torch.mm`` rate;
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
    ("attention (SDPA)", ("scaled_dot_product", "flash_attention")),
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


def mm_rate(dtype: torch.dtype) -> float:
    a, b = torch.randn(2048, 2048, dtype=dtype), torch.randn(2048, 2048, dtype=dtype)
    a @ b
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * 2048**3 / best / 1e9


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
        rate = mm_rate(getattr(torch, dtype))
        print(f"cpu_flags={clips_bench.throughput.cpu_flags()}  "
              f"cpu_capability={torch.backends.cpu.get_cpu_capability()}"
              f"  threads={torch.get_num_threads()}  dtype={dtype}  quantization={args.quantization}  "
              f"clips={args.num_clips}  {llm.llm_engine.worker.linear_kernels}")
        print(f"torch.mm 2048^3 {dtype}: {rate:.1f} GFLOP/s")
        clips = clips_bench.make_clips(args.num_clips, args.seed)
        run(llm, clips_bench.make_clips(args.num_clips, args.seed + 1))  # warm-up, other clips
        start = time.perf_counter()
        run(llm, clips_bench.make_clips(args.num_clips, args.seed + 2))
        plain = time.perf_counter() - start
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            run(llm, clips)
        times: dict[str, float] = collections.defaultdict(float)
        for e in prof.key_averages():
            times[classify(e.key)] += e.self_cpu_time_total / 1e6
        total = sum(times.values())
        flops = {k: v * args.num_clips for k, v in flops_per_clip(config).items()}
        print(f"encoder step, {args.num_clips} clips: {plain:.2f} s unprofiled "
              f"({30 * args.num_clips / plain:.1f} audio s/s), {total:.2f} s of op self time profiled")
        print(f"{'op class':<52} {'seconds':>8} {'share':>6} {'GFLOP':>7} {'GFLOP/s':>8} {'of mm':>6}")
        for label in [c for c, _ in CLASSES] + ["other"]:
            t = times.get(label, 0.0)
            fl = flops.get(label)
            rate_s = f"{fl / 1e9 / t:8.1f} {fl / 1e9 / t / rate:6.0%}" if fl and t else f"{'':8} {'':6}"
            print(f"{label:<52} {t:8.3f} {t / total:6.1%} {'' if fl is None else f'{fl / 1e9:7.1f}':>7} {rate_s}")
        print(f"all arithmetic: {sum(flops.values()) / 1e9:.1f} GFLOP in {plain:.2f} s = "
              f"{sum(flops.values()) / 1e9 / plain:.1f} GFLOP/s ({sum(flops.values()) / 1e9 / plain / rate:.0%} of mm)")
        top = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:12]
        print("top ops (self time): "
              + ", ".join(f"{e.key} {e.self_cpu_time_total / 1e6:.3f} s x{e.count}" for e in top))
        if not args.no_census:
            print("\nop census (one encoder step of the same clips: ops on [.., 1500 | 3000, ..] tensors)")
            for (name, desc), n in sorted(census(llm, clips_bench.make_clips(args.num_clips, args.seed + 3)).items()):
                print(f"{n:5d}  {name:<40} {desc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
