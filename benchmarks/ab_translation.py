"""Two checkouts of tandem, A against B, on the "256 short translations" workload.

``benchmarks/throughput.py --workload translation`` compares engines; this
compares two versions of tandem's own code (a change against the commit before
it) on the same workload: 256 requests, encoder 10-60 tokens, 48 new tokens,
greedy, fixed output length, a BART checkpoint (``--model``), ``--threads``
torch threads, the encoder cache off (``encoder_cache_blocks=0``: a round
repeats the same prompts, which would otherwise skip their encoders).

Each round runs each checkout in a fresh process, in alternating order, so a
machine other jobs share slows both alike; each process warms up once (a few
short requests), then times one pass of the workload. Reported per checkout:
tok/s (generated tokens / wall time), the first engine step (every encoder and
the first decode token) and the median later step, each as the best and the
median of the rounds, with the CPU flags and the load average; and tokens per
second of the process's CPU time, which other jobs on the machine move less
(with ``--threads 1`` it is the work done; with more, threads waiting at a
join spin and count).

  python benchmarks/ab_translation.py --model /tmp/bart-base \\
      --a /tmp/old-checkout --b . --quantization int8 --rounds 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def child(args) -> None:
    """One timed pass in this process (the checkout is first on PYTHONPATH)."""
    import torch

    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(HERE))
    from throughput import Workload, load_config, make_requests

    from tandem import LLM, SamplingParams

    llm = LLM(model=args.model, dtype="float32", device="cpu", seed=0, quantization=args.quantization,
              encoder_cache_blocks=0)
    config = load_config(args.model)
    engine = llm.llm_engine
    warm = make_requests(Workload("warm", 4, 10, 60, 4), config, 4, 1)
    llm.generate([{"prompt_token_ids": ids} for ids in warm.encoder_ids],
                 SamplingParams(temperature=0.0, max_tokens=4, min_tokens=4), use_tqdm=False)
    work = Workload("translation", 256, 10, 60, 48)
    reqs = make_requests(work, config, work.num_requests, args.seed)
    params = SamplingParams(temperature=0.0, max_tokens=work.new_tokens, min_tokens=work.new_tokens)
    for i, ids in enumerate(reqs.encoder_ids):
        engine.add_request(f"r{i}", {"prompt_token_ids": ids}, params)
    steps, tokens = [], 0
    start, cpu_start = time.perf_counter(), time.process_time()
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        for out in engine.step():
            if out.finished:
                tokens += len(out.outputs[0].token_ids)
        steps.append(time.perf_counter() - t)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    print(json.dumps({"tok_s": tokens / wall, "tok_cpu_s": tokens / cpu, "first_s": steps[0], "step_ms": 1e3 * statistics.median(steps[1:]),
                      "tokens": tokens, "steps": len(steps)}))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="BART checkpoint directory")
    p.add_argument("--a", required=True, help="checkout A (repository root)")
    p.add_argument("--b", required=True, help="checkout B (repository root)")
    p.add_argument("--quantization", choices=("int8",), help="quantization='int8' (default: float32)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return 0
    if args.rounds < 1 or args.threads < 1:
        p.error(f"--rounds and --threads must be >= 1, got {args.rounds} and {args.threads}")
    trees = {"A": str(Path(args.a).resolve()), "B": str(Path(args.b).resolve())}
    results: dict[str, list[dict]] = {k: [] for k in trees}
    loads = []
    for r in range(args.rounds):
        for name in (("A", "B") if r % 2 == 0 else ("B", "A")):
            cmd = [sys.executable, str(HERE / "ab_translation.py"), "--child", "--model", args.model, "--a", args.a,
                   "--b", args.b, "--threads", str(args.threads), "--seed", str(args.seed)]
            if args.quantization:
                cmd += ["--quantization", args.quantization]
            env = {**os.environ, "PYTHONPATH": trees[name]}
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                print(done.stderr[-3000:], file=sys.stderr)
                return 1
            results[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
            loads.append(os.getloadavg()[0])
            res = results[name][-1]
            print(f"round {r + 1} {name}: {res['tok_s']:.1f} tok/s, first step {res['first_s']:.2f} s, "
                  f"step {res['step_ms']:.1f} ms", flush=True)

    import torch

    sys.path.insert(0, str(HERE))
    from throughput import cpu_flags

    print(f"\nquantization={args.quantization}  threads={args.threads}  rounds={args.rounds}  torch={torch.__version__}")
    print(f"cpu_flags={cpu_flags()}  cpu_capability={torch.backends.cpu.get_cpu_capability()}  "
          f"cpu_count={os.cpu_count()}  load_avg_1min during rounds: {min(loads):.2f}-{max(loads):.2f}")
    print(f"A = {trees['A']}\nB = {trees['B']}\n")
    rows = [("tok/s", "tok_s", "{:.1f}", max), ("tok per CPU s", "tok_cpu_s", "{:.1f}", max), ("first step s", "first_s", "{:.3f}", min),
            ("later step ms (median)", "step_ms", "{:.1f}", min)]
    print(f"{'':24s} {'A best':>9s} {'A median':>9s} {'B best':>9s} {'B median':>9s} {'B/A best':>9s} {'B/A med':>8s}")
    for label, key, fmt, best in rows:
        a = [x[key] for x in results["A"]]
        b = [x[key] for x in results["B"]]
        cells = [best(a), statistics.median(a), best(b), statistics.median(b)]
        print(f"{label:24s} " + " ".join(f"{fmt.format(c):>9s}" for c in cells)
              + f" {best(b) / best(a):9.3f} {statistics.median(b) / statistics.median(a):8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
