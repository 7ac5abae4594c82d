#!/usr/bin/env python
"""Per-step cost of ``bad_words_ids``: tandem's batched processor against HF's
``NoBadWordsLogitsProcessor`` (called per request, as HF ``generate`` runs one
batch per call) and against the per-word loop tandem had before.

Each case is a step of ``--rows`` rows of vocabulary ``--vocab``, split into
requests of ``rows-per-request`` rows that share one ``SamplingParams``, each
request banning ``words`` multi-token words (``len`` tokens each), with
histories of 40 tokens of which a fraction end on a word's prefix. The table
gives the median milliseconds per step over ``--repeat`` steps and tandem's
speed-up; every step's scores are checked equal to HF's first.

    python benchmarks/bad_words.py
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import time

import torch

from tandem import SamplingParams
from tandem.core.worker.logits_processors import LogitsProcessors, ProcessorRows

CASES = [  # (requests, rows per request, words, word length)
    (1, 1, 4096, 2),
    (1, 8, 4096, 2),
    (32, 1, 4096, 2),
    (32, 4, 512, 5),
    (64, 1, 256, 17),
]
EOS = [2]


def cpu_flags() -> str:
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return platform.processor() or "unknown"
    keep = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")
    return " ".join(f for f in keep if f in flags) or "no avx2"


def per_word_loop(scores, params, history, lengths):
    """The previous processor: one set of tensor ops per word of every request."""
    for p, idx in params:
        words = [w for w in p.bad_words_ids if len(w) > 1]
        h, n = history[idx], lengths[idx]
        for w in words:
            k = len(w) - 1
            pos = (n[:, None] - k + torch.arange(k)[None, :]).clamp(min=0)
            hit = (n >= k) & (h.gather(1, pos) == torch.tensor(w[:-1])).all(dim=1)
            rows = [idx[j] for j in hit.nonzero().flatten().tolist()]
            if rows:
                scores[rows, w[-1]] = float("-inf")
    return scores


def build(case, vocab: int, rng: random.Random):
    requests, per, nwords, length = case
    params, rows_params, tokens = [], [], []
    for _ in range(requests):
        words = [[rng.randrange(3, 40) for _ in range(length)] for _ in range(nwords)]
        p = SamplingParams(bad_words_ids=words)
        idx = []
        for _ in range(per):
            toks = [rng.randrange(3, 40) for _ in range(40)]
            if rng.random() < 0.5:
                w = rng.choice(words)
                toks[-(length - 1):] = w[:-1]
            idx.append(len(tokens))
            tokens.append(toks)
            rows_params.append(p)
        params.append((p, idx))
    history = torch.tensor(tokens)
    lengths = torch.full((len(tokens),), history.shape[1])
    return params, rows_params, history, lengths


def timed(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=50265)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    from transformers import NoBadWordsLogitsProcessor

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU flags: {cpu_flags()}")
    print(f"{'requests x rows':>16} {'words x len':>12} {'tandem ms':>10} {'HF ms':>9} {'per-word ms':>12} "
          f"{'vs HF':>7} {'vs per-word':>12}")
    rng = random.Random(0)
    for case in CASES:
        params, rows_params, history, lengths = build(case, args.vocab, rng)
        scores = torch.randn(len(rows_params), args.vocab)
        procs = LogitsProcessors(EOS)
        batch = ProcessorRows(rows_params, [37] * len(rows_params), [40] * len(rows_params),
                              lambda idx: (history[idx], lengths[idx]))
        hf = [(NoBadWordsLogitsProcessor([list(w) for w in p.bad_words_ids], EOS), idx) for p, idx in params]

        def run_hf():
            return torch.cat([proc(history[idx], scores[idx].clone()) for proc, idx in hf])

        ours = procs(scores.clone(), batch)
        assert torch.equal(ours, run_hf()), "tandem differs from HF"
        assert torch.equal(ours, per_word_loop(scores.clone(), params, history, lengths))
        t_ours = timed(lambda: procs(scores.clone(), batch), args.repeat)
        t_hf = timed(run_hf, args.repeat)
        t_loop = timed(lambda: per_word_loop(scores.clone(), params, history, lengths), args.repeat)
        requests, per, nwords, length = case
        print(f"{f'{requests} x {per}':>16} {f'{nwords} x {length}':>12} {t_ours:>10.2f} {t_hf:>9.2f} {t_loop:>12.2f} "
              f"{t_hf / t_ours:>6.1f}x {t_loop / t_ours:>11.1f}x")


if __name__ == "__main__":
    main()
