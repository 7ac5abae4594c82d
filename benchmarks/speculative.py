"""Speculative decoding: off against n-gram prompt lookup and a draft model, each
with k=2 and k=4, on the shipped demo model (``tandem/demo_model``: it reverses
the words of a sentence).

The draft model is a smaller model trained on the same task and vocabulary by
``tools/train_demo.py --draft`` (d_model 64 and ffn 256 against the target's
128 and 512): ``--draft DIR`` adds its rows, and trains it there first (about
10 minutes on a loaded 2-core CPU) when DIR holds no checkpoint yet.

The copy-heavy task: palindromic word sequences (``a b c d d c b a``), whose
reversal is a copy of the input, so prompt lookup over the encoder input
proposes what the model will write. Words are drawn (seeded) from the model's
vocabulary; each sentence has 6 or 8 words, within what the model was trained
on (3-8).

- batch-1 latency: each request alone (``max_num_seqs=1``), the median per
  request over all of them;
- batch-16 throughput: all requests in one ``generate`` call with
  ``max_num_seqs=16``, output tokens per second.

Greedy decoding. The configurations take turns, ``--repeat`` rounds each, and
the table gives each one's median; it also checks every configuration's
outputs equal speculation-off's, and prints the acceptance rate (draft tokens
accepted / proposed) and the mean accepted length (tokens a verifying
sequence step emits: accepted drafts + 1).

  python benchmarks/speculative.py              # 64 requests, 3 rounds
  python benchmarks/speculative.py --num-prompts 16 --repeat 1
  python benchmarks/speculative.py --draft /tmp/demo_draft   # + draft k=2 / k=4
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))
from throughput import cpu_flags  # noqa: E402

NGRAM = {
    "off": None,
    "ngram k=2": {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3},
    "ngram k=4": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3},
}


def draft_dir(path: Path) -> Path:
    """The draft checkpoint at ``path``, trained there first if it holds none."""
    if not (path / "config.json").is_file():
        sys.path.insert(0, str(ROOT / "tools"))
        import train_demo

        print(f"training the draft model into {path} (tools/train_demo.py --draft) ...", flush=True)
        if train_demo.main(["--draft", "--out", str(path)]) != 0:
            raise SystemExit(f"training the draft into {path} failed")
    return path


def palindromes(tokenizer, count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    words = [w for w, i in tokenizer.get_vocab().items() if i >= 4]
    out = []
    for _ in range(count):
        half = rng.sample(words, rng.choice([3, 4]))
        out.append(" ".join(half + half[::-1]))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--draft", type=Path, default=None,
                    help="the draft checkpoint for the draft-model rows, trained there if missing (default: none, "
                         "no draft rows)")
    args = ap.parse_args(argv)
    configs = dict(NGRAM)
    if args.draft is not None:
        draft = str(draft_dir(args.draft))
        configs["draft k=2"] = {"model": draft, "num_speculative_tokens": 2}
        configs["draft k=4"] = {"model": draft, "num_speculative_tokens": 4}

    import torch

    from tandem import LLM, SamplingParams

    model = str(ROOT / "tandem" / "demo_model")
    params = SamplingParams(temperature=0, max_tokens=16)
    engines = {
        (name, batch): LLM(model, device="cpu", dtype="float32", max_num_seqs=batch, speculative_config=spec)
        for name, spec in configs.items() for batch in (1, 16)
    }
    prompts = palindromes(engines[("off", 1)].get_tokenizer(), args.num_prompts, args.seed)
    for llm in engines.values():  # warm-up
        llm.generate(prompts[:2], params, use_tqdm=False)
    latency = {name: [] for name in configs}
    throughput = {name: [] for name in configs}
    outputs, tokens = {}, 0
    for _ in range(args.repeat):
        for name in configs:
            llm = engines[(name, 1)]
            for p in prompts:
                t = time.perf_counter()
                llm.generate([p], params, use_tqdm=False)
                latency[name].append(time.perf_counter() - t)
            llm = engines[(name, 16)]
            t = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - t
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            throughput[name].append(tokens / elapsed)
            outputs[name] = [o.outputs[0].token_ids for o in outs]

    copied = sum(o.outputs[0].text == p for o, p in zip(outs, prompts))
    print(f"model: tandem/demo_model (word reversal), {len(prompts)} palindromes, greedy, max_tokens 16; "
          f"{tokens} output tokens per batch run; {copied}/{len(prompts)} outputs copy their input")
    print(f"cpu flags: {cpu_flags()}; torch threads {torch.get_num_threads()}; cpu count {os.cpu_count()}; "
          f"load avg (1 min) {os.getloadavg()[0]:.2f}; {args.repeat} rounds, medians; "
          "measured under load (shared machine)")
    base_lat, base_tps = statistics.median(latency["off"]), statistics.median(throughput["off"])
    print(f"{'config':<10} {'b1 latency ms':>14} {'vs off':>7} {'b16 tok/s':>10} {'vs off':>7} "
          f"{'accept rate':>11} {'mean acc len':>12} {'same as off':>11}")
    for name in configs:
        lat, tps = statistics.median(latency[name]), statistics.median(throughput[name])
        s = engines[(name, 16)].get_stats()
        same = sum(a == b for a, b in zip(outputs[name], outputs["off"]))
        rate = f"{s['spec_acceptance_rate']:.2f}" if name != "off" else "-"
        length = f"{s['spec_mean_accepted_length']:.2f}" if name != "off" else "-"
        print(f"{name:<10} {lat * 1e3:>14.2f} {base_lat / lat:>6.2f}x {tps:>10.0f} {tps / base_tps:>6.2f}x "
              f"{rate:>11} {length:>12} {same:>5}/{len(prompts)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
