"""The first step of ``LLM.generate`` over a batch of fresh prompts, timed alone.

That step runs the encoder over every prompt, then the decoder prompts' prefill:
with many short requests it is the step whose attention is made of the most
runs (``tandem/backends/sdpa_groups.py``). The script admits ``--prompts``
random token-id prompts of ``--min-len``-``--max-len`` tokens into one engine
(encoder and prefix caches off), times its first ``LLMEngine.step`` (wall and
``time.process_time``, which other jobs on a shared machine disturb less),
finishes the requests (``--max-tokens`` greedy tokens), and repeats
``--repeats`` times after one untimed warm-up. It checks that every repeat gave
the same tokens and prints their hash, so two versions can be compared.

    python benchmarks/first_step.py --model /tmp/ho/plain --threads 1 --prompts 128
"""

from __future__ import annotations

import argparse
import hashlib
import random
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a BART-family checkpoint directory")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--min-len", type=int, default=10)
    ap.add_argument("--max-len", type=int, default=30)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=1990, help="prompt token ids are drawn from 4..vocab-1")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from tandem import LLM, SamplingParams
    from tandem.core.sampling_params import RequestOutputKind

    llm = LLM(model=args.model, dtype="float32", device="cpu", seed=0, encoder_cache_blocks=0,
              prefix_cache_blocks=0)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [0] + [rng.randrange(4, args.vocab)
                                           for _ in range(rng.randint(args.min_len - 2, args.max_len - 2))] + [2]}
               for _ in range(args.prompts)]
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, min_tokens=args.max_tokens,
                        output_kind=RequestOutputKind.FINAL_ONLY)
    eng = llm.llm_engine
    walls, cpus, tokens = [], [], []
    for r in range(args.repeats + 1):
        with eng.core.adding():
            for i, p in enumerate(prompts):
                eng.add_request(f"{r}-{i}", p, sp)
        t, c = time.perf_counter(), time.process_time()
        eng.step()
        walls.append((time.perf_counter() - t) * 1e3)
        cpus.append((time.process_time() - c) * 1e3)
        done = []
        while eng.has_unfinished_requests():
            done += [o for o in eng.step() if o.finished]
        tokens.append(sorted((o.request_id.split("-")[1], tuple(o.outputs[0].token_ids)) for o in done))
    walls, cpus = walls[1:], cpus[1:]
    if any(t != tokens[0] for t in tokens):
        raise SystemExit("repeats gave different tokens")
    print(f"{args.model} threads={args.threads} prompts={args.prompts} len={args.min_len}-{args.max_len}: "
          f"first step wall ms min {min(walls):.2f} median {statistics.median(walls):.2f} | "
          f"CPU ms min {min(cpus):.2f} median {statistics.median(cpus):.2f} | "
          f"tokens {hashlib.md5(repr(tokens[0]).encode()).hexdigest()[:10]}")


if __name__ == "__main__":
    main()
