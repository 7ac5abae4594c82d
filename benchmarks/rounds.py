"""Interleaved rounds with a settings sweep, and the statistics the tables print.

A benchmark that compares engines must give each its best setting: CTranslate2
at the ``max_batch_size`` and thread layout it runs fastest with, HF at its best
batch size, not at one value that happens to suit one of them. ``sweep_rounds``
does that without a separate tuning pass: in the first round every engine runs
every candidate setting (engines taking turns), each engine keeps the setting of
its fastest run, and the remaining rounds run only the kept settings, engines
still taking turns so that a slow minute on a shared machine lands on all of
them. Each engine's figures are then taken over every run of its kept setting
(the first-round run included), reported as the best and the median.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Callable, Sequence


@dataclass(frozen=True)
class Variant:
    """One setting of one engine: ``label`` names it in the table
    ("batch 64, 2x1 threads"), ``run`` serves the workload once."""

    engine: str
    label: str
    run: Callable[[], object]


@dataclass
class Chosen:
    """An engine's kept setting and what its runs measured."""

    engine: str
    label: str
    values: list[float]  # the measure (seconds, or a latency figure) of each run of the kept setting
    payloads: list  # what measure returned beside it, per run (outputs, per-request times...)
    sweep: dict[str, float] = field(default_factory=dict)  # label -> first-round measure

    @property
    def best(self) -> float:
        return min(self.values)

    @property
    def median(self) -> float:
        return statistics.median(self.values)


def sweep_rounds(variants: Sequence[Variant], rounds: int,
                 measure: Callable[[Variant], tuple[float, object]],
                 on_run: Callable[[Variant, float, int], None] | None = None) -> dict[str, Chosen]:
    """Run ``rounds`` interleaved rounds; lower measure is better.

    ``measure(variant)`` runs it once and returns (measure, payload), the payload
    being whatever the caller wants kept of the run (its outputs, per-request times). Round 1 runs
    every variant, engines taking turns (engine A's first setting, engine B's
    first, A's second, ...); rounds 2.. run each engine's kept variant only.
    ``on_run(variant, value, round)`` is called after every run (progress lines)."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    by_engine: dict[str, list[Variant]] = {}
    for v in variants:
        by_engine.setdefault(v.engine, []).append(v)
    for engine, vs in by_engine.items():
        labels = [v.label for v in vs]
        if len(set(labels)) != len(labels):
            raise ValueError(f"engine {engine!r} has duplicate setting labels: {labels}")

    first: dict[str, dict[str, tuple[float, object]]] = {e: {} for e in by_engine}
    longest = max(len(vs) for vs in by_engine.values())
    for i in range(longest):
        for engine, vs in by_engine.items():
            if i < len(vs):
                value, out = measure(vs[i])
                first[engine][vs[i].label] = (value, out)
                if on_run:
                    on_run(vs[i], value, 1)

    chosen: dict[str, Chosen] = {}
    kept: dict[str, Variant] = {}
    for engine, vs in by_engine.items():
        best = min(vs, key=lambda v: first[engine][v.label][0])
        kept[engine] = best
        value, out = first[engine][best.label]
        chosen[engine] = Chosen(engine, best.label, [value], [out],
                                {label: m for label, (m, _) in first[engine].items()})
    for round_ in range(2, rounds + 1):
        for engine, v in kept.items():
            value, out = measure(v)
            chosen[engine].values.append(value)
            chosen[engine].payloads.append(out)
            if on_run:
                on_run(v, value, round_)
    return chosen


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0 <= q <= 100), interpolating linearly between the
    two nearest ranks (numpy's default method)."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def parse_int_list(text: str, name: str, minimum: int = 1) -> list[int]:
    """"16,32,64" -> [16, 32, 64] (order kept, duplicates dropped); an error names the flag."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{name}: expected a comma list of integers, got {text!r}") from None
    if not values or any(v < minimum for v in values):
        raise ValueError(f"{name}: expected integers >= {minimum}, got {text!r}")
    return list(dict.fromkeys(values))


def batch_candidates(sizes: Sequence[int], num_requests: int) -> list[int]:
    """The batch sizes worth trying for ``num_requests`` requests: each size capped at
    ``num_requests`` (larger ones batch the same), duplicates dropped, ascending."""
    return sorted({min(s, num_requests) for s in sizes})


def thread_layouts(threads: int) -> list[tuple[int, int]]:
    """CTranslate2 (intra_threads, inter_threads) layouts using ``threads`` cores:
    all in one batch (threads x 1), one core per batch (1 x threads), and half
    and half (threads/2 x 2) when that differs from both."""
    layouts = [(threads, 1)]
    if threads >= 4 and threads % 2 == 0:
        layouts.append((threads // 2, 2))
    if threads > 1:
        layouts.append((1, threads))
    return layouts


def parse_thread_layouts(text: str) -> list[tuple[int, int]]:
    """"2x1,1x2" -> [(2, 1), (1, 2)] (intra x inter)."""
    layouts = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        try:
            intra, inter = (int(x) for x in part.lower().split("x"))
        except ValueError:
            raise ValueError(f"--ct2-threads: expected INTRAxINTER items such as 2x1, got {part!r}") from None
        if intra < 1 or inter < 1:
            raise ValueError(f"--ct2-threads: thread counts must be >= 1, got {part!r}")
        layouts.append((intra, inter))
    if not layouts:
        raise ValueError(f"--ct2-threads: no layouts in {text!r}")
    return list(dict.fromkeys(layouts))
