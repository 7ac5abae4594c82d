"""Structured-output benchmark: output throughput of a batch of 1 and of 64 with
a realistic JSON schema (an invoice: nested objects, enums, arrays, numbers,
dates as strings with a pattern) against the same batch unconstrained, and the
time to compile the schema, cold and cached. Prints the CPU flags.

  python benchmarks/structured_output.py                       # defaults below
  python benchmarks/structured_output.py --batch-sizes 1,64 --max-tokens 64 --repeat 3
  python benchmarks/structured_output.py --batch-sizes 64 --profile   # where the step's time goes

The checkpoint is a seeded random BART (``--d-model``, ``--layers``) with a
byte-level BPE tokenizer trained here on Python's standard library sources
(``--vocab-size`` ids): the grammar's cost per step grows with the vocabulary
and with how many of its tokens are multi-character, so a tokenizer of a real
size and shape matters more than the weights do.

Every request decodes greedily with ``ignore_eos`` and ``max_tokens``: an
unconstrained row runs to ``max_tokens``; a constrained one does too unless its
grammar completes first (random weights rarely finish a whole invoice). So
throughput is compared per generated token, and each row's token count is
printed beside it. Encoder prompts are ``--input-len`` random token ids.

``--jump-forward`` measures jump-forward decoding instead (``docs/structured_output.md``):
the invoice schema served by an engine with jump-forward (the default) and one with
``structured_outputs_disable_jump_forward``, interleaved: forward passes (executor
steps that ran the model), generated tokens and throughput of each, and a JSON
summary (``--json PATH`` too) whose ``forward_passes_ratio`` is the passes with
over the passes without, summed over the batch sizes' runs. The schema is asked
with ``disable_any_whitespace`` (``--any-whitespace``: without; a random model
then spends its tokens on whitespace, which no grammar forces):

  python benchmarks/structured_output.py --jump-forward --batch-sizes 1,16 --json jump.json

Compile times: "cold" is the first compile of the schema in a fresh engine,
once the tokenizer's vocabulary table is built (that, once per engine, is
timed apart); "cached" is the same schema asked for again (tandem's cache by
spec: what every request after the first pays).
"""

from __future__ import annotations

import argparse
import cProfile
import importlib.metadata
import io
import json
import statistics
import os
import pstats
import random
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import cpu_flags  # noqa: E402

# An invoice as an accounting system would ask a model to extract it.
INVOICE_SCHEMA = {
    "type": "object",
    "properties": {
        "invoice_number": {"type": "string", "pattern": "^INV-[0-9]{4,8}$"},
        "issue_date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
        "due_date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
        "status": {"enum": ["draft", "sent", "paid", "overdue", "void"]},
        "currency": {"enum": ["EUR", "USD", "GBP", "JPY", "CHF"]},
        "seller": {"$ref": "#/$defs/party"},
        "buyer": {"$ref": "#/$defs/party"},
        "lines": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "properties": {
                    "description": {"type": "string", "maxLength": 80},
                    "quantity": {"type": "integer", "minimum": 1},
                    "unit_price": {"type": "number", "minimum": 0},
                    "tax_rate": {"enum": [0, 5, 10, 20]},
                },
                "required": ["description", "quantity", "unit_price", "tax_rate"],
                "additionalProperties": False,
            },
        },
        "total": {"type": "number", "minimum": 0},
        "paid": {"type": "boolean"},
        "notes": {"type": ["string", "null"]},
    },
    "required": ["invoice_number", "issue_date", "due_date", "status", "currency", "seller", "buyer", "lines",
                 "total", "paid"],
    "additionalProperties": False,
    "$defs": {
        "party": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "minLength": 1, "maxLength": 60},
                "vat_id": {"type": "string", "pattern": "^[A-Z]{2}[0-9A-Z]{8,12}$"},
                "address": {
                    "type": "object",
                    "properties": {
                        "street": {"type": "string"},
                        "city": {"type": "string"},
                        "postal_code": {"type": "string"},
                        "country": {"type": "string", "pattern": "^[A-Z]{2}$"},
                    },
                    "required": ["street", "city", "country"],
                    "additionalProperties": False,
                },
            },
            "required": ["name", "address"],
            "additionalProperties": False,
        }
    },
}


