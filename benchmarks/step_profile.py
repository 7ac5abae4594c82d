"""Where a decode step goes: tandem's steady-state step split into its parts.

Runs tandem's offline engine (``LLM``, float32, or int8 linear layers with
``--quantization int8``; CPU, 2 torch threads by
default) on a BART checkpoint (a random bart-base-sized one by default, built
as ``benchmarks/throughput.py`` builds it) in three cases, and reports, for
the steady-state decode steps only (steps that run no encoder and no prompt,
after the first ``--skip`` of them), the time per step (the median over the
timed steps, of the step and of each part, so the parts need not add up to
the step exactly) split into:

  scheduling   ``Scheduler.schedule``
  prepare      ``ModelRunner.prepare`` + the attention metadata builder's ``build``
  forward      the rest of ``ModelRunner.execute``: the model call and the LM head,
               split per op class from a torch.profiler pass (below)
  sampling     ``Sampler.__call__``, beam search's ``prepare_all``/``select_all`` (its
               log-softmax and top-k) and the logits transforms
  output       ``Scheduler.update_from_output`` + ``OutputProcessor.process``
  worker glue  ``Worker.execute_model`` outside the runner and the sampler (per-row
               lists, the rows' parameters)
  rest         the engine step's wall time minus all of the above (the engine core's
               bookkeeping, fault checks, the timers themselves)

and the Python function calls per step (``sys.setprofile``: Python-level calls,
and calls into C functions and builtins, counted separately; the script's own
timer wrappers add about 10 of each).

A second table puts the step against the machine's matmul rate: the model's
FLOPs per timed step (2 per multiply-add of the decoder's GEMMs: self-attention
q/k/v/out, cross-attention q/out, the FFN and the LM head, at the step's rows; plus
attention's q.k and p.v, 4 x attn_dim per attended self or cross key and layer)
over the median step time, against ``torch.mm``'s GFLOP/s at those same GEMM
shapes (``[rows, in] @ [in, out]``, weighted by how often the step runs each),
measured in the same run right after the case (best and median of 5 rounds).
"% of matmul rate" is the step's rate over the median torch.mm rate. The
same is given in process CPU time (the step's and torch.mm's FLOPs per CPU
second): on a machine other jobs share, wall time counts the time this process
waits for a core, CPU time does not (with ``--threads 1`` it is the work done;
with more threads, spinning threads count too).

Cases (``--cases``, default all three):

  batch1   1 request, encoder 20-40 tokens, 64 new tokens, greedy
  beam4    16 requests, encoder 64-512, 64 new tokens, beam search with 4 beams
  short    256 requests, encoder 10-60, 48 new tokens, greedy (translation-like)

Each case runs once, and its decode steps are used in turn: ``--skip`` steps
left out (admission, first steps), ``--steps`` steps timed, ``--profile-steps``
under torch.profiler (forward per op class: linear (the linear layers and the
LM head, GEMMs with any fused activation), attention (tandem's ``Attention``
layer: K/V cache writes and the attention op), layer norm, other ops, and
"between ops": Python in the forward outside any op; the profiled steps'
shares of their forward are applied to the timed steps' forward, so the
profiler's own cost is not charged as time), then ``--count-steps`` under
``sys.setprofile``; the
remaining requests are then aborted. Output lengths are fixed (``min_tokens ==
max_tokens``), so the batch stays whole through the measured steps.

The timers are ``time.perf_counter`` wrappers put on the methods above by this
script (no tandem code changes); they cost about a microsecond each. Garbage
collection runs as it would (a collection lands in whichever part ran then;
the medians keep such a step from moving the figures).

Examples (from the repository root):

  python benchmarks/step_profile.py                      # bart-base-sized, all cases
  python benchmarks/step_profile.py --cases batch1 --steps 40
  python benchmarks/step_profile.py --model /path/to/bart --threads 1
  python benchmarks/step_profile.py --cases short --quantization int8
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import (  # noqa: E402 - the sibling benchmark's helpers
    MODEL_SIZES,
    Workload,
    available_engines,
    build_random,
    checkpoint_dir,
    cpu_flags,
    load_config,
    make_requests,
    model_shape,
)

CASES = {
    "batch1": Workload("batch1", 1, 20, 40, 64),
    "beam4": Workload("beam4", 16, 64, 512, 64, num_beams=4),
    "short": Workload("short", 256, 10, 60, 48),
}
PARTS = ("scheduling", "prepare", "forward", "sampling", "output", "worker glue", "rest")
OP_CLASSES = ("linear", "attention", "layer norm", "other ops")
FORWARD_ROWS = (*OP_CLASSES, "between ops")

# torch.profiler op names, matched as substrings, for ops outside the marked layers.
_LINEAR_OPS = ("linear", "addmm", "aten::mm", "matmul", "int8pack_mm")
_ATTENTION_OPS = ("attention", "scaled_dot_product")
_LAYER_NORM_OPS = ("layer_norm",)
_LINEAR_MARK, _ATTENTION_MARK, _FORWARD_MARK, _PREPARE_MARK = (
    "step_profile.linear", "step_profile.attention", "step_profile.forward", "step_profile.prepare")


# --------------------------------------------------------------------------
# Timers
# --------------------------------------------------------------------------


class Timers:
    """Seconds per named timer within the current step."""

    def __init__(self) -> None:
        self.now: dict[str, float] = defaultdict(float)
        self.decode_only = True  # the current step runs decodes only (set by schedule)
        self.profiling = False  # mark regions for torch.profiler
        self.shape: tuple[int, int, int] = (0, 0, 0)  # last step's (rows, sum of self lengths, sum of cross lengths)

    def reset(self) -> None:
        self.now = defaultdict(float)
        self.decode_only = True


def _wrap(owner, name: str, timers: Timers, key: str, mark: str | None = None):
    """Replace ``owner.name`` (a class or an instance) with a timed version; returns an undo."""
    original = getattr(owner, name)
    raw = owner.__dict__.get(name) if isinstance(owner, type) else None
    is_static = isinstance(raw, staticmethod)
    perf = time.perf_counter
    if isinstance(raw, classmethod):
        func = raw.__func__

        def timed_cm(cls, *args, **kwargs):
            start = perf()
            try:
                return func(cls, *args, **kwargs)
            finally:
                timers.now[key] += perf() - start

        setattr(owner, name, classmethod(timed_cm))
        return lambda: setattr(owner, name, raw)

    def timed(*args, **kwargs):
        start = perf()
        try:
            if mark and timers.profiling:
                with torch.profiler.record_function(mark):
                    return original(*args, **kwargs)
            return original(*args, **kwargs)
        finally:
            timers.now[key] += perf() - start

    if is_static:
        setattr(owner, name, staticmethod(timed))
        return lambda: setattr(owner, name, staticmethod(original))
    if isinstance(owner, type):
        # A plain function on the class: the wrapper becomes the method (self comes first).
        setattr(owner, name, timed)
        return lambda: setattr(owner, name, original)
    setattr(owner, name, timed)  # a bound method on an instance: shadowed by an attribute
    return lambda: delattr(owner, name)


def _mark(owner, name: str, timers: Timers, mark: str):
    """Wrap ``owner.name`` in a torch.profiler range while profiling (no timer)."""
    original = getattr(owner, name)

    def marked(*args, **kwargs):
        if timers.profiling:
            with torch.profiler.record_function(mark):
                return original(*args, **kwargs)
        return original(*args, **kwargs)

    setattr(owner, name, marked)
    return lambda: setattr(owner, name, original)


def _record_shape(runner_cls, timers: Timers):
    """Keep each step's decoder rows and attended lengths (for its FLOPs)."""
    original = runner_cls.prepare

    def prepare(self, out):
        inputs = original(self, out)
        timers.shape = (len(inputs.query_lens), sum(inputs.seq_lens), sum(inputs.cross_seq_lens))
        return inputs

    runner_cls.prepare = prepare
    return lambda: setattr(runner_cls, "prepare", original)


