"""Host overhead: a model so small that each engine's own work per step is what is timed.

Issue 49's workload. A seeded random BART with almost no arithmetic (d_model 64,
2 encoder + 2 decoder layers, 4 heads, FFN 256, vocab 2,000; made with
transformers ``BartConfig`` and ``save_pretrained``), so a decode step's time is
the engine's scheduling, input building, sampling and output handling, per step
and per row. Variants (``--variants``, default all three):

  plain   256 requests (encoder 10-30 random tokens, bos/eos included) submitted at
          once, 64 new tokens each, greedy
  bans    the same, on a copy of the checkpoint whose generation_config.json sets 90
          ``suppress_tokens`` and ``no_repeat_ngram_size=3`` (as Whisper and BART-CNN
          checkpoints do); each engine gets them the way its users do: tandem and HF
          ``generate`` read generation_config.json, CTranslate2 is given
          ``suppress_sequences`` (one token each) and ``no_repeat_ngram_size``
  beam4   64 requests, beam search with 4 beams (256 rows a step), 64 new tokens,
          length_penalty 1, the best beam returned

Lengths are fixed, so every engine does the same work: tandem ``min_tokens ==
max_tokens``, HF ``min_new_tokens == max_new_tokens``, CTranslate2
``min_decoding_length == max_decoding_length``; with beams every hypothesis then
ends at the same length and early stopping cannot cut a search short.

Engines (``--engines``): tandem (``LLM.generate``, float32, CPU, encoder and prefix
caches off because every round serves the same requests; one engine on ``--threads``
threads and ``data_parallel_size`` replicas sharing them, each divisor of the threads:
1x2 and 2x1 for 2; its fastest kept), HF ``generate`` (requests
sorted by length, right-padded, in batches: all requests in one batch and the smaller
``--hf-batch-sizes``, its fastest kept), CTranslate2 (``translate_batch`` over all
requests with each ``--ct2-batch-sizes`` as ``max_batch_size``, 256 included, times the
thread layouts ``intra x inter`` of ``--threads``: 2x1 and 1x2 for 2; its fastest kept).
Each engine runs in a process of its own per variant (benchmarks/engine_procs.py,
``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS`` at ``--threads``), so no two engines share an
allocator or a thread pool; the clock runs in that process around the one call
serving the workload. Rounds are interleaved (benchmarks/rounds.py: round 1 tries
every setting, engines taking turns; later rounds run each engine's kept setting),
and the table gives the best and the median of the kept setting's runs.

Figures: microseconds per generated token (run seconds over requests x new tokens;
beams other than the returned one are not counted), lower is better, and tandem's
time over CTranslate2's and over HF's (above 1: tandem slower). "ms/position" is
the run's time over the new tokens: the time of one step over all rows when the
engine runs every request in one batch. "same as HF" counts requests whose tokens
equal HF's; for the plain variant (greedy) the first ``--check`` requests must
equal HF's on tandem (a correctness guard: the script exits 1 when they do not).

Python calls per decode step (tandem): after the rounds, tandem's process serves the
variant again at each ``--count-rows`` rows (requests = rows / beams), steps it
through ``LLMEngine.step`` until every request runs and nothing waits, skips
``--skip-steps`` more, then counts ``sys.setprofile`` "call" events (Python
functions) and "c_call" events (C functions and builtins) over ``--count-steps``
steady-state decode steps of this thread; the median step is reported, and "per
row" is the growth between the smallest and the largest row count.

Examples (from the repository root):

  python benchmarks/host_overhead.py                       # the issue's workload, 3 rounds
  python benchmarks/host_overhead.py --quick               # smoke run (about a minute)
  python benchmarks/host_overhead.py --variants plain --engines tandem,ct2 --rounds 5
  python benchmarks/host_overhead.py --json host.json
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
import engine_procs  # noqa: E402
import rounds  # noqa: E402
import throughput  # noqa: E402  (requests, CTranslate2 conversion, HF batching, cpu flags)
from throughput import Requests, Workload  # noqa: E402

ENGINES = ("tandem", "hf", "ct2")
VARIANTS = ("plain", "bans", "beam4")
MODEL_CONFIG = dict(
    d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
    encoder_ffn_dim=256, decoder_ffn_dim=256, vocab_size=2000, max_position_embeddings=256,
)
NUM_BANNED = 90  # suppress_tokens in the bans variant's generation_config.json
NO_REPEAT_NGRAM = 3
MIN_ENCODER, MAX_ENCODER = 10, 30  # encoder tokens, bos and eos included


# --------------------------------------------------------------------------
# Checkpoints and requests
# --------------------------------------------------------------------------


def make_checkpoints(root: str, seed: int) -> dict[str, str]:
    """The random model saved twice: variant -> directory. ``plain`` (and ``beam4``) as
    ``save_pretrained`` writes it; ``bans`` the same weights with the suppressed tokens
    and the no-repeat n-gram size in its generation_config.json."""
    import torch
    from transformers import BartConfig, BartForConditionalGeneration

    plain, bans = os.path.join(root, "plain"), os.path.join(root, "bans")
    config = BartConfig(**MODEL_CONFIG, forced_eos_token_id=None, forced_bos_token_id=None)
    torch.manual_seed(seed)
    BartForConditionalGeneration(config).eval().save_pretrained(plain)
    shutil.copytree(plain, bans)
    gen_path = Path(bans) / "generation_config.json"
    gen = json.loads(gen_path.read_text())
    gen["suppress_tokens"] = banned_tokens(config, seed)
    gen["no_repeat_ngram_size"] = NO_REPEAT_NGRAM
    gen_path.write_text(json.dumps(gen, indent=2) + "\n")
    return {"plain": plain, "bans": bans, "beam4": plain}


def banned_tokens(config, seed: int) -> list[int]:
    """NUM_BANNED seeded ids, special ids left out (EOS stays allowed, as in Whisper's list)."""
    specials = throughput.special_ids(config)
    pool = [i for i in range(config.vocab_size) if i not in specials]
    return sorted(random.Random(f"{seed}-bans").sample(pool, NUM_BANNED))


def workload(variant: str, requests: int, new_tokens: int) -> Workload:
    beams = 4 if variant == "beam4" else 1
    return Workload(variant, requests, MIN_ENCODER, MAX_ENCODER, new_tokens, num_beams=beams)


def variant_requests(variant: str, args, config, num_requests: int | None = None) -> Requests:
    n = num_requests or (max(1, args.requests // 4) if variant == "beam4" else args.requests)
    return throughput.make_requests(workload(variant, n, args.new_tokens), config, n, args.seed)


# --------------------------------------------------------------------------
# Engines: each runner's run(requests, **setting) returns the generated ids per request
# --------------------------------------------------------------------------


class TandemEngine:
    def __init__(self, model_dir: str, seed: int):
        from tandem import LLM

        # Every round serves the same requests: the caches would skip encoder runs the
        # other engines compute (benchmarks/throughput.py's docstring).
        self.options = dict(model=model_dir, dtype="float32", device="cpu", seed=seed,
                            encoder_cache_blocks=0, prefix_cache_blocks=0)
        self.llm = LLM(**self.options)
        self.replicated = {}  # data_parallel_size -> its LLM, built when first run
        self.attention_backend = self.llm.llm_engine.attn_backend.name

    def _llm(self, data_parallel_size: int, num_scheduler_steps: int):
        from tandem import LLM

        if data_parallel_size == 1 and num_scheduler_steps == 1:
            return self.llm
        key = (data_parallel_size, num_scheduler_steps)
        if key not in self.replicated:
            self.replicated[key] = LLM(**self.options, data_parallel_size=data_parallel_size,
                                       num_scheduler_steps=num_scheduler_steps)
        return self.replicated[key]

    @staticmethod
    def params(w: Workload, **extra):
        from tandem import SamplingParams

        beams = dict(num_beams=w.num_beams, length_penalty=1.0) if w.num_beams > 1 else {}
        # Only these fields are explicit: the rest (the bans) come from generation_config.json.
        return SamplingParams(temperature=0.0, max_tokens=w.new_tokens, min_tokens=w.new_tokens, **beams, **extra)

    def run(self, requests: Requests, data_parallel_size: int = 1, num_scheduler_steps: int = 1) -> list[list[int]]:
        outs = self._llm(data_parallel_size, num_scheduler_steps).generate([{"prompt_token_ids": ids} for ids in requests.encoder_ids],
                                 self.params(requests.workload), use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def count_calls(self, requests: Requests, skip: int, steps: int) -> dict:
        """Python and C calls per steady-state decode step (module docstring), the
        requests then aborted."""
        from tandem.core.sampling_params import RequestOutputKind

        engine = self.llm.llm_engine
        params = self.params(requests.workload, output_kind=RequestOutputKind.FINAL_ONLY)  # as LLM.generate
        tag = f"count-{time.monotonic_ns()}"
        ids = [f"{tag}-{i}" for i in range(len(requests.encoder_ids))]
        for rid, enc in zip(ids, requests.encoder_ids):
            engine.add_request(rid, {"prompt_token_ids": enc}, params)
        counter = _CallCounter()
        per_step: list[tuple[int, int]] = []
        admitted_at, stepped = None, 0
        gc.collect()
        try:
            while engine.has_unfinished_requests() and len(per_step) < steps:
                stats = engine.get_stats()
                if admitted_at is None and not stats["num_requests_waiting"] \
                        and stats["num_requests_running"] == len(ids):
                    admitted_at = stepped
                counting = admitted_at is not None and stepped - admitted_at >= skip
                if counting:
                    counter.py = counter.c = 0
                    sys.setprofile(counter)
                try:
                    engine.step()
                finally:
                    sys.setprofile(None)
                stepped += 1
                if counting:
                    per_step.append((counter.py, counter.c))
        finally:
            sys.setprofile(None)
            engine.abort_request(ids)
        py = statistics.median(p for p, _ in per_step) if per_step else math.nan
        c = statistics.median(c for _, c in per_step) if per_step else math.nan
        return {"requests": len(ids), "rows": len(ids) * requests.workload.num_beams, "steps": len(per_step),
                "admission_steps": admitted_at, "py_calls": py, "c_calls": c}


class _CallCounter:
    def __init__(self) -> None:
        self.py = self.c = 0

    def __call__(self, frame, event, arg) -> None:
        if event == "call":
            self.py += 1
        elif event == "c_call":
            self.c += 1


class HFEngine(throughput.HFRunner):
    """HF ``generate`` as throughput.py batches it, but with the checkpoint's own
    generation config (its bans included) under the workload's lengths and beams."""

    def __init__(self, model_dir: str):
        super().__init__(model_dir, SimpleNamespace(device="cpu", dtype="float32", hf_no_sort=False))

    def _generation_config(self, new_tokens: int, num_beams: int = 1):
        gen = copy.deepcopy(self.model.generation_config)
        gen.update(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, num_beams=num_beams,
                   length_penalty=1.0, early_stopping=False)
        return gen


class CT2Engine(throughput.CT2Runner):
    """CTranslate2 float32 on the converted checkpoint; the checkpoint's bans, which
    CTranslate2 does not read, are passed as its users pass them: options per call."""

    def __init__(self, model_dir: str):
        super().__init__(model_dir, SimpleNamespace(device="cpu", dtype="float32", ct2_compute_type=None))
        gen = json.loads((Path(model_dir) / "generation_config.json").read_text())
        self.options = {}
        if gen.get("suppress_tokens"):
            self.options["suppress_sequences"] = [[self.tokens[i]] for i in gen["suppress_tokens"]]
        if gen.get("no_repeat_ngram_size"):
            self.options["no_repeat_ngram_size"] = gen["no_repeat_ngram_size"]

    def run(self, requests: Requests, batch_size: int = 0, layout: tuple[int, int] = (1, 1)) -> list[list[int]]:
        tok, w = self.tokens, requests.workload
        prefix_ids = requests.decoder_prompt[1:]  # CTranslate2 starts from decoder_start itself
        length = w.new_tokens + len(prefix_ids)  # the decoding lengths count the target prefix
        results = self.translator(tuple(layout)).translate_batch(
            [[tok[i] for i in ids] for ids in requests.encoder_ids],
            target_prefix=[[tok[i] for i in prefix_ids]] * len(requests.encoder_ids),
            max_batch_size=batch_size, beam_size=w.num_beams, length_penalty=1.0,
            max_decoding_length=length, min_decoding_length=length, max_input_length=0,
            return_end_token=True, **self.options)
        return [[self.token_to_id[t] for t in r.hypotheses[0][len(prefix_ids):]] for r in results]


class Host:
    """One engine on one checkpoint, in a process of its own (engine_procs)."""

    def __init__(self, engine: str, model_dir: str, threads: int, seed: int):
        import torch
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        torch.set_num_threads(threads)
        self.runner = {"tandem": lambda: TandemEngine(model_dir, seed), "hf": lambda: HFEngine(model_dir),
                       "ct2": lambda: CT2Engine(model_dir)}[engine]()

    def info(self) -> dict:
        import torch

        return {"pid": os.getpid(), "torch_threads": torch.get_num_threads(),
                "attention_backend": getattr(self.runner, "attention_backend", None)}

    def timed(self, requests: Requests, setting: dict) -> tuple[list[list[int]], float]:
        gc.collect()
        start = time.perf_counter()
        out = self.runner.run(requests, **setting)
        return out, time.perf_counter() - start

    def count_calls(self, requests: Requests, skip: int, steps: int) -> dict:
        return self.runner.count_calls(requests, skip, steps)


# --------------------------------------------------------------------------
# One variant: its engines' processes, the rounds, the call counts
# --------------------------------------------------------------------------


@dataclass
class Row:
    variant: str
    engine: str
    setting: str = ""
    runs: list[float] = field(default_factory=list)  # seconds of each run of the kept setting
    tokens: int = 0  # generated tokens per run (requests x new tokens)
    new_tokens: int = 0
    sweep: dict[str, float] = field(default_factory=dict)  # setting -> round-1 seconds
    same_as_hf: int | None = None
    requests: int = 0
    pid: int = 0
    error: str = ""
    outputs: list = field(default_factory=list, repr=False)

    @property
    def us_best(self) -> float:
        return 1e6 * min(self.runs) / self.tokens

    @property
    def us_median(self) -> float:
        return 1e6 * statistics.median(self.runs) / self.tokens


def settings(engine: str, num_requests: int, num_beams: int, args) -> list[tuple[str, dict]]:
    """(label, run keywords) of every setting an engine is swept over."""
    if engine == "tandem":
        # One engine on every thread, and engine replicas of a thread or more each (LLM's
        # data_parallel_size, CTranslate2's inter_threads).
        # Each also with runs of decode steps (num_scheduler_steps; beams never run in them).
        sizes = [d for d in range(1, args.threads + 1) if args.threads % d == 0]
        steps = args.scheduler_steps if num_beams == 1 else [1]
        return [(f"{d} engine{'s' * (d > 1)} x {args.threads // d} thread{'s' * (args.threads // d > 1)}"
                 + (f", runs of {n}" if n > 1 else ""),
                 {"data_parallel_size": d, "num_scheduler_steps": n}) for d in sizes for n in steps]
    if engine == "hf":
        sizes = rounds.batch_candidates([*args.hf_batch_sizes, num_requests], num_requests)
        return [(f"batch {b}", {"batch_size": b}) for b in sizes]
    sizes = rounds.batch_candidates(args.ct2_batch_sizes, num_requests)
    return [(f"batch {b}, {a}x{i} threads", {"batch_size": b, "layout": (a, i)})
            for a, i in args.ct2_layouts for b in sizes]


def run_variant(variant: str, model_dir: str, config, args) -> tuple[list[Row], list[dict]]:
    requests = variant_requests(variant, args, config)
    n, w = len(requests.encoder_ids), requests.workload
    # The warm-up: every request, a few tokens (kernels picked, allocators grown to the batch).
    warm = Requests(Workload(variant + "-warmup", n, MIN_ENCODER, MAX_ENCODER, min(4, w.new_tokens), w.num_beams),
                    requests.encoder_ids, requests.decoder_prompt)
    hosts, rows = {}, {}
    for engine in args.engines:
        row = rows[engine] = Row(variant, engine, requests=n, new_tokens=w.new_tokens, tokens=n * w.new_tokens)
        try:
            hosts[engine] = engine_procs.start(engine, "host_overhead:Host", engine, model_dir, args.threads,
                                               args.seed, env=engine_procs.thread_env(args.threads))
            row.pid = hosts[engine].call("info")["pid"]
        except engine_procs.EngineFailed as exc:
            print(f"note: {engine} failed to load: {exc}", flush=True)
            row.error = str(exc)
    counts: list[dict] = []
    try:
        variants = []
        for engine, host in hosts.items():
            for label, setting in settings(engine, n, w.num_beams, args):
                try:
                    host.call("timed", warm, setting)
                except engine_procs.EngineFailed as exc:
                    rows[engine].error = str(exc)
                    break
                variants.append(rounds.Variant(engine, label, lambda h=host, s=setting: h.call("timed", requests, s)))

        def measure(v: rounds.Variant):
            if rows[v.engine].error:
                return math.inf, None
            try:
                out, seconds = v.run()
            except engine_procs.EngineFailed as exc:
                print(f"note: {v.engine} failed: {exc}", flush=True)
                rows[v.engine].error = str(exc)
                return math.inf, None
            return seconds, out

        def progress(v: rounds.Variant, seconds: float, round_: int):
            if not rows[v.engine].error:
                print(f"  {variant:<6} {v.engine:<7} {1e6 * seconds / (n * w.new_tokens):9.1f} us/token  "
                      f"[{v.label}] (round {round_}/{args.rounds})", flush=True)

        variants = [v for v in variants if not rows[v.engine].error]
        chosen = rounds.sweep_rounds(variants, args.rounds, measure, progress) if variants else {}
        for engine, c in chosen.items():
            row = rows[engine]
            if row.error:
                continue
            row.setting, row.runs, row.sweep, row.outputs = c.label, c.values, c.sweep, c.payloads[0]
            short = sum(len(o) != w.new_tokens for o in row.outputs)
            if short:
                row.error = f"{short} of {n} requests did not generate exactly {w.new_tokens} tokens"
            elif variant == "bans":
                row.error = bans_broken(row.outputs, requests.decoder_prompt, banned_tokens(config, args.seed))
        if "tandem" in hosts and not rows["tandem"].error:
            for r in args.count_rows:
                count_req = variant_requests(variant, args, config, max(1, r // w.num_beams))
                try:
                    counts.append({"variant": variant, **hosts["tandem"].call(
                        "count_calls", count_req, args.skip_steps, args.count_steps)})
                except engine_procs.EngineFailed as exc:
                    print(f"note: counting tandem's calls failed: {exc}", flush=True)
    finally:
        for host in hosts.values():
            host.close()
    hf = rows.get("hf")
    for row in rows.values():
        if hf is not None and hf.outputs and row.outputs:
            row.same_as_hf = sum(a == b for a, b in zip(row.outputs, hf.outputs))
    return list(rows.values()), counts


def bans_broken(outputs: list[list[int]], decoder_prompt: list[int], banned: list[int]) -> str:
    """Why an engine's bans-variant outputs show it did not apply the checkpoint's bans
    (a suppressed token generated, or a repeated n-gram in the decoder sequence), or ""."""
    banned_set = set(banned)
    for i, out in enumerate(outputs):
        if banned_set.intersection(out):
            return f"request {i} generated suppressed token(s) {sorted(banned_set.intersection(out))[:4]}"
        seq = decoder_prompt + out
        grams = [tuple(seq[k:k + NO_REPEAT_NGRAM]) for k in range(len(seq) - NO_REPEAT_NGRAM + 1)]
        if len(set(grams)) != len(grams):
            return f"request {i} repeats a {NO_REPEAT_NGRAM}-gram (no_repeat_ngram_size not applied)"
    return ""


def guard(rows: list[Row], check: int) -> list[str]:
    """The plain variant's correctness guard: tandem's first ``check`` requests equal HF's."""
    by = {(r.variant, r.engine): r for r in rows}
    tandem, hf = by.get(("plain", "tandem")), by.get(("plain", "hf"))
    if not check or tandem is None or hf is None or not tandem.outputs or not hf.outputs:
        return []
    return [f"plain: request {i}: tandem {tandem.outputs[i][:8]}... != HF {hf.outputs[i][:8]}..."
            for i in range(min(check, len(hf.outputs))) if tandem.outputs[i] != hf.outputs[i]]


# --------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------


def _ratio(a: Row | None, b: Row | None, best: bool) -> str:
    if a is None or b is None or a.error or b.error or not a.runs or not b.runs:
        return "-"
    return f"{(a.us_best / b.us_best) if best else (a.us_median / b.us_median):.2f}x"


def format_table(rows: list[Row]) -> str:
    header = ("variant", "engine", "setting", "requests", "rounds", "us/token best", "us/token median",
              "ms/position", "same as HF")
    out = [header]
    for r in rows:
        if r.error or not r.runs:
            error = (r.error or "no runs").splitlines()[0]
            out.append((r.variant, r.engine, "FAILED: " + error[:80], str(r.requests)) + ("-",) * 5)
            continue
        out.append((r.variant, r.engine, r.setting, str(r.requests), str(len(r.runs)), f"{r.us_best:.1f}",
                    f"{r.us_median:.1f}", f"{1e3 * statistics.median(r.runs) / r.new_tokens:.2f}",
                    "-" if r.same_as_hf is None else f"{r.same_as_hf}/{r.requests}"))
    return throughput._layout(out, left=3)


def format_summary(rows: list[Row]) -> str:
    """Per variant: each engine's median us/token and tandem's time over CTranslate2's and
    HF's (above 1: tandem slower), from the medians and from the best runs."""
    by = {(r.variant, r.engine): r for r in rows}
    out = [("variant", "tandem us/tok", "HF us/tok", "CT2 us/tok", "tandem/CT2 median", "tandem/CT2 best",
            "tandem/HF median", "tandem/HF best")]
    for variant in dict.fromkeys(r.variant for r in rows):
        t, h, c = (by.get((variant, e)) for e in ENGINES)
        cell = [("-" if r is None or r.error or not r.runs else f"{r.us_median:.1f}") for r in (t, h, c)]
        out.append((variant, *cell, _ratio(t, c, False), _ratio(t, c, True), _ratio(t, h, False),
                    _ratio(t, h, True)))
    return throughput._layout(out, left=1)


def format_counts(counts: list[dict]) -> str:
    out = [("variant", "rows", "requests", "steps counted", "python calls/step", "C calls/step",
            "python calls per added row")]
    for variant in dict.fromkeys(c["variant"] for c in counts):
        cs = sorted((c for c in counts if c["variant"] == variant), key=lambda c: c["rows"])
        lo = cs[0]
        for c in cs:
            grow = "-" if c is lo or c["rows"] == lo["rows"] else \
                f"{(c['py_calls'] - lo['py_calls']) / (c['rows'] - lo['rows']):.1f}"
            out.append((variant, str(c["rows"]), str(c["requests"]), str(c["steps"]), f"{c['py_calls']:,.0f}",
                        f"{c['c_calls']:,.0f}", grow))
    return throughput._layout(out, left=1)


def environment(args) -> dict:
    import torch
    import transformers
    from importlib.metadata import PackageNotFoundError, version

    try:  # its version without importing it here (its OpenMP pool belongs in its own process)
        ct2 = version("ctranslate2")
    except PackageNotFoundError:
        ct2 = "not installed"
    return {
        "model": "random bart " + ", ".join(f"{k}={v}" for k, v in MODEL_CONFIG.items()),
        "threads": args.threads, "ct2_threads": ",".join(f"{a}x{b}" for a, b in args.ct2_layouts),
        "rounds": args.rounds, "requests": args.requests, "new_tokens": args.new_tokens, "seed": args.seed,
        "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
        "ctranslate2": ct2, "cpu": platform.processor() or platform.machine(), "cpu_flags": throughput.cpu_flags(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(), "cpu_count": os.cpu_count(),
        **throughput.isa_overrides(), "load_avg": "/".join(f"{x:.2f}" for x in os.getloadavg()),
    }


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {', '.join(VARIANTS)} (default all)")
    p.add_argument("--engines", default=",".join(ENGINES), help=f"comma list of {', '.join(ENGINES)} (default all)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; round 1 sweeps the settings (default 3)")
    p.add_argument("--requests", type=int, default=256,
                   help="requests of plain and bans; beam4 serves a quarter of them (default 256)")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens generated per request (default 64)")
    p.add_argument("--threads", type=int, default=2, help="torch / OpenMP threads per engine (default 2)")
    p.add_argument("--scheduler-steps", default="1,8",
                   help="tandem's num_scheduler_steps values tried (runs of decode steps; default 1,8)")
    p.add_argument("--hf-batch-sizes", default="32,64,128",
                   help="HF batch sizes tried beside all requests in one batch (default 32,64,128)")
    p.add_argument("--ct2-batch-sizes", default="32,64,128,256",
                   help="CTranslate2 max_batch_size values tried, capped at the requests (default 32,64,128,256)")
    p.add_argument("--ct2-threads", metavar="INTRAxINTER,...",
                   help="CTranslate2 thread layouts (default: those of --threads, 2x1,1x2 for 2)")
    p.add_argument("--count-rows", default="32,256",
                   help="rows at which tandem's Python calls per decode step are counted (default 32,256; 0: off)")
    p.add_argument("--count-steps", type=int, default=3, help="decode steps counted per row count (default 3)")
    p.add_argument("--skip-steps", type=int, default=2,
                   help="decode steps left out after every request is running, before counting (default 2)")
    p.add_argument("--check", type=int, default=8,
                   help="plain: tandem's first CHECK requests must equal HF's tokens (default 8; 0: off)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-model", metavar="DIR", help="keep the random checkpoints here (DIR/plain, DIR/bans)")
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 16 requests x 8 tokens, 1 round, calls counted at 4 and 16 rows, "
                        "small sweeps (explicit flags still win)")
    raw = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(raw)
    if args.quick:
        given = {a.split("=")[0] for a in raw}
        quick = {"--requests": ("requests", 16), "--new-tokens": ("new_tokens", 8), "--rounds": ("rounds", 1),
                 "--count-rows": ("count_rows", "4,16"), "--hf-batch-sizes": ("hf_batch_sizes", "8"),
                 "--ct2-batch-sizes": ("ct2_batch_sizes", "16"), "--count-steps": ("count_steps", 2)}
        for flag, (name, value) in quick.items():
            if flag not in given:
                setattr(args, name, value)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    if not args.variants or any(v not in VARIANTS for v in args.variants):
        p.error(f"--variants {','.join(args.variants)!r}: choose from {', '.join(VARIANTS)}")
    if not args.engines or any(e not in ENGINES for e in args.engines):
        p.error(f"--engines {','.join(args.engines)!r}: choose from {', '.join(ENGINES)}")
    for name in ("rounds", "requests", "new_tokens", "threads", "count_steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("skip_steps", "check"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    try:
        args.hf_batch_sizes = rounds.parse_int_list(str(args.hf_batch_sizes), "--hf-batch-sizes")
        args.ct2_batch_sizes = rounds.parse_int_list(str(args.ct2_batch_sizes), "--ct2-batch-sizes")
        args.scheduler_steps = rounds.parse_int_list(str(args.scheduler_steps), "--scheduler-steps")
        args.count_rows = ([] if str(args.count_rows).strip() == "0"
                           else rounds.parse_int_list(str(args.count_rows), "--count-rows"))
        args.ct2_layouts = (rounds.parse_thread_layouts(args.ct2_threads) if args.ct2_threads
                            else rounds.thread_layouts(args.threads))
    except ValueError as exc:
        p.error(str(exc))
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    args.engines = throughput.available_engines(args.engines)
    if not args.engines:
        return 1
    tmp = None if args.save_model else tempfile.TemporaryDirectory(prefix="tandem-host-overhead-")
    root = args.save_model or tmp.name
    try:
        dirs = make_checkpoints(root, args.seed)
        config = throughput.load_config(dirs["plain"])
        env = environment(args)
        print("  ".join(f"{k}={v}" for k, v in env.items()), flush=True)
        if os.getloadavg()[0] > 0.5:
            print(f"warning: 1-minute load average is {os.getloadavg()[0]:.2f}: other processes use the CPU, "
                  "so the figures are noisy", file=sys.stderr)
        rows, counts = [], []
        for variant in args.variants:
            r, c = run_variant(variant, dirs[variant], config, args)
            rows += r
            counts += c
    finally:
        if tmp is not None:
            tmp.cleanup()

    problems = guard(rows, args.check)
    print(f"\nhost overhead: tiny random BART, float32, CPU, {args.threads} threads; "
          f"{args.requests} requests (beam4: {max(1, args.requests // 4)} x 4 beams) x {args.new_tokens} new tokens; "
          f"load {env['load_avg']} -> {'/'.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"cpu_flags={env['cpu_flags']}  cpu_capability={env['cpu_capability']}  torch={env['torch']}  "
          f"transformers={env['transformers']}  ctranslate2={env['ctranslate2']}  threads={args.threads}  "
          f"ct2_threads={env['ct2_threads']}  rounds={args.rounds}")
    print("engines ran one at a time, each in a process of its own per variant: "
          + ", ".join(f"{r.variant}/{r.engine} pid {r.pid}" for r in rows if r.pid))
    print("\nmicroseconds per generated token (lower is better); tandem/X: tandem's time over X's (above 1: slower)")
    print(format_summary(rows))
    print()
    print(format_table(rows))
    for r in rows:
        if len(r.sweep) > 1:
            print(f"  {r.variant} / {r.engine} (us/token, round 1): " + "; ".join(
                f"{label}: {1e6 * s / r.tokens:.1f}{' *' if label == r.setting else ''}" for label, s in r.sweep.items()))
    if counts:
        print(f"\ntandem: Python calls per steady-state decode step (sys.setprofile, median of {args.count_steps})")
        print(format_counts(counts))
    if args.json:
        Path(args.json).write_text(json.dumps({
            "environment": env, "counts": counts, "guard_failures": problems,
            "results": [{k: v for k, v in r.__dict__.items() if k != "outputs"}
                        | ({"us_best": r.us_best, "us_median": r.us_median} if r.runs and not r.error else {})
                        for r in rows]}, indent=2) + "\n")
        print(f"\nwrote {args.json}")
    for problem in problems:
        print(f"error: correctness guard: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    # Run as the module `host_overhead`, not `__main__`: the engines' processes import the
    # Host class by that name (engine_procs), and the pickled requests name their module.
    import host_overhead

    sys.exit(host_overhead.main())