def make_tokenizer(out_dir: str, vocab_size: int, corpus_mb: float):
    """A byte-level BPE tokenizer (BART's special ids: <s>=0 <pad>=1 </s>=2 <unk>=3),
    trained on the first ``corpus_mb`` MB of the standard library's sources."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    texts, size = [], 0
    for p in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        if "test" in p.parts or size > corpus_mb * 1e6:
            continue
        texts.append(p.read_bytes().decode("utf-8", errors="replace"))
        size += len(texts[-1])
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(texts, vocab_size=vocab_size, min_frequency=2,
                            special_tokens=["<s>", "<pad>", "</s>", "<unk>"], show_progress=False)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, bos_token="<s>", eos_token="</s>",
                                  pad_token="<pad>", unk_token="<unk>")
    tok.save_pretrained(out_dir)
    return tok


def make_model(out_dir: str, args) -> int:
    """A seeded random BART with the tokenizer; returns its vocabulary size."""
    from transformers import BartConfig, BartForConditionalGeneration

    tok = make_tokenizer(out_dir, args.vocab_size, args.corpus_mb)
    vocab = len(tok.get_vocab())
    config = BartConfig(
        vocab_size=vocab, d_model=args.d_model, encoder_layers=args.layers, decoder_layers=args.layers,
        encoder_attention_heads=args.d_model // 64, decoder_attention_heads=args.d_model // 64,
        encoder_ffn_dim=4 * args.d_model, decoder_ffn_dim=4 * args.d_model, max_position_embeddings=1024,
        forced_eos_token_id=None, forced_bos_token_id=None,
    )
    torch.manual_seed(args.seed)
    BartForConditionalGeneration(config).eval().save_pretrained(out_dir)
    return vocab


def compile_times(model_dir: str, args) -> dict[str, float]:
    """Seconds: the vocabulary table (once per engine), the schema's first compile,
    and the same schema again (cached)."""
    from tandem import LLM, StructuredOutputsParams

    llm = LLM(model=model_dir, dtype=args.dtype, device="cpu", seed=args.seed)
    engine = llm.engine
    start = time.perf_counter()
    engine.compile_structured_outputs(StructuredOutputsParams(regex="a")).result()  # builds the table
    table = time.perf_counter() - start
    so = StructuredOutputsParams(json=INVOICE_SCHEMA)
    start = time.perf_counter()
    engine.compile_structured_outputs(so).result()
    cold = time.perf_counter() - start
    start = time.perf_counter()
    engine.compile_structured_outputs(StructuredOutputsParams(json=INVOICE_SCHEMA)).result()
    cached = time.perf_counter() - start
    engine.structured.shutdown()
    return {"vocabulary table": table, "cold": cold, "cached": cached}


def run_batch(llm, prompts, so, args, profile: bool = False) -> tuple[float, list[int]]:
    """Seconds for the batch, and each row's generated token count."""
    from tandem import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, structured_outputs=so)
    prof = cProfile.Profile() if profile else None
    start = time.perf_counter()
    if prof is not None:
        prof.enable()
    outs = llm.generate(prompts, params, use_tqdm=False)
    if prof is not None:
        prof.disable()
    seconds = time.perf_counter() - start
    for o in outs:
        if o.error is not None:
            raise RuntimeError(f"request failed: {o.error}")
    if prof is not None:
        print_profile(prof, seconds)
    return seconds, [len(o.outputs[0].token_ids) for o in outs]


def print_profile(prof: cProfile.Profile, seconds: float) -> None:
    """The structured-output parts of the step (cumulative seconds), then the top
    functions by own time."""
    stats = pstats.Stats(prof)
    parts = {
        "fill bitmask (manager.grammar_bitmask)": ("manager.py", "grammar_bitmask"),
        "apply bitmask (backend.apply_bitmask)": ("backend.py", "apply_bitmask"),
        "matchers advance (StructuredStrategy.update)": ("structured.py", "update"),
        "whole step (EngineCore.step)": ("engine_core.py", "step"),
    }
    print(f"\nprofile of the constrained batch ({seconds:.2f} s under cProfile):")
    for label, (file, name) in parts.items():
        cum = sum(v[3] for (f, _, fn), v in stats.stats.items() if f.endswith(file) and fn == name)
        print(f"  {label:<48} {cum:8.3f} s")
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(15)
    print("\n".join(out.getvalue().splitlines()[6:]))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-sizes", default="1,64", help="comma list (default 1,64)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens each request generates at most (default 64)")
    p.add_argument("--input-len", type=int, default=64, help="encoder prompt tokens (default 64)")
    p.add_argument("--repeat", type=int, default=3, help="timed runs of each case; the fastest is kept (default 3)")
    p.add_argument("--vocab-size", type=int, default=32000, help="BPE vocabulary to train (default 32000)")
    p.add_argument("--corpus-mb", type=float, default=8.0, help="stdlib source MB to train it on (default 8)")
    p.add_argument("--d-model", type=int, default=512, help="random BART width (default 512)")
    p.add_argument("--layers", type=int, default=6, help="encoder and decoder layers (default 6)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", help="a local BART checkpoint with a tokenizer, instead of the random one")
    p.add_argument("--profile", action="store_true", help="cProfile the largest constrained batch")
    p.add_argument("--jump-forward", action="store_true",
                   help="forward passes and throughput with jump-forward decoding against without")
    p.add_argument("--any-whitespace", action="store_true",
                   help="with --jump-forward: allow any whitespace between JSON tokens (default: "
                        "disable_any_whitespace, one way to write the JSON)")
    p.add_argument("--json", dest="json_path", help="with --jump-forward: also write the summary here")
    return p.parse_args(argv)


