"""What ``quantization="int8"`` costs in quality: greedy token agreement with float32.

Two checkpoints, both local (nothing is downloaded):

  demo        the shipped word-reversal model (tandem/demo_model): held-out
              sentences (tools/train_demo.py's generator, seed 98765); reports
              exact-match of the reversal and per-token agreement with fp32
  bart-base   a random bart-base-sized checkpoint (--model DIR, e.g. the one
              throughput.py --make-model base --save-model DIR writes): random
              token-id prompts, fixed-length greedy outputs; reports requests
              whose tokens equal fp32's exactly and the first-divergence step

  python benchmarks/int8_quality.py [--model /tmp/bench-base] [--num 200]
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))


def agreement(a: list[list[int]], b: list[list[int]]) -> tuple[int, float, float]:
    """(sequences equal, fraction of tokens equal before the first divergence, mean first-divergence step)."""
    same, prefix, first = 0, 0, []
    total = sum(len(x) for x in a)
    for x, y in zip(a, b):
        n = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
        same += x == y
        prefix += n
        first.append(n)
    return same, prefix / max(total, 1), sum(first) / len(first)


def main() -> None:
    from tandem import LLM, SamplingParams

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a bart-base-sized checkpoint directory (optional)")
    p.add_argument("--num", type=int, default=200)
    p.add_argument("--new-tokens", type=int, default=48)
    args = p.parse_args()
    print(f"# torch {torch.__version__}, capability {torch.backends.cpu.get_cpu_capability()}, "
          f"quantized engine {torch.backends.quantized.engine}")
    print(f"{'checkpoint':<11} {'requests':>8} {'int8 == fp32':>13} {'tokens before divergence':>25} "
          f"{'task exact (fp32 / int8)':>25}")

    from train_demo import heldout_sentences, reverse_words

    demo = str(ROOT / "tandem" / "demo_model")
    sentences = heldout_sentences(98765, args.num, exclude=set())
    params = SamplingParams(temperature=0.0, max_tokens=40)  # the demo has 64 decoder positions
    outs = {}
    for q in (None, "int8"):
        llm = LLM(model=demo, dtype="float32", device="cpu", quantization=q)
        outs[q] = llm.generate(sentences, params, use_tqdm=False)
    tok = {q: [list(o.outputs[0].token_ids) for o in v] for q, v in outs.items()}
    exact = {q: sum(o.outputs[0].text.strip() == reverse_words(s) for o, s in zip(v, sentences))
             for q, v in outs.items()}
    same, frac, _ = agreement(tok[None], tok["int8"])
    print(f"{'demo':<11} {len(sentences):>8} {same:>8}/{len(sentences):<4} {100 * frac:>24.1f}% "
          f"{exact[None]:>12} / {exact['int8']:<10}")

    if args.model:
        rng = random.Random(0)
        n = args.new_tokens
        prompts = [{"prompt_token_ids": [0, *[rng.randrange(4, 50000) for _ in range(rng.randint(8, 58))], 2]}
                   for _ in range(args.num)]
        params = SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n)
        tok = {}
        for q in (None, "int8"):
            llm = LLM(model=args.model, dtype="float32", device="cpu", quantization=q)
            tok[q] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
            del llm
        same, frac, first = agreement(tok[None], tok["int8"])
        print(f"{'bart-base':<11} {len(prompts):>8} {same:>8}/{len(prompts):<4} {100 * frac:>24.1f}% "
              f"{'-':>12}   (mean first divergence at step {first:.1f} of {n})")


if __name__ == "__main__":
    main()
