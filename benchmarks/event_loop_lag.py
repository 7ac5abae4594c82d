"""How responsive the asyncio event loop stays while AsyncLLM serves requests.

A ticker coroutine sleeps ``--tick-ms`` again and again and records how late
each wake-up is (the event-loop lag: what every other coroutine in a service,
an HTTP handler or a health check, waits on top of its own work). Three runs
on the same checkpoint and requests, in one process:

  idle      the ticker alone (the floor of this machine and asyncio)
  thread    AsyncLLM: the engine loop in its background thread
  in-loop   the engine stepped inside the event loop (``await asyncio.sleep(0)``
            between steps), what a naive asyncio wrapper does

Each run prints the lag p50 / p99 / max and the output tokens per second.

  python benchmarks/event_loop_lag.py --model /tmp/bench-base
  (make the checkpoint with: python benchmarks/throughput.py --make-model base
   --save-model /tmp/bench-base --num-prompts 1 --engines tandem)
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import time

import torch

from tandem import AsyncLLM, LLM, SamplingParams


def cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next(line for line in f if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return platform.processor()
    keep = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16")
    return ",".join(f for f in keep if f in flags)


async def ticker(tick: float, lags: list[float], stop: asyncio.Event) -> None:
    while not stop.is_set():
        t0 = time.perf_counter()
        await asyncio.sleep(tick)
        lags.append(time.perf_counter() - t0 - tick)


def summary(name: str, lags: list[float], tokens: int, wall: float) -> str:
    ms = sorted(x * 1e3 for x in lags)
    p99 = ms[min(len(ms) - 1, int(0.99 * len(ms)))]
    tps = f"{tokens / wall:8.1f}" if tokens else "       -"
    return f"{name:8s} {len(ms):6d} {statistics.median(ms):8.2f} {p99:8.2f} {ms[-1]:8.2f} {tps}"


async def run_thread(model: str, prompts, params, tick: float):
    engine = AsyncLLM(model=model, dtype="float32")
    lags: list[float] = []
    stop = asyncio.Event()
    t = asyncio.create_task(ticker(tick, lags, stop))

    async def one(i, p):
        last = None
        async for out in engine.generate(p, params, f"r{i}"):
            last = out
        return len(last.outputs[0].token_ids)

    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    wall = time.perf_counter() - t0
    stop.set()
    await t
    await engine.shutdown()
    return lags, sum(counts), wall


async def run_in_loop(model: str, prompts, params, tick: float):
    llm = LLM(model=model, dtype="float32")
    engine = llm.llm_engine
    lags: list[float] = []
    stop = asyncio.Event()
    t = asyncio.create_task(ticker(tick, lags, stop))
    await asyncio.sleep(0)
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens += len(out.outputs[0].token_ids)
        await asyncio.sleep(0)
    wall = time.perf_counter() - t0
    stop.set()
    await t
    return lags, tokens, wall


async def run_idle(seconds: float, tick: float):
    lags: list[float] = []
    stop = asyncio.Event()
    t = asyncio.create_task(ticker(tick, lags, stop))
    await asyncio.sleep(seconds)
    stop.set()
    await t
    return lags, 0, seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=40, help="encoder tokens per request")
    p.add_argument("--tick-ms", type=float, default=5.0)
    args = p.parse_args()

    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": [0, *torch.randint(10, 1000, (args.prompt_len,), generator=g).tolist(), 2]}
               for _ in range(args.num_requests)]
    params = SamplingParams(max_tokens=args.max_tokens, min_tokens=args.max_tokens, temperature=0.0)
    tick = args.tick_ms / 1e3

    print(f"# cpu: {platform.machine()} flags={cpu_flags()} torch={torch.__version__} "
          f"capability={torch.backends.cpu.get_cpu_capability()} threads={torch.get_num_threads()}")
    print(f"# {args.num_requests} requests x {args.max_tokens} tokens, encoder {args.prompt_len + 2} tokens, "
          f"ticker every {args.tick_ms} ms")
    print(f"{'run':8s} {'ticks':>6s} {'p50 ms':>8s} {'p99 ms':>8s} {'max ms':>8s} {'tok/s':>8s}")
    thread = asyncio.run(run_thread(args.model, prompts, params, tick))
    in_loop = asyncio.run(run_in_loop(args.model, prompts, params, tick))
    idle = asyncio.run(run_idle(min(thread[2], 10.0), tick))
    print(summary("idle", *idle))
    print(summary("thread", *thread))
    print(summary("in-loop", *in_loop))


if __name__ == "__main__":
    main()