def counted(llm) -> list[int]:
    """Counts the engine's forward passes (executor steps that ran the model)."""
    ex = llm.engine.executor
    run, n = ex.execute_model, [0]

    def execute_model(*a, **k):
        result = run(*a, **k)
        n[0] += result is not None
        return result

    ex.execute_model = execute_model
    return n


def jump_forward(model_dir: str, args) -> dict:
    """The invoice batch by an engine with jump-forward and one without, interleaved:
    per batch size the forward passes, tokens and seconds of each (the best and the
    median of ``--repeat`` rounds for seconds; passes and tokens are the same each round)."""
    from tandem import LLM, SamplingParams, StructuredOutputsParams

    so = StructuredOutputsParams(json=INVOICE_SCHEMA, disable_any_whitespace=not args.any_whitespace)
    engines = {}
    for name, off in (("with", False), ("without", True)):
        llm = LLM(model=model_dir, dtype=args.dtype, device="cpu", seed=args.seed,
                  structured_outputs_disable_jump_forward=off)
        llm.generate([{"prompt_token_ids": [0, 5, 6, 2]}], SamplingParams(max_tokens=4, structured_outputs=so),
                     use_tqdm=False)  # warm-up and the compile
        engines[name] = (llm, counted(llm))
    vocab = engines["with"][0].engine.vocab_size
    rng = random.Random(args.seed)
    ids = [i for i in range(4, vocab)]
    rows = []
    for bs in [int(x) for x in args.batch_sizes.split(",")]:
        prompts = [{"prompt_token_ids": [0] + [rng.choice(ids) for _ in range(args.input_len - 2)] + [2]}
                   for _ in range(bs)]
        row = {"batch": bs}
        times: dict[str, list[float]] = {"with": [], "without": []}
        for _ in range(args.repeat):  # interleaved, so a burst of load hits both alike
            for name, (llm, passes) in engines.items():
                before, jumped = passes[0], llm.get_stats()["structured_jump_forward_tokens"]
                seconds, counts = run_batch(llm, prompts, so, args)
                times[name].append(seconds)
                row[f"{name}_passes"] = passes[0] - before
                row[f"{name}_tokens"] = sum(counts)
                row[f"{name}_jumped"] = llm.get_stats()["structured_jump_forward_tokens"] - jumped
        for name in engines:
            row[f"{name}_best_s"] = min(times[name])
            row[f"{name}_median_s"] = statistics.median(times[name])
            row[f"{name}_tok_s_best"] = row[f"{name}_tokens"] / row[f"{name}_best_s"]
        rows.append(row)
    passes_with = sum(r["with_passes"] for r in rows)
    passes_without = sum(r["without_passes"] for r in rows)
    return {
        "forward_passes_ratio": passes_with / passes_without,
        "tokens_per_pass_with": sum(r["with_tokens"] for r in rows) / passes_with,
        "tokens_per_pass_without": sum(r["without_tokens"] for r in rows) / passes_without,
        "throughput_ratio_best": (sum(r["with_tokens"] for r in rows) / sum(r["with_best_s"] for r in rows))
        / (sum(r["without_tokens"] for r in rows) / sum(r["without_best_s"] for r in rows)),
        "rows": rows,
        "settings": {"max_tokens": args.max_tokens, "input_len": args.input_len, "repeat": args.repeat,
                     "d_model": args.d_model, "layers": args.layers, "vocab_size": vocab, "dtype": args.dtype,
                     "disable_any_whitespace": not args.any_whitespace, "batch_sizes": args.batch_sizes},
        "machine": {"cpu_flags": cpu_flags(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                    "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                    "load_avg_1min": os.getloadavg()[0]},
    }


def print_jump_report(summary: dict) -> None:
    m, st = summary["machine"], summary["settings"]
    print(f"\ncpu_flags={m['cpu_flags']}  cpu_capability={m['cpu_capability']}  cpus={m['cpus']}  "
          f"torch_threads={m['torch_threads']}  load_avg_1min={m['load_avg_1min']:.2f}")
    print(f"invoice schema, disable_any_whitespace={st['disable_any_whitespace']}, greedy, ignore_eos, "
          f"max_tokens={st['max_tokens']}, input_len={st['input_len']}, {st['repeat']} interleaved rounds\n")
    print("| batch | passes with / without | tokens with / without | jumped | tok/s with (best, median s) "
          "| tok/s without (best, median s) |")
    print("|---|---|---|---|---|---|")
    for r in summary["rows"]:
        print(f"| {r['batch']} | {r['with_passes']} / {r['without_passes']} | {r['with_tokens']} / "
              f"{r['without_tokens']} | {r['with_jumped']} | {r['with_tok_s_best']:.1f} ({r['with_best_s']:.2f}, "
              f"{r['with_median_s']:.2f}) | {r['without_tok_s_best']:.1f} ({r['without_best_s']:.2f}, "
              f"{r['without_median_s']:.2f}) |")
    keys = ("forward_passes_ratio", "tokens_per_pass_with", "tokens_per_pass_without", "throughput_ratio_best")
    print("\n" + json.dumps({k: round(summary[k], 4) for k in keys}))


def main(argv=None) -> int:
    from tandem import LLM, SamplingParams, StructuredOutputsParams

    args = parse_args(argv)
    batch_sizes = [int(x) for x in args.batch_sizes.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or tmp
        if args.model is None:
            start = time.perf_counter()
            vocab = make_model(tmp, args)
            print(f"# random BART d_model={args.d_model} layers={args.layers}, byte-level BPE of {vocab} ids "
                  f"(built in {time.perf_counter() - start:.1f} s)")
        if args.jump_forward:
            summary = jump_forward(model_dir, args)
            print_jump_report(summary)
            if args.json_path:
                Path(args.json_path).write_text(json.dumps(summary, indent=2) + "\n")
            return 0
        compiles = compile_times(model_dir, args)
        llm = LLM(model=model_dir, dtype=args.dtype, device="cpu", seed=args.seed)
        vocab = llm.engine.vocab_size
        rng = random.Random(args.seed)
        special = {0, 1, 2, 3}
        ids = [i for i in range(vocab) if i not in special]
        so = StructuredOutputsParams(json=INVOICE_SCHEMA)
        # Warm-up: kernels, and the schema's compile (cached from here on).
        warm = [{"prompt_token_ids": [0] + rng.sample(ids, 8) + [2]} for _ in range(2)]
        llm.generate(warm, SamplingParams(max_tokens=4, structured_outputs=so), use_tqdm=False)
        rows = []
        for bs in batch_sizes:
            prompts = [{"prompt_token_ids": [0] + [rng.choice(ids) for _ in range(args.input_len - 2)] + [2]}
                       for _ in range(bs)]
            best: dict[str, tuple[float, list[int]]] = {}
            for _ in range(args.repeat):  # interleaved, so a burst of load hits both alike
                for name, spec in (("plain", None), ("invoice", so)):
                    seconds, counts = run_batch(llm, prompts, spec, args)
                    if name not in best or seconds < best[name][0]:
                        best[name] = (seconds, counts)
            rows.append((bs, best))
            if args.profile and bs == max(batch_sizes):
                run_batch(llm, prompts, so, args, profile=True)
    print_report(rows, compiles, args)
    return 0


def print_report(rows, compiles: dict[str, float], args) -> None:
    load = os.getloadavg()[0]
    print(f"\ncpu_flags={cpu_flags()}  cpu_capability={torch.backends.cpu.get_cpu_capability()}  "
          f"cpus={os.cpu_count()}  torch_threads={torch.get_num_threads()}  load_avg_1min={load:.2f}  "
          f"torch {torch.__version__}, xgrammar {importlib.metadata.version('xgrammar')}")
    print(f"max_tokens={args.max_tokens} input_len={args.input_len} dtype={args.dtype}, fastest of {args.repeat}\n")
    print("| batch | plain tok/s | invoice tok/s | constrained / plain | plain tokens | invoice tokens (min-max) |")
    print("|---|---|---|---|---|---|")
    for bs, best in rows:
        (ps, pc), (cs, cc) = best["plain"], best["invoice"]
        p_tps, c_tps = sum(pc) / ps, sum(cc) / cs
        print(f"| {bs} | {p_tps:.1f} | {c_tps:.1f} | {c_tps / p_tps:.3f} | {sum(pc)} | "
              f"{sum(cc)} ({min(cc)}-{max(cc)}) |")
    print("\n| invoice schema compile | seconds |")
    print("|---|---|")
    for name, seconds in compiles.items():
        print(f"| {name} | {seconds:.4f} |")


if __name__ == "__main__":
    raise SystemExit(main())
