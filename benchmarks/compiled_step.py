"""Eager vs compiled decode steps (``enforce_eager``, issue 40): batch-1 ms per token,
a large batch's tokens per second, and start-up with a cold and a warm compile cache.

Runs tandem's offline engine (float32, CPU, 2 torch threads by default) on a BART
checkpoint (a random bart-base-sized one by default, as ``benchmarks/throughput.py``
builds it):

  batch1   8 requests of 20-40 encoder tokens, one at a time, 64 new tokens each
           (ms per generated token, the whole request's wall time / 64)
  large    ``--large`` requests (default 128) of 10-60 encoder tokens, 48 new tokens,
           all at once (tokens per second)

Both engines live in one process and their rounds interleave (eager, compiled,
eager, ...), so load from other processes falls on both; the table reports the
best and the median round. The compiled engine's buckets are compiled before the
rounds (warm-up requests at every batch size up to its largest bucket are not
needed: a bucket compiles the first time a step needs it, during warm-up rounds).

Start-up (``--startup``): a fresh interpreter per measurement builds the engine and
runs one batch-1 request of 8 new tokens; reported is the time from constructing
``LLM`` to that request's end, for eager, compiled with an empty cache directory
(cold) and compiled again with the same directory (warm).

  python benchmarks/compiled_step.py --save-model /tmp/bart-base
  python benchmarks/compiled_step.py --model /tmp/bart-base --rounds 5 --startup
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import (  # noqa: E402 - the sibling benchmark's helpers
    MODEL_SIZES,
    Workload,
    build_random,
    checkpoint_dir,
    cpu_flags,
    load_config,
    make_requests,
)

_STARTUP = """
import sys, time, torch
torch.set_num_threads({threads})
t0 = time.perf_counter()
from tandem import LLM, SamplingParams
llm = LLM(model={model!r}, dtype="float32", device="cpu", enforce_eager={eager}, compile_cache_dir={cache!r})
t1 = time.perf_counter()
llm.generate([{{"prompt_token_ids": {ids!r}}}], SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8),
             use_tqdm=False)
t2 = time.perf_counter()
print("STARTUP", t1 - t0, t2 - t0)
"""


def startup(model: str, eager: bool, cache: str, ids: list[int], threads: int) -> tuple[float, float]:
    code = _STARTUP.format(threads=threads, model=model, eager=eager, cache=cache, ids=ids)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "TQDM_DISABLE": "1"})
    line = [x for x in out.stdout.splitlines() if x.startswith("STARTUP")][-1]
    _, engine_s, first_s = line.split()
    return float(engine_s), float(first_s)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="local BART checkpoint directory")
    p.add_argument("--make-model", choices=sorted(MODEL_SIZES), default="base")
    p.add_argument("--save-model", metavar="DIR", help="keep the built checkpoint here")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds per engine (default 3)")
    p.add_argument("--large", type=int, default=128, help="requests in the large-batch case (default 128; 0: skip)")
    p.add_argument("--compile-max-batch-size", type=int, default=32)
    p.add_argument("--startup", action="store_true", help="also measure start-up (cold and warm cache)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads)
    from tandem import LLM, SamplingParams

    model_dir, _tmp = checkpoint_dir(args.model, args.save_model, "tandem-compiled-step-",
                                     lambda d: build_random(args.make_model, d, args.seed))
    config = load_config(model_dir)
    b1 = make_requests(Workload("batch1", 8, 20, 40, 64), config, 8, args.seed)
    large = make_requests(Workload("large", args.large, 10, 60, 48), config, max(args.large, 1), args.seed)
    cache = tempfile.mkdtemp(prefix="tandem-compile-cache-")

    rows: dict[str, list[float]] = {}
    if args.startup:
        ids = b1.encoder_ids[0]
        for name, eager, cache_dir in (("start-up eager", True, None), ("start-up compiled, cold cache", False, cache),
                                       ("start-up compiled, warm cache", False, cache)):
            engine_s, first_s = startup(str(model_dir), eager, cache_dir, ids, args.threads)
            rows.setdefault(f"{name}: engine built (s)", []).append(engine_s)
            rows.setdefault(f"{name}: + first request (s)", []).append(first_s)

    engines = {
        "eager": LLM(model=str(model_dir), dtype="float32", device="cpu", seed=args.seed),
        "compiled": LLM(model=str(model_dir), dtype="float32", device="cpu", seed=args.seed, enforce_eager=False,
                        compile_max_batch_size=args.compile_max_batch_size, compile_cache_dir=cache),
    }

    def batch1(llm) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=64, min_tokens=64)
        total = 0.0
        for ids in b1.encoder_ids:
            t = time.perf_counter()
            llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
            total += time.perf_counter() - t
        return 1e3 * total / (64 * len(b1.encoder_ids))

    def large_batch(llm) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=48, min_tokens=48)
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": ids} for ids in large.encoder_ids], params, use_tqdm=False)
        return 48 * args.large / (time.perf_counter() - t)

    for llm in engines.values():  # warm-up: the compiled engine builds its buckets here
        batch1(llm)
        if args.large:
            large_batch(llm)
    for _ in range(args.rounds):
        for name, llm in engines.items():
            rows.setdefault(f"batch1 {name} (ms/token, lower is better)", []).append(batch1(llm))
            if args.large:
                rows.setdefault(f"large x{args.large} {name} (tok/s)", []).append(large_batch(llm))
    step = engines["compiled"].llm_engine.worker.runner.compiled
    print(f"model={args.model or 'random ' + args.make_model}  dtype=float32  torch_threads={args.threads}  "
          f"torch={torch.__version__}")
    print(f"cpu_flags={cpu_flags()}  cpu_capability={torch.backends.cpu.get_cpu_capability()}  "
          f"cpu_count={os.cpu_count()}  load_avg={os.getloadavg()}")
    print(f"compiled buckets {step.buckets}, compiled: {sorted(step.compiled_buckets)}, failed: {step.failed}")
    width = max(len(k) for k in rows)
    print(f"{'':<{width}}  {'best':>9}  {'median':>9}  rounds")
    for k, v in rows.items():
        best = min(v) if "ms/token" in k or "(s)" in k else max(v)
        print(f"{k:<{width}}  {best:9.2f}  {statistics.median(v):9.2f}  {len(v)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