def instrument(llm, timers: Timers) -> list:
    """Put the timers on the engine's step parts; returns the undo callables."""
    from tandem.core.layers.attention import Attention
    from tandem.core.layers.embedding import ParallelLMHead
    from tandem.core.layers.linear import ColumnParallelLinear, RowParallelLinear
    from tandem.core.output_processor import OutputProcessor
    from tandem.core.sched.scheduler import Scheduler
    from tandem.core.strategies.beam import BeamStep
    from tandem.core.worker.model_runner import ModelRunner
    from tandem.core.worker.sampler import Sampler
    from tandem.core.worker.worker import Worker

    engine = llm.llm_engine
    worker = engine.worker
    if worker is None:
        raise SystemExit("step_profile needs the in-process worker (tensor_parallel_size=1, no executor backend)")
    undo = []
    original_schedule = Scheduler.schedule
    perf = time.perf_counter

    def schedule(self):
        start = perf()
        out = original_schedule(self)
        timers.now["scheduling"] += perf() - start
        if any(g.encoder_inputs is not None or any(len(s.token_ids) != 1 for s in g.seqs)
               for g in out.scheduled) or not out.scheduled:
            timers.decode_only = False
        return out

    Scheduler.schedule = schedule
    undo.append(lambda: setattr(Scheduler, "schedule", original_schedule))
    undo += [
        _wrap(ModelRunner, "prepare", timers, "prepare", _PREPARE_MARK),
        _wrap(worker.runner.builder, "build", timers, "build", _PREPARE_MARK),
        _wrap(ModelRunner, "execute", timers, "execute", _FORWARD_MARK),
        _wrap(Worker, "execute_model", timers, "execute_model"),
        _wrap(Worker, "_transform", timers, "sampling"),
        _wrap(Sampler, "__call__", timers, "sampling"),
        # The worker calls a mode's batched hooks where it has them (issue 40), else one per request.
        *(_wrap(BeamStep, name, timers, "sampling") for name in (
            ("prepare_all", "select_all") if "select_all" in BeamStep.__dict__ else ("prepare", "select"))),
        _record_shape(ModelRunner, timers),
        _wrap(Scheduler, "update_from_output", timers, "output"),
        _wrap(OutputProcessor, "process", timers, "output"),
        _mark(Attention, "forward", timers, _ATTENTION_MARK),
        _mark(ColumnParallelLinear, "forward", timers, _LINEAR_MARK),
        _mark(RowParallelLinear, "forward", timers, _LINEAR_MARK),
        _mark(ParallelLMHead, "forward", timers, _LINEAR_MARK),
    ]
    return undo


