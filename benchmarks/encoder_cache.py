#!/usr/bin/env python
"""One document, many questions: tandem with its encoder cache or its prefix cache off and on.

``--docs`` documents (``--doc-len`` encoder tokens each, random seeded ids
wrapped as ``[bos] + ids + [eos]``) are each asked ``--questions`` questions:
decoder prompts ``[decoder_start, bos] + shots + q``, where ``shots``
(``--shots-len`` random ids, none by default) is the same for every question
and ``q`` (``--question-len`` ids) is each question's own; every request
generates exactly ``--new-tokens`` tokens greedily. The questions arrive in
rounds, as a client asking one after another would send them: call ``k`` of
``LLM.generate`` carries question ``k`` of every document (a batch of
``--docs`` requests over distinct documents, so no two requests in flight
share an encoder input and live sharing saves nothing).

``--cache encoder`` (the default) compares ``encoder_cache_blocks=0`` with the
default: with the cache off every request runs its encoder; with it on, only
the first question of each document does. The table counts encoder runs
(``get_stats()``).

``--cache prefix`` compares ``prefix_cache_blocks=0`` with the default, the
encoder cache on in both, so only the decoder prompt's work differs: with the
prefix cache off every request computes its whole decoder prompt; with it on,
a question after the first finds the shots' full blocks computed over its
document (a few-shot prompt over one document, or Whisper's fixed prompt over
one window, is the case it serves). Give it ``--shots-len``; the table counts
decoder prompt tokens computed (prompt tokens less ``prefix_cache_hit_tokens``).

Both engines load the same random checkpoint (``--make-model``, built as
``benchmarks/throughput.py`` builds it) in one process; each runs one warm-up
call, then the two take turns for ``--repeat`` rounds over fresh documents
(seeded by round, so the cache-on engine never starts warm). The table gives
the count above, the median wall time, output tokens per second and the on/off
ratio, and checks that both engines produced the same tokens.

    python benchmarks/encoder_cache.py --make-model base --docs 4 --questions 8
    python benchmarks/encoder_cache.py --cache prefix --make-model base --docs 4 --questions 8 \\
        --doc-len 256 --shots-len 384
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
REPO_ROOT = Path(__file__).resolve().parent.parent
try:
    import tandem  # noqa: F401 - an installed tandem wins
except ImportError:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

from throughput import MODEL_SIZES, cpu_flags, load_config, make_model, special_ids  # noqa: E402

# What each cache's off/on engines differ in, and what the table counts.
OPTION = {"encoder": "encoder_cache_blocks", "prefix": "prefix_cache_blocks"}
COUNTED = {"encoder": "encoder runs", "prefix": "decoder prompt tokens computed"}


def make_rounds(config, args, seed: int) -> list[list[dict]]:
    """``--questions`` calls, call ``k`` asking question ``k`` of every document."""
    rng = random.Random(f"{args.seed}-{seed}")
    vocab = [i for i in range(config.vocab_size) if i not in special_ids(config)]
    bos, eos, start = config.bos_token_id, config.eos_token_id, config.decoder_start_token_id
    docs = [[bos, *(rng.choice(vocab) for _ in range(args.doc_len - 2)), eos] for _ in range(args.docs)]
    shots = [rng.choice(vocab) for _ in range(args.shots_len)]
    return [
        [{"encoder_prompt": {"prompt_token_ids": doc},
          "decoder_prompt": {"prompt_token_ids": [start, bos, *shots,
                                                  *(rng.choice(vocab) for _ in range(args.question_len))]}}
         for doc in docs]
        for _ in range(args.questions)
    ]


def serve(llm, rounds: list[list[dict]], new_tokens: int, cache: str):
    """Wall time, the counted work (``COUNTED[cache]``) and the tokens of one pass."""
    from tandem import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, min_tokens=new_tokens)
    stat = "encoder_runs" if cache == "encoder" else "prefix_cache_hit_tokens"
    before = llm.get_stats()[stat]
    t0 = time.perf_counter()
    outs = [[list(o.outputs[0].token_ids) for o in llm.generate(r, params, use_tqdm=False)] for r in rounds]
    seconds = time.perf_counter() - t0
    delta = llm.get_stats()[stat] - before
    if cache == "prefix":
        delta = sum(len(p["decoder_prompt"]["prompt_token_ids"]) for r in rounds for p in r) - delta
    return seconds, delta, outs


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cache", choices=list(OPTION), default="encoder", help="which cache is off in one engine")
    p.add_argument("--make-model", default="base", choices=[k for k, v in MODEL_SIZES.items() if v.family == "bart"])
    p.add_argument("--model", help="a local BART checkpoint instead of a random one")
    p.add_argument("--docs", type=int, default=4)
    p.add_argument("--questions", type=int, default=8)
    p.add_argument("--doc-len", type=int, default=512, help="encoder tokens, bos and eos included")
    p.add_argument("--shots-len", type=int, default=0, help="few-shot decoder tokens every question shares")
    p.add_argument("--question-len", type=int, default=12)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--label", default="", help="a note for the table's title, e.g. 'under load'")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from tandem import LLM

    option = OPTION[args.cache]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or make_model(args.make_model, tmp, args.seed)
        config = load_config(model_dir)
        engines = {bound: LLM(model=model_dir, dtype=args.dtype, device=args.device, seed=args.seed,
                              **{option: bound}) for bound in (0, None)}
        warm = make_rounds(config, argparse.Namespace(**{**vars(args), "questions": 1, "docs": 1}), seed=-1)
        for llm in engines.values():
            serve(llm, warm, 2, args.cache)
        runs = {b: [] for b in engines}
        counted = {b: 0 for b in engines}
        outputs = {b: [] for b in engines}
        for r in range(args.repeat):
            rounds = make_rounds(config, args, seed=r)
            for bound in (engines if r % 2 == 0 else reversed(list(engines))):
                seconds, n, outs = serve(engines[bound], rounds, args.new_tokens, args.cache)
                runs[bound].append(seconds)
                counted[bound] += n
                outputs[bound].append(outs)

    n_req = args.docs * args.questions
    tokens = n_req * args.new_tokens
    prompt_len = 2 + args.shots_len + args.question_len
    of = n_req if args.cache == "encoder" else n_req * prompt_len
    title = f"{args.cache} cache, {args.docs} documents x {args.questions} questions"
    print(f"\n{title}{' (' + args.label + ')' if args.label else ''}")
    print(f"model: {args.model or 'random bart ' + args.make_model}, {args.dtype} on {args.device}; "
          f"doc {args.doc_len} tokens, decoder prompt {prompt_len} ({args.shots_len} shared), "
          f"{args.new_tokens} new tokens; median of {args.repeat} run(s); off/on: {option}=0 / default")
    print(f"cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, flags {cpu_flags()}, "
          f"torch threads {torch.get_num_threads()}, load avg {os.getloadavg()[0]:.2f}")
    print(f"| {args.cache} cache | {COUNTED[args.cache]} / round | seconds | output tok/s | vs off |")
    print("|---|---|---|---|---|")
    med = {b: statistics.median(v) for b, v in runs.items()}
    for bound, name in ((0, "off"), (None, "on")):
        print(f"| {name} | {counted[bound] / args.repeat:.0f} of {of} | {med[bound]:.2f} | "
              f"{tokens / med[bound]:.1f} | {med[0] / med[bound]:.2f}x |")
    same = outputs[0] == outputs[None]
    print(f"same tokens with the {args.cache} cache off and on: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
