#!/usr/bin/env python
"""Which first tokens tandem samples, against what HF ``generate`` keeps and draws.

For each setting: ``--requests`` requests of ``n=--n`` with fixed seeds, one
encoder prompt, decoder prompt ``[2, 0]``, ``max_tokens=1``. The table shows
how many distinct tokens tandem drew, how many HF keeps (the support of HF
``generate``'s processed scores, ``output_scores``), how many HF itself drew
in as many samples, and tandem's total-variation distance (L1) from HF's exact
distribution with the bound a correct sampler stays under with probability
``1 - 1e-6`` (Bretagnolle-Huber-Carol, 24 bins; derived in
``tests/distribution.py``).

    python benchmarks/sampling_support.py                 # a random flat-tailed BART
    python benchmarks/sampling_support.py --model DIR     # any BART-family checkpoint
"""

from __future__ import annotations

import argparse
import math
import platform
import tempfile

import torch

SETTINGS = {
    "top_k=12": dict(top_k=12),
    "top_p=0.85": dict(top_p=0.85),
    "top_k=12, top_p=0.85": dict(top_k=12, top_p=0.85),
    "top_p=0.9, min_p=0.1": dict(top_p=0.9, min_p=0.1),
}
BINS, DELTA = 24, 1e-6


def random_bart(path: str, vocab: int, seed: int) -> str:
    from transformers import BartConfig, BartForConditionalGeneration

    torch.manual_seed(seed)
    config = BartConfig(vocab_size=vocab, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=128,
                        forced_eos_token_id=None, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
    model = BartForConditionalGeneration(config).eval()
    with torch.no_grad():  # narrow weights: a flat first-token distribution with a long tail
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.12)
        model.final_logits_bias.normal_(0.0, 0.5)
    model.save_pretrained(path)
    return path


def l1_and_bound(tokens: list[int], probs: torch.Tensor) -> tuple[float, float]:
    counts = torch.bincount(torch.tensor(tokens), minlength=probs.shape[0]).double() / len(tokens)
    order = torch.argsort(probs, descending=True)
    support = int((probs > 0).sum())
    solo = order[: min(support, BINS - 1)]
    rest = order[len(solo):]
    l1 = float((counts[solo] - probs[solo]).abs().sum() + (counts[rest].sum() - probs[rest].sum()).abs())
    bins = len(solo) + (1 if support > len(solo) else 0)
    return l1, math.sqrt(2 * (bins * math.log(2) + math.log(1 / DELTA)) / len(tokens))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint directory (default: a random BART made here)")
    ap.add_argument("--vocab", type=int, default=1000, help="vocabulary of the random BART")
    ap.add_argument("--requests", type=int, default=10)
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--encoder", default="0,15,38,81,120,2", help="encoder prompt token ids")
    args = ap.parse_args()

    from transformers import AutoModelForSeq2SeqLM

    from tandem import LLM, SamplingParams

    model_dir = args.model or random_bart(tempfile.mkdtemp(prefix="tandem-sampling-"), args.vocab, seed=5)
    encoder = [int(t) for t in args.encoder.split(",")]
    decoder = [2, 0]
    hf = AutoModelForSeq2SeqLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    llm = LLM(model=model_dir, dtype="float32", device="cpu")
    prompt = {"encoder_prompt": {"prompt_token_ids": encoder}, "decoder_prompt": {"prompt_token_ids": decoder}}
    flags = sorted({f for line in open("/proc/cpuinfo") if line.startswith("flags") for f in line.split()
                    if f.startswith(("avx2", "avx512_bf16", "amx"))}) if platform.system() == "Linux" else []
    print(f"# {args.requests} requests x n={args.n}, temperature {args.temperature}, first token; "
          f"torch {torch.__version__}, cpu_flags={','.join(flags)}, threads {torch.get_num_threads()}")
    print("| setting | tandem drew | HF keeps | HF drew | L1 to HF | bound (1e-6) |")
    print("|---|---|---|---|---|---|")
    for name, fields in SETTINGS.items():
        fields = dict(temperature=args.temperature, **fields)
        params = [SamplingParams(n=args.n, max_tokens=1, ignore_eos=True, seed=r, **fields) for r in range(args.requests)]
        outs = llm.generate([prompt] * args.requests, params, use_tqdm=False)
        drawn = [c.token_ids[0] for o in outs for c in o.outputs]
        hf_drawn = []
        for r in range(args.requests):
            torch.manual_seed(r)
            with torch.no_grad():
                gen = hf.generate(input_ids=torch.tensor([encoder]), decoder_input_ids=torch.tensor([decoder]),
                                  do_sample=True, max_new_tokens=1, num_return_sequences=args.n, output_scores=True,
                                  return_dict_in_generate=True, **{"top_k": 0, **fields})
            hf_drawn += gen.sequences[:, -1].tolist()
        exact = torch.softmax(gen.scores[0][0].double(), dim=-1)
        l1, bound = l1_and_bound(drawn, exact)
        print(f"| `{name}` | {len(set(drawn))} | {int((exact > 0).sum())} | {len(set(hf_drawn))} | {l1:.3f} | {bound:.3f} |")


if __name__ == "__main__":
    main()