def split(now: dict[str, float], total: float) -> dict[str, float]:
    """One step's timers as the report's parts (seconds)."""
    prep = now["prepare"] + now["build"]
    forward = now["execute"] - prep
    glue = now["execute_model"] - now["execute"] - now["sampling"]
    parts = {
        "scheduling": now["scheduling"], "prepare": prep, "forward": forward,
        "sampling": now["sampling"], "output": now["output"], "worker glue": glue,
    }
    parts["rest"] = total - sum(parts.values())
    return parts


# --------------------------------------------------------------------------
# Forward per op class (torch.profiler)
# --------------------------------------------------------------------------


def _op_class(name: str) -> str | None:
    if name == _LINEAR_MARK or any(k in name for k in _LINEAR_OPS):
        return "linear"
    if name == _ATTENTION_MARK or any(k in name for k in _ATTENTION_OPS):
        return "attention"
    if any(k in name for k in _LAYER_NORM_OPS):
        return "layer norm"
    return None


def forward_op_classes(prof) -> dict[str, float]:
    """Microseconds per op class inside the forward ranges of a profile, prepare's
    ranges left out: a classified event takes its whole time (its children with
    it); an unclassified op its self time, its children classified in turn; the
    forward range's own self time (Python between ops) is "between ops"."""
    out = dict.fromkeys((*OP_CLASSES, "between ops"), 0.0)

    def walk(event) -> None:
        for child in event.cpu_children:
            if child.name == _PREPARE_MARK:
                continue
            cls = _op_class(child.name)
            if cls is not None:
                out[cls] += child.cpu_time_total
            else:
                out["other ops"] += child.self_cpu_time_total
                walk(child)

    for event in prof.events():
        if event.name == _FORWARD_MARK:
            out["between ops"] += event.self_cpu_time_total
            walk(event)
    return out


