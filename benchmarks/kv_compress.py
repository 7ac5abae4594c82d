"""kv_compress: quality and memory of cross-attention KV compression, with against without.

Families and workloads (nothing downloaded):

  whisper  the shipped demo Whisper (tandem/demo_whisper), ``--num-sentences`` tone-speech
           sentences (default 200) of 1-8 of its 20 words drawn with ``random.Random(seed)``,
           synthesized by ``tones.synthesize`` as its tests do; ``LLM.transcribe``, greedy.
           "exact": the transcript equals the sentence.
  bart     the shipped demo BART (tandem/demo_model), its demo sentences joined 3-5 at a time
           (longer inputs; its block size is 4 here so a 20-40 token input spans blocks),
           greedy ``generate``. "exact": the same tokens as without compression.
  t5       a tiny random t5-small-shaped checkpoint (tests/helpers.make_t5), the same
           inputs as bart, greedy: logprob divergence only (random weights: no "right" text).

Reported per family: exact outputs with and without compression, outputs identical to the
uncompressed run, the mean |per-token logprob difference| over the outputs whose tokens are
identical (the divergence), cross-attention blocks per request (each request's cross table at
its last step: compressed once its window ended, full if it finished first), and the largest
batch that fits a fixed pool: ``--batch-requests`` requests submitted at once to a pool of
``--pool-requests`` full-length requests' blocks, decoding ``--batch-tokens`` tokens each
(``min_tokens`` = ``max_tokens``), the peak number running together; where the backend reads
per-head budgets, how many (layer, KV head)s kept fewer positions than the uniform count
(``heads_below_uniform_count``).

JSON keys (Whisper, default settings): ``exact_ratio`` (exact with / exact without),
``cross_blocks_ratio`` (blocks per request with / without), ``max_batch_ratio`` (peak batch
with / without); per family the same under ``families``.

  python benchmarks/kv_compress.py --json /tmp/kv_compress.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import tandem  # noqa: E402
from tandem import LLM, SamplingParams  # noqa: E402
from tandem.core.kv_compress_config import KVCompressConfig  # noqa: E402
from tandem.demo_whisper import PATH as WHISPER, WORDS, synthesize  # noqa: E402

BART = Path(tandem.__file__).parent / "demo_model"


def cpu_flags() -> str:
    cap = torch.backends.cpu.get_cpu_capability()
    flags = set()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    shown = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "fma") if f in flags]
    return f"torch cpu capability {cap}; flags {' '.join(shown) or 'n/a'}; {os.cpu_count()} cpus; load {os.getloadavg()}"


class Recorder:
    """Wraps the engine's ``schedule`` to record each request's cross blocks at its last
    step and the peak number of running groups."""

    def __init__(self, llm: LLM) -> None:
        engine = llm.llm_engine
        self.bm, self.sched = engine.block_manager, engine.scheduler
        self.blocks: dict[str, int] = {}
        self.self_blocks: dict[str, int] = {}  # decoder self-attention blocks, all sequences
        self.peak = 0
        inner = self.sched.schedule

        def schedule():
            out = inner()
            self.peak = max(self.peak, len(self.sched.running))
            for rid, group in self.sched.groups.items():
                if self.bm.cross_device(group) is not None:
                    self.blocks[rid] = len(self.bm.get_cross_block_table(group))
                    self.self_blocks[rid] = self.bm.group_blocks(group) - self.blocks[rid]
            return out

        self.sched.schedule = schedule
        # Per head: how many (layer, KV head)s kept fewer positions than the uniform count.
        self.heads_below, self.heads = 0, 0
        worker = getattr(getattr(engine.executor, "rank_worker", None), "worker", None)
        compressor = getattr(worker, "cross_compress", None)
        if compressor is not None and compressor.per_head:
            choose = compressor.kept_per_head

            def kept_per_head(repack):
                kept = choose(repack)
                lens = [len(p) for heads in kept for p in heads]
                self.heads_below += sum(n < repack.dst_positions for n in lens)
                self.heads += len(lens)
                return kept

            compressor.kept_per_head = kept_per_head


def text_prompts() -> list[str]:
    sentences = [s["input"] for s in json.loads((BART / "demo_sentences.json").read_text())]
    return [" ".join(sentences[(i + j) % len(sentences)] for j in range(3 + i % 3)) for i in range(40)]


def run_family(name: str, model: str, prompts, kv, args, expected=None, block_size=16) -> dict:
    """One configuration (``kv`` None: off): outputs, exactness, blocks, peak batch."""
    common = dict(model=model, dtype="float32", device="cpu", block_size=block_size, kv_compress=kv,
                  encoder_cache_blocks=0, attention_backend=args.attention_backend, num_kv_blocks=4096,
                  swap_space=0.05)
    llm = LLM(**common)
    rec = Recorder(llm)
    t = time.perf_counter()
    if name == "whisper":
        outs = llm.transcribe(prompts, use_tqdm=False)
        texts = [o.text.strip() for o in outs]
        lp = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=40, logprobs=0), use_tqdm=False)
    else:
        lp = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=40, logprobs=0), use_tqdm=False)
        texts = [o.outputs[0].text for o in lp]
    seconds = time.perf_counter() - t
    tokens = [o.outputs[0].token_ids for o in lp]
    logprobs = [[next(iter(d.values())).logprob if hasattr(next(iter(d.values())), "logprob")
                 else next(iter(d.values())) for d in o.outputs[0].logprobs] for o in lp]
    exact = sum(t == e for t, e in zip(texts, expected)) if expected is not None else None
    blocks = statistics.mean(rec.blocks.values())
    # The largest batch: a pool of pool_requests full requests' blocks, all submitted at once.
    full = max(rec.blocks.values()) if kv is None else None
    return dict(texts=texts, tokens=tokens, logprobs=logprobs, exact=exact, blocks=blocks, seconds=seconds,
                full_blocks=full, self_blocks=statistics.mean(rec.self_blocks.values()),
                heads_below=f"{rec.heads_below} of {rec.heads}" if rec.heads else None)


def peak_batch(name: str, model: str, prompts, kv, pool_blocks: int, args, block_size=16) -> int:
    llm = LLM(model=model, dtype="float32", device="cpu", block_size=block_size, kv_compress=kv,
              encoder_cache_blocks=0, num_kv_blocks=pool_blocks, max_num_seqs=256, swap_space=0.05,
              attention_backend=args.attention_backend)
    rec = Recorder(llm)
    n = args.batch_tokens
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n), use_tqdm=False)
    return rec.peak


def divergence(base: dict, comp: dict) -> tuple[int, float | None]:
    same = [i for i, (a, b) in enumerate(zip(base["tokens"], comp["tokens"])) if a == b]
    diffs = [abs(x - y) for i in same for x, y in zip(base["logprobs"][i], comp["logprobs"][i])]
    return len(same), (statistics.mean(diffs) if diffs else None)


def family(name, model, prompts, kv, args, expected=None, block_size=16, batch=True) -> dict:
    base = run_family(name, model, prompts, None, args, expected, block_size)
    comp = run_family(name, model, prompts, kv, args, expected, block_size)
    same, div = divergence(base, comp)
    row = dict(requests=len(prompts), exact_without=base["exact"], exact_with=comp["exact"],
               identical_to_uncompressed=same, logprob_divergence=div,
               cross_blocks_without=base["blocks"], cross_blocks_with=comp["blocks"],
               cross_blocks_ratio=comp["blocks"] / base["blocks"], self_blocks=base["self_blocks"],
               seconds_without=round(base["seconds"], 2), seconds_with=round(comp["seconds"], 2),
               heads_below_uniform_count=comp["heads_below"])
    if base["exact"]:
        row["exact_ratio"] = comp["exact"] / base["exact"]
    if batch:
        pool = args.pool_requests * (base["full_blocks"] + 2)
        many = (prompts * (1 + args.batch_requests // len(prompts)))[: args.batch_requests]
        row["pool_blocks"] = pool
        row["max_batch_without"] = peak_batch(name, model, many, None, pool, args, block_size)
        row["max_batch_with"] = peak_batch(name, model, many, kv, pool, args, block_size)
        row["max_batch_ratio"] = row["max_batch_with"] / row["max_batch_without"]
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", help="write the results here")
    p.add_argument("--num-sentences", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-compress", default=None, help="settings as JSON (default: the defaults)")
    p.add_argument("--batch-requests", type=int, default=64)
    p.add_argument("--pool-requests", type=int, default=8)
    p.add_argument("--batch-tokens", type=int, default=24)
    p.add_argument("--attention-backend", default=None)
    p.add_argument("--families", default="whisper,bart,t5")
    args = p.parse_args(argv)
    kv = json.loads(args.kv_compress) if args.kv_compress else True
    cfg = KVCompressConfig.parse(kv)
    print(f"kv_compress: keep_fraction={cfg.keep_fraction} window={cfg.window} min_keep={cfg.min_keep}")
    print(cpu_flags())
    results = {"settings": vars(cfg), "cpu": cpu_flags(), "torch": torch.__version__, "families": {}}
    fams = args.families.split(",")

    def done(name: str, row: dict) -> None:  # printed and saved as each family ends
        results["families"][name] = row
        print(f"\n{name}:", flush=True)
        for k, v in row.items():
            print(f"  {k:28s} {v:.4g}" if isinstance(v, float) else f"  {k:28s} {v}", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2))

    if "whisper" in fams:
        rng = random.Random(args.seed)
        sentences = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 8))) for _ in range(args.num_sentences)]
        clips = [{"audio": synthesize(s, seed=i), "sampling_rate": 16000} for i, s in enumerate(sentences)]
        done("whisper", family("whisper", str(WHISPER), clips, kv, args, expected=sentences))
    small = dict(kv) if isinstance(kv, dict) else {}
    small.setdefault("min_keep", 1)  # short text inputs: the 32-position floor would keep them whole
    if "bart" in fams:
        done("bart", family("bart", str(BART), text_prompts(), small, args, block_size=4))
    if "t5" in fams:
        from tests.helpers import make_t5

        with tempfile.TemporaryDirectory() as d:
            t5 = make_t5("t5-small", Path(d) / "t5", calm=True)
            # No tokenizer: token-id inputs of the same lengths as bart's (20-40 tokens).
            rng = random.Random(args.seed)
            vocab = json.loads((t5 / "config.json").read_text())["vocab_size"]
            ids = [{"prompt_token_ids": [rng.randrange(3, min(100, vocab)) for _ in range(rng.randint(20, 40))] + [1]}
                   for _ in range(40)]
            done("t5", family("t5", str(t5), ids, small, args, block_size=4, batch=False))
    w = results["families"].get("whisper", {})
    for key in ("exact_ratio", "cross_blocks_ratio", "max_batch_ratio"):
        results[key] = w.get(key)
    print(f"\nwhisper: exact_ratio {w.get('exact_ratio')} cross_blocks_ratio {w.get('cross_blocks_ratio')} "
          f"max_batch_ratio {w.get('max_batch_ratio')}")
    print(f"uptime: {os.popen('uptime').read().strip()}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
