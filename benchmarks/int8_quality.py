"""What ``quantization="int8"`` costs in quality: greedy token agreement with float32.

Checkpoints, all local (nothing is downloaded):

  demo        the shipped word-reversal model (tandem/demo_model): held-out
              sentences (tools/train_demo.py's generator, seed 98765); reports
              exact-match of the reversal and per-token agreement with fp32
  bart-base   a random bart-base-sized checkpoint (--model DIR, e.g. the one
              throughput.py --make-model base --save-model DIR writes): random
              token-id prompts, fixed-length greedy outputs; reports requests
              whose tokens equal fp32's exactly and the first-divergence step

Each row compares an int8 variant with float32 on the same requests: tandem's
int8 (every linear layer and the LM head) and int8 with the LM head put back in
float32, which isolates what quantizing the head costs. Besides exact greedy
agreement it reports, over the steps before the first divergence, how often
the top-k token set (logprobs=k) is the same and the mean |difference| of the
chosen token's logprob: a random checkpoint tends to repeat one dominant token,
so its equal sequences alone prove little.

  whisper     (--whisper) the shipped demo Whisper (tandem/demo_whisper, trained
              on tone speech): seeded sentences of its 20 words, synthesized;
              reports exact transcripts and agreement with fp32 as for demo

  python benchmarks/int8_quality.py [--model /tmp/bench-base] [--num 200] [--whisper]
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


def logprob_drift(ref, other, k: int) -> tuple[float, float]:
    """Over the steps before each request's first divergence: the fraction whose
    top-k token set is the same in both runs, and the mean |difference| of the
    chosen token's logprob. A random checkpoint's greedy argmax can be one
    dominant token (the tied embedding echoes the input), so equal sequences
    alone say little; the top-k tail and the logprobs show how far int8 moved
    the distribution."""
    steps = same_topk = 0
    drift = 0.0
    for r, o in zip(ref, other):
        a, b = r.outputs[0], o.outputs[0]
        for tok_a, tok_b, lp_a, lp_b in zip(a.token_ids, b.token_ids, a.logprobs, b.logprobs):
            if tok_a != tok_b:
                break
            top_a = sorted(lp_a, key=lp_a.get, reverse=True)[:k]
            top_b = sorted(lp_b, key=lp_b.get, reverse=True)[:k]
            steps += 1
            same_topk += set(top_a) == set(top_b)
            drift += abs(lp_a[tok_a] - lp_b[tok_b])
    return same_topk / max(steps, 1), drift / max(steps, 1)


VARIANTS = {"int8": "int8 (linear layers + LM head)", "int8-fp32-head": "int8, LM head kept fp32"}


def build(model: str, variant: str | None):
    """fp32 (None), tandem's int8, or int8 with the LM head swapped back to a
    dense fp32 GEMM, to show what quantizing the head itself costs."""
    from tandem import LLM
    from tandem.core.layers.embedding import VocabParallelEmbedding
    from tandem.core.layers.linear_kernels import DenseKernel

    llm = LLM(model=model, dtype="float32", device="cpu", quantization=None if variant is None else "int8")
    if variant == "int8-fp32-head":
        for module in llm.llm_engine.model.modules():
            if isinstance(module, VocabParallelEmbedding) and module.logits_kernel is not None:
                module.logits_kernel = DenseKernel()
    return llm


def main() -> None:
    from tandem import SamplingParams

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a bart-base-sized checkpoint directory (optional)")
    p.add_argument("--num", type=int, default=200)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--topk", type=int, default=5, help="logprobs asked for (the top-k agreement column)")
    p.add_argument("--whisper", action="store_true",
                   help="also the demo Whisper (tandem/demo_whisper): int8 on synthesized tone speech")
    args = p.parse_args()
    k = args.topk
    print(f"# torch {torch.__version__}, capability {torch.backends.cpu.get_cpu_capability()}, "
          f"quantized engine {torch.backends.quantized.engine}; int8 = every linear layer and the LM head")
    print(f"{'checkpoint':<11} {'requests':>8} {'int8 == fp32':>13} {'tokens before divergence':>25} "
          f"{f'same top-{k}':>10} {'mean |dlogprob|':>16} {'task exact (fp32 / int8)':>25} variant")

    if args.whisper:
        whisper_rows(args.num, k)

    from train_demo import heldout_sentences, reverse_words

    demo = str(ROOT / "tandem" / "demo_model")
    sentences = heldout_sentences(98765, args.num, exclude=set())
    params = SamplingParams(temperature=0.0, max_tokens=40, logprobs=k)  # the demo has 64 decoder positions
    outs = {q: build(demo, q).generate(sentences, params, use_tqdm=False) for q in (None, *VARIANTS)}
    exact = {q: sum(o.outputs[0].text.strip() == reverse_words(s) for o, s in zip(v, sentences))
             for q, v in outs.items()}
    for q, label in VARIANTS.items():
        same, frac, _ = agreement(*([list(o.outputs[0].token_ids) for o in outs[x]] for x in (None, q)))
        topk, drift = logprob_drift(outs[None], outs[q], k)
        print(f"{'demo':<11} {len(sentences):>8} {same:>8}/{len(sentences):<4} {100 * frac:>24.1f}% "
              f"{100 * topk:>9.1f}% {drift:>16.4f} {exact[None]:>12} / {exact[q]:<10} {label}")

    if args.model:
        rng = random.Random(0)
        n = args.new_tokens
        prompts = [{"prompt_token_ids": [0, *[rng.randrange(4, 50000) for _ in range(rng.randint(8, 58))], 2]}
                   for _ in range(args.num)]
        params = SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, logprobs=k)
        outs = {}
        for q in (None, *VARIANTS):
            llm = build(args.model, q)
            outs[q] = llm.generate(prompts, params, use_tqdm=False)
            del llm
        distinct = sum(len(set(o.outputs[0].token_ids)) for o in outs[None]) / len(outs[None])
        first = {}
        for q, label in VARIANTS.items():
            same, frac, first[q] = agreement(*([list(o.outputs[0].token_ids) for o in outs[x]] for x in (None, q)))
            topk, drift = logprob_drift(outs[None], outs[q], k)
            print(f"{'bart-base':<11} {len(prompts):>8} {same:>8}/{len(prompts):<4} {100 * frac:>24.1f}% "
                  f"{100 * topk:>9.1f}% {drift:>16.4f} {'-':>25} {label}")
        print(f"# bart-base: fp32 outputs hold {distinct:.1f} distinct tokens per request of {n}; mean first "
              "divergence at step " + ", ".join(f"{first[q]:.1f} ({q})" for q in VARIANTS))

def whisper_rows(num: int, k: int) -> None:
    """``--whisper``: the shipped demo Whisper (trained on tone speech) on seeded
    sentences of its 20 words (2-8 words, ``synthesize(text, seed=i)``): greedy
    ``generate`` on the audio with ``transcribe``'s English prompt, int8 against float32."""
    from tandem import SamplingParams
    from tandem.demo_whisper import PATH, WORDS, synthesize

    rng = random.Random(4321)
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 8))) for _ in range(num)]
    from transformers import GenerationConfig

    g = GenerationConfig.from_pretrained(PATH)  # transcribe's prompt: <|sot|> <|en|> <|transcribe|> <|notimestamps|>
    decoder = [g.decoder_start_token_id, g.lang_to_id["<|en|>"], g.task_to_id["transcribe"], g.no_timestamps_token_id]
    prompts = [{"encoder_prompt": {"audio": synthesize(t, seed=i), "sampling_rate": 16000},
                "decoder_prompt": {"prompt_token_ids": decoder}} for i, t in enumerate(texts)]
    params = SamplingParams(temperature=0.0, max_tokens=40, logprobs=k)
    outs = {q: build(str(PATH), q).generate(prompts, params, use_tqdm=False) for q in (None, *VARIANTS)}
    exact = {q: sum(o.outputs[0].text.strip() == t for o, t in zip(v, texts)) for q, v in outs.items()}
    for q, label in VARIANTS.items():
        same, frac, _ = agreement(*([list(o.outputs[0].token_ids) for o in outs[x]] for x in (None, q)))
        topk, drift = logprob_drift(outs[None], outs[q], k)
        print(f"{'whisper':<11} {num:>8} {same:>8}/{num:<4} {100 * frac:>24.1f}% "
              f"{100 * topk:>9.1f}% {drift:>16.4f} {exact[None]:>12} / {exact[q]:<10} {label}")


if __name__ == "__main__":
    main()