# --------------------------------------------------------------------------
# Python calls per step
# --------------------------------------------------------------------------


class CallCounter:
    def __init__(self) -> None:
        self.py = 0
        self.c = 0

    def __call__(self, frame, event, arg) -> None:
        if event == "call":
            self.py += 1
        elif event == "c_call":
            self.c += 1


# --------------------------------------------------------------------------
# One case
# --------------------------------------------------------------------------


@dataclass
class CaseResult:
    name: str
    rows: int  # decoder sequences per step
    steps: int  # timed steps
    step_ms: float
    parts_ms: dict[str, float]
    ops_ms: dict[str, float]  # forward per op class: the profiled steps' shares of the timed forward
    profiled_steps: int
    py_calls: float
    c_calls: float
    counted_steps: int
    step_flops: float = 0.0  # the model's FLOPs in a timed step (median)
    mm_gflops: tuple[float, float] = (0.0, 0.0)  # torch.mm at the step's GEMM shapes: best, median
    step_cpu_ms: float = 0.0  # the step's process CPU time (median)
    mm_cpu_gflops: float = 0.0  # torch.mm per process CPU second (median)
    notes: list[str] = field(default_factory=list)


def run_case(llm, timers: Timers, workload: Workload, config, args) -> CaseResult:
    from tandem import SamplingParams

    engine = llm.llm_engine
    requests = make_requests(workload, config, workload.num_requests, args.seed)
    n = workload.new_tokens
    params = SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, num_beams=workload.num_beams)
    ids = [f"{workload.name}-{i}" for i in range(len(requests.encoder_ids))]
    for rid, enc in zip(ids, requests.encoder_ids):
        engine.add_request(rid, {"prompt_token_ids": enc}, params)

    want = {"skip": args.skip, "time": args.steps, "profile": args.profile_steps, "count": args.count_steps}
    phase_order = [p for p in ("skip", "time", "profile", "count") if want[p] > 0]
    done = dict.fromkeys(want, 0)
    timed: list[dict[str, float]] = []
    totals: list[float] = []
    cpu_totals: list[float] = []
    shapes: list[tuple[int, int, int]] = []
    rows_seen: list[int] = []
    ops_us = dict.fromkeys(FORWARD_ROWS, 0.0)
    counter = CallCounter()
    prof = None
    gc.collect()  # the previous case's garbage is not this case's cost
    try:
        while engine.has_unfinished_requests() and phase_order:
            phase = phase_order[0]
            if phase == "profile" and prof is None:
                prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
                prof.__enter__()
                timers.profiling = True
            timers.reset()
            if phase == "count":
                sys.setprofile(counter)
            start, cpu_start = time.perf_counter(), time.process_time()
            engine.step()
            total, cpu_total = time.perf_counter() - start, time.process_time() - cpu_start
            if phase == "count":
                sys.setprofile(None)
            if not timers.decode_only:
                continue  # admission or prefill: not a steady-state step
            done[phase] += 1
            if phase == "time":
                timed.append(split(timers.now, total))
                totals.append(total)
                cpu_totals.append(cpu_total)
                rows_seen.append(_rows(engine))
                shapes.append(timers.shape)
            if done[phase] == want[phase]:
                phase_order.pop(0)
                if phase == "profile":
                    timers.profiling = False
                    prof.__exit__(None, None, None)
                    for k, v in forward_op_classes(prof).items():
                        ops_us[k] = v
                    prof = None
    finally:
        sys.setprofile(None)
        if prof is not None:
            timers.profiling = False
            prof.__exit__(None, None, None)
        engine.abort_request(ids)

    notes = [f"only {done[p]} of {want[p]} {p} steps (the requests finished first)"
             for p in want if p != "skip" and done[p] < want[p]]
    steps = len(timed)
    # Medians: a step another process slowed down moves a mean by several percent.
    parts_ms = {p: 1e3 * statistics.median(t[p] for t in timed) if timed else 0.0 for p in PARTS}
    profiled = done["profile"]
    # The profiled steps' proportions, applied to the timed (unprofiled) forward: the
    # profiler's own cost per op would otherwise count as forward time.
    profiled_us = sum(ops_us.values())
    ops_ms = {k: parts_ms["forward"] * v / profiled_us if profiled_us else 0.0 for k, v in ops_us.items()}
    shape = model_shape(config)
    flops = statistics.median(step_flops(shape, *sh) for sh in shapes) if shapes else 0.0
    mm = mm_rate(shape, statistics.median(sh[0] for sh in shapes)) if shapes else (0.0, 0.0, 0.0)
    return CaseResult(
        step_flops=flops, mm_gflops=mm[:2], mm_cpu_gflops=mm[2],
        step_cpu_ms=1e3 * statistics.median(cpu_totals) if cpu_totals else 0.0,
        name=workload.name, rows=max(rows_seen, default=0), steps=steps,
        step_ms=1e3 * statistics.median(totals) if totals else 0.0, parts_ms=parts_ms, ops_ms=ops_ms,
        profiled_steps=profiled, py_calls=counter.py / max(done["count"], 1),
        c_calls=counter.c / max(done["count"], 1), counted_steps=done["count"], notes=notes)


