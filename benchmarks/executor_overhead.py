"""What the ``mp`` executor costs per step: TP=1 through one worker process against the
in-process executor, on the same bart-base-sized checkpoint, at batch 64.

Both engines are built once and alive together; they serve the same 64 requests
(random token ids, ``--encoder-len`` tokens each, exactly ``--new-tokens`` greedy
tokens) in alternating rounds, and each step's wall time is taken around
``LLMEngine.step()``. The figure per engine is the median decode step (the
admission step, where every encoder runs, is reported apart), the smallest
median over ``--rounds`` rounds after a full warm-up round (the least disturbed
by other load on the machine). Overhead = mp / in-process - 1.

    python benchmarks/executor_overhead.py                      # random bart-base (d_model 768, 6+6 layers)
    python benchmarks/executor_overhead.py --model facebook/bart-base --device cuda
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

BART_BASE = dict(vocab_size=50265, d_model=768, encoder_layers=6, decoder_layers=6, encoder_attention_heads=12,
                 decoder_attention_heads=12, encoder_ffn_dim=3072, decoder_ffn_dim=3072, max_position_embeddings=1024)


def random_bart_base(path: Path) -> Path:
    """A random checkpoint with bart-base's shapes (the weights do not change the cost)."""
    import torch
    from transformers import BartConfig, BartForConditionalGeneration

    if (path / "config.json").exists():
        return path
    torch.manual_seed(0)
    model = BartForConditionalGeneration(BartConfig(**BART_BASE, forced_eos_token_id=None)).eval()
    model.save_pretrained(path)
    return path


def run_round(llm, prompts, params) -> tuple[float, list[float]]:
    """(admission step seconds, decode step seconds) for one pass over the requests."""
    engine = llm.llm_engine
    for i, p in enumerate(prompts):
        engine.add_request(f"r{time.monotonic_ns()}-{i}", p, params)
    times = []
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    return times[0], times[1:]


def cpu_flags() -> str:
    try:
        out = subprocess.run("grep -o -E 'avx512[a-z_0-9]*|avx2|fma|amx[a-z_0-9]*' /proc/cpuinfo | sort -u",
                             shell=True, capture_output=True, text=True).stdout.split()
        return " ".join(out)
    except OSError:
        return "?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint (default: a random bart-base-sized one)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--encoder-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args()

    from tandem import LLM, SamplingParams

    model = args.model or str(random_bart_base(Path(tempfile.gettempdir()) / "tandem-bart-base-random"))
    kw = dict(model=model, dtype=args.dtype, device=args.device, max_num_seqs=args.batch)
    engines = {"in-process": LLM(**kw), "mp (TP=1)": LLM(**kw, distributed_executor_backend="mp")}
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [0, *(rng.randrange(4, 50000) for _ in range(args.encoder_len - 2)), 2]}
               for _ in range(args.batch)]
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, min_tokens=args.new_tokens)
    for llm in engines.values():  # warm up: a full round, so every step's buffers have been allocated once
        run_round(llm, prompts, params)
    decode = {k: [] for k in engines}
    admit = {k: [] for k in engines}
    for _ in range(args.rounds):
        for name, llm in engines.items():
            first, rest = run_round(llm, prompts, params)
            admit[name].append(first)
            decode[name].append(statistics.median(rest))
    engines["mp (TP=1)"].llm_engine.shutdown()
    base_d, base_a = min(decode["in-process"]), min(admit["in-process"])
    print(f"batch {args.batch}, encoder {args.encoder_len} tokens, {args.new_tokens} new tokens, {args.dtype} on "
          f"{args.device}; CPU flags: {cpu_flags()}")
    print("| executor | decode step (ms, median) | overhead | admission step (ms) | overhead |\n|---|---|---|---|---|")
    rows = {}
    for name in engines:
        d, a = min(decode[name]), min(admit[name])
        rows[name] = {"decode_ms": d * 1e3, "admission_ms": a * 1e3}
        print(f"| {name} | {d * 1e3:.1f} | {d / base_d - 1:+.1%} | {a * 1e3:.0f} | {a / base_a - 1:+.1%} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "cpu_flags": cpu_flags(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
