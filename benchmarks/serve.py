"""Serving benchmark (after ``vllm bench serve``): load against a running
``tandem serve``, streamed completions, at several concurrency levels or request
rates; prints output-token throughput, TTFT and inter-token latency (p50 / p99)
per level, with the CPU flags.

  # start a server (here on a random bart-base-sized checkpoint), then:
  python benchmarks/throughput.py --make-model base --save-model /tmp/bart-base --num-prompts 1
  tandem serve /tmp/bart-base --port 8000 &
  python benchmarks/serve.py --url http://127.0.0.1:8000 --concurrency 1,4,16 --num-prompts 64

``--launch MODEL`` starts (and stops) the server itself, and then reports the
server's CPU time per output token at each level (all its threads, and its main
thread alone: the event loop's HTTP, detokenizing and SSE), which a loaded machine
disturbs far less than throughput. Requests are seeded
random prompts of ``--input-len`` token ids in [4, ``--vocab-max``) (or words,
with ``--text``, for checkpoints with a tokenizer), each decoding exactly
``--max-tokens`` tokens (``ignore_eos``) greedily, so every level does the same work.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import cpu_flags  # noqa: E402

WORDS = ("the rain in spain falls mainly on plain a cat sat mat dog ran fast over hill red blue green small big "
         "old new time day night sun moon star sea river tree house road city king queen bird fish stone").split()


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))
    return xs[k]


async def one_request(client, url: str, prompt, args) -> dict:
    body = {"prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    arrivals, tokens = [], 0
    async with client.stream("POST", f"{url}/v1/completions", json=body, headers=args.headers) as r:
        if r.status_code != 200:
            return {"error": f"{r.status_code}: {(await r.aread()).decode()[:200]}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices"):
                arrivals.append(time.perf_counter())
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    end = time.perf_counter()
    itl = [(b - a) for a, b in zip(arrivals, arrivals[1:])]
    return {"ttft": arrivals[0] - start if arrivals else float("nan"), "itl": itl, "latency": end - start,
            "tokens": tokens}


def cpu_seconds(pid: int | None) -> tuple[float, float]:
    """CPU seconds (user + system) of process ``pid``'s threads together and of its main thread."""
    if pid is None:
        return float("nan"), float("nan")
    import psutil

    proc = psutil.Process(pid)
    total = proc.cpu_times()
    main = next((t for t in proc.threads() if t.id == pid), None)
    return total.user + total.system, (main.user_time + main.system_time) if main else float("nan")


async def run_level(url: str, prompts: list, args, concurrency: int | None, rate: float | None) -> dict:
    import httpx

    limits = httpx.Limits(max_connections=max(64, concurrency or 64))
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as client:
        sem = asyncio.Semaphore(concurrency) if concurrency else None
        rng = random.Random(args.seed)

        async def guarded(p):
            if sem is None:
                return await one_request(client, url, p, args)
            async with sem:
                return await one_request(client, url, p, args)

        cpu_before = cpu_seconds(args.server_pid)
        start = time.perf_counter()
        tasks = []
        for p in prompts:
            tasks.append(asyncio.create_task(guarded(p)))
            if rate:
                await asyncio.sleep(rng.expovariate(rate))  # Poisson arrivals
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        cpu_after = cpu_seconds(args.server_pid)
    ok = [r for r in results if "error" not in r]
    errors = [r["error"] for r in results if "error" in r]
    ttft = [r["ttft"] for r in ok]
    itl = [x for r in ok for x in r["itl"]]
    tokens = sum(r["tokens"] for r in ok)
    return {
        "level": f"concurrency {concurrency}" if concurrency else f"rate {rate}/s",
        "requests": len(ok), "errors": len(errors), "duration_s": duration, "output_tok_s": tokens / duration,
        "req_s": len(ok) / duration, "ttft_p50_ms": 1000 * percentile(ttft, 50),
        "ttft_p99_ms": 1000 * percentile(ttft, 99), "itl_p50_ms": 1000 * percentile(itl, 50),
        "itl_p99_ms": 1000 * percentile(itl, 99),
        "server_cpu_us_tok": 1e6 * (cpu_after[0] - cpu_before[0]) / max(1, tokens),
        "main_cpu_us_tok": 1e6 * (cpu_after[1] - cpu_before[1]) / max(1, tokens),
        "first_error": errors[0] if errors else None,
    }


def table(rows: list[dict]) -> str:
    cols = [("level", "level"), ("requests", "requests"), ("errors", "errors"), ("output tok/s", "output_tok_s"),
            ("req/s", "req_s"), ("TTFT p50 ms", "ttft_p50_ms"), ("TTFT p99 ms", "ttft_p99_ms"),
            ("ITL p50 ms", "itl_p50_ms"), ("ITL p99 ms", "itl_p99_ms"), ("server CPU us/tok", "server_cpu_us_tok"),
            ("main thread us/tok", "main_cpu_us_tok")]
    cells = [[h for h, _ in cols]]
    for r in rows:
        cells.append([f"{r[k]:.1f}" if isinstance(r[k], float) else str(r[k]) for _, k in cols])
    widths = [max(len(c[i]) for c in cells) for i in range(len(cols))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def launch(model: str, extra: list[str]) -> tuple[subprocess.Popen, str]:
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "tandem.entrypoints.cli", "serve", model, "--port", str(port),
                             *extra], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(1200):
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError("the server exited during start-up")
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError("the server did not start in 120 s")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--launch", metavar="MODEL", help="start `tandem serve MODEL` on a free port for the run")
    p.add_argument("--serve-args", default="", help="extra `tandem serve` arguments with --launch")
    p.add_argument("--api-key", default=None)
    p.add_argument("--concurrency", default="1,4,16", help="comma list of concurrency levels")
    p.add_argument("--request-rate", default=None, help="comma list of Poisson request rates (instead)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=40, help="prompt length in token ids (or words with --text)")
    p.add_argument("--vocab-max", type=int, default=1000, help="random prompt ids are below this")
    p.add_argument("--text", action="store_true", help="send random words instead of token ids")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    args.headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    rng = random.Random(args.seed)
    if args.text:
        prompts = [" ".join(rng.choice(WORDS) for _ in range(args.input_len)) for _ in range(args.num_prompts)]
    else:
        prompts = [[0] + [rng.randrange(4, args.vocab_max) for _ in range(args.input_len)] + [2]
                   for _ in range(args.num_prompts)]
    load_before = "/".join(f"{x:.2f}" for x in os.getloadavg())
    proc, args.server_pid = None, None
    if args.launch:
        proc, args.url = launch(args.launch, args.serve_args.split())
        args.server_pid = proc.pid
    try:
        asyncio.run(run_level(args.url, prompts[:2], args, 2, None))  # warm-up
        levels = ([(None, float(r)) for r in args.request_rate.split(",")] if args.request_rate
                  else [(int(c), None) for c in args.concurrency.split(",")])
        rows = [asyncio.run(run_level(args.url, prompts, args, c, r)) for c, r in levels]
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
    import torch

    print(f"cpu_flags={cpu_flags()}  cpu_capability={torch.backends.cpu.get_cpu_capability()}  "
          f"cpu_count={os.cpu_count()}  load_avg={load_before} -> {'/'.join(f'{x:.2f}' for x in os.getloadavg())}  "
          f"prompts={args.num_prompts} x {args.input_len} {'words' if args.text else 'token ids'}, "
          f"{args.max_tokens} tokens each")
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": {k: v for k, v in vars(args).items()
                                                         if k not in ("headers", "server_pid")},
                                                "rows": rows}, indent=2) + "\n")
    return 0 if all(r["errors"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