# --------------------------------------------------------------------------
# Matmul rate: the model's FLOPs per step against torch.mm at the step's GEMMs
# --------------------------------------------------------------------------


def gemm_shapes(shape) -> list[tuple[int, int, int]]:
    """(count, in, out) of the decoder's matrix products per decode step, each ``[rows, in]
    @ [in, out]``: self-attention q/k/v and out, cross-attention q and out (the cross
    K/V projections run with the encoder, not in a decode step), the FFN, the LM head."""
    d, a, f, n = shape.d_model, shape.attn_dim, shape.decoder_ffn_dim, shape.decoder_layers
    return [(4 * n, d, a), (2 * n, a, d), ((shape.ffn_matrices - 1) * n, d, f), (n, f, d), (1, d, shape.vocab_size)]


def step_flops(shape, rows: int, self_lens: int, cross_lens: int) -> float:
    """The model's FLOPs in one decode step: 2 per multiply-add of the GEMMs above, and
    attention's q.k and p.v products (2 x 2 x attn_dim per attended key, per layer)."""
    gemm = 2 * rows * sum(c * k * o for c, k, o in gemm_shapes(shape))
    return gemm + 4 * shape.attn_dim * shape.decoder_layers * (self_lens + cross_lens)


def mm_rate(shape, rows: int, rounds: int = 5) -> tuple[float, float, float]:
    """GFLOP/s of ``torch.mm`` over one step's GEMM shapes (each weighted by its count),
    best and median of ``rounds`` rounds, in float32 on this process's threads, and
    the median GFLOP per process CPU second. The weight is laid out as a linear
    layer's (``[out, in]``, used transposed)."""
    rows = max(1, int(rows))
    g = torch.Generator().manual_seed(0)
    mats = [(c, torch.randn(rows, k, generator=g), torch.randn(o, k, generator=g).t()) for c, k, o in gemm_shapes(shape)]
    flops = sum(2 * c * x.shape[0] * x.shape[1] * w.shape[1] for c, x, w in mats)
    for _, x, w in mats:  # warm: first calls pick kernels and grow the allocator
        torch.mm(x, w)
    rates, cpu_rates = [], []
    for _ in range(rounds):
        seconds = cpu_seconds = 0.0
        for c, x, w in mats:
            reps = max(1, min(c, 8))
            start, cpu_start = time.perf_counter(), time.process_time()
            for _ in range(reps):
                torch.mm(x, w)
            seconds += c * (time.perf_counter() - start) / reps
            cpu_seconds += c * (time.process_time() - cpu_start) / reps
        rates.append(flops / seconds / 1e9)
        cpu_rates.append(flops / cpu_seconds / 1e9)
    return max(rates), statistics.median(rates), statistics.median(cpu_rates)


def _rows(engine) -> int:
    """Decoder sequences running now (the step's batch)."""
    return sum(len(g.seqs) for g in getattr(engine.core.scheduler, "running", []) or [])


# --------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------


def format_table(results: list[CaseResult]) -> str:
    header = ["part"] + [f"{r.name} ms" for r in results] + [f"{r.name} %" for r in results]
    lines_data: list[list[str]] = []

    def row(label: str, values: list[float], of: list[float]) -> None:
        lines_data.append([label] + [f"{v:.2f}" for v in values]
                          + [f"{100 * v / t:.1f}" if t else "-" for v, t in zip(values, of)])

    totals = [r.step_ms for r in results]
    row("step (wall)", totals, totals)
    for part in PARTS:
        row(part, [r.parts_ms[part] for r in results], totals)
        if part == "forward":
            for cls in FORWARD_ROWS:
                row(f"  forward: {cls}", [r.ops_ms[cls] for r in results], totals)
    lines_data.append(["python calls / step"] + [f"{r.py_calls:,.0f}" for r in results] + [""] * len(results))
    lines_data.append(["C calls / step"] + [f"{r.c_calls:,.0f}" for r in results] + [""] * len(results))
    rows = [header] + lines_data
    return _render(rows)


def _render(rows: list[list[str]]) -> str:
    """Rows of cells as aligned text: the first column left-aligned, the rest right, a rule under the header."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for k, r in enumerate(rows):
        out.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip())
        if k == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def format_rate_table(results: list[CaseResult]) -> str:
    """The matmul-rate rows: the step's model FLOPs over its (median) time, against
    torch.mm at the step's GEMM shapes measured after the case in the same run."""
    lines = []
    for label, fmt in (
        ("model GFLOP / step", lambda r: f"{r.step_flops / 1e9:.2f}"),
        ("step GFLOP/s", lambda r: f"{r.step_flops / r.step_ms / 1e6:.1f}" if r.step_ms else "-"),
        ("torch.mm GFLOP/s best", lambda r: f"{r.mm_gflops[0]:.1f}"),
        ("torch.mm GFLOP/s median", lambda r: f"{r.mm_gflops[1]:.1f}"),
        ("% of matmul rate (median)", lambda r: f"{100 * r.step_flops / r.step_ms / 1e6 / r.mm_gflops[1]:.1f}"
         if r.step_ms and r.mm_gflops[1] else "-"),
        ("step CPU ms (median)", lambda r: f"{r.step_cpu_ms:.2f}"),
        ("step GFLOP / CPU s", lambda r: f"{r.step_flops / r.step_cpu_ms / 1e6:.1f}" if r.step_cpu_ms else "-"),
        ("torch.mm GFLOP / CPU s", lambda r: f"{r.mm_cpu_gflops:.1f}"),
        ("% of matmul rate (CPU time)", lambda r: f"{100 * r.step_flops / r.step_cpu_ms / 1e6 / r.mm_cpu_gflops:.1f}"
         if r.step_cpu_ms and r.mm_cpu_gflops else "-"),
    ):
        lines.append([label] + [fmt(r) for r in results])
    header = ["matmul rate"] + [r.name for r in results]
    rows = [header] + lines
    return _render(rows)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_argument_group("checkpoint")
    src.add_argument("--model", help="local BART checkpoint directory")
    src.add_argument("--make-model", choices=sorted(MODEL_SIZES), default="base",
                     help="size of the random checkpoint built when --model is not given (default base)")
    src.add_argument("--save-model", metavar="DIR", help="keep the built checkpoint here")
    run = p.add_argument_group("run")
    run.add_argument("--cases", type=lambda v: [c.strip() for c in v.split(",") if c.strip()],
                     default=list(CASES), metavar="LIST", help=f"comma list of {', '.join(CASES)} (default all)")
    run.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    run.add_argument("--skip", type=int, default=4, help="decode steps left out first (default 4)")
    run.add_argument("--steps", type=int, default=32, help="decode steps timed per case (default 32)")
    run.add_argument("--profile-steps", type=int, default=3,
                     help="decode steps under torch.profiler per case, for the op classes (default 3)")
    run.add_argument("--count-steps", type=int, default=2,
                     help="decode steps under sys.setprofile per case, for the call counts (default 2)")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--compile", action="store_true",
                     help="enforce_eager=False: decode steps through the compiled graph (issue 40)")
    run.add_argument("--compile-cache-dir", help="compile_cache_dir (default: tandem's)")
    run.add_argument("--quantization", choices=("int8",),
                     help="quantization='int8': int8 linear layers and LM head (the engine stays float32)")
    args = p.parse_args(argv)
    unknown = [c for c in args.cases if c not in CASES]
    if unknown or not args.cases:
        p.error(f"--cases {','.join(args.cases)!r}: choose from {', '.join(CASES)}")
    for name in ("threads", "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    for name in ("skip", "profile_steps", "count_steps"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    if not available_engines(["tandem"]):
        return 1
    from tandem import LLM, SamplingParams

    model_dir, tmp = checkpoint_dir(args.model, args.save_model, "tandem-step-profile-",
                                    lambda d: build_random(args.make_model, d, args.seed))
    config = load_config(model_dir)

    llm = LLM(model=model_dir, dtype="float32", device="cpu", seed=args.seed, enforce_eager=not args.compile,
              compile_cache_dir=args.compile_cache_dir, quantization=args.quantization)
    # Warm kernels and allocator once per case shape (short requests, a few steps).
    for name in args.cases:
        w = CASES[name]
        warm = make_requests(Workload(w.name + "-warmup", 2, w.min_encoder_len, w.min_encoder_len, 4, w.num_beams),
                             config, 2, args.seed)
        llm.generate([{"prompt_token_ids": ids} for ids in warm.encoder_ids],
                     SamplingParams(temperature=0.0, max_tokens=4, min_tokens=4, num_beams=w.num_beams),
                     use_tqdm=False)

    timers = Timers()
    undo = instrument(llm, timers)
    results = []
    try:
        for name in args.cases:
            start = time.perf_counter()
            results.append(run_case(llm, timers, CASES[name], config, args))
            r = results[-1]
            print(f"  {name:<7} {r.rows} rows, {r.steps} steps timed, {r.step_ms:.2f} ms/step "
                  f"({time.perf_counter() - start:.1f} s)", flush=True)
    finally:
        for u in reversed(undo):
            u()

    backend = llm.llm_engine.attn_backend.name
    print(f"\nmodel={'random ' + args.make_model if not args.model else model_dir}  dtype=float32  "
          f"quantization={args.quantization}  device=cpu  torch_threads={torch.get_num_threads()}  attention_backend={backend}  torch={torch.__version__}")
    print(f"cpu_flags={cpu_flags()}  cpu_capability={torch.backends.cpu.get_cpu_capability()}  "
          f"cpu_count={os.cpu_count()}  load_avg_1min={os.getloadavg()[0]:.2f}")
    print("cases: " + "; ".join(
        f"{r.name} = {CASES[r.name].num_requests} requests x {CASES[r.name].num_beams} beam(s), "
        f"{r.rows} rows/step, {r.steps} steps timed, {r.profiled_steps} profiled, {r.counted_steps} counted"
        for r in results))
    print()
    print(format_table(results))
    print()
    print(format_rate_table(results))
    for r in results:
        for note in r.notes:
            print(f"note: {r.name}: {note}")
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
