"""benchmarks/rounds: the settings sweep inside interleaved rounds, and the
percentiles the latency table prints (checked against numpy)."""

import random
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import rounds  # noqa: E402


def _fake(times: dict[tuple[str, str], list[float]]):
    """Variants whose measure pops the next preset value; the log records the run order."""
    log = []

    def measure(v):
        log.append((v.engine, v.label))
        value = times[(v.engine, v.label)].pop(0)
        return value, f"{v.engine}/{v.label}#{len(log)}"

    variants = [rounds.Variant(e, label, lambda: None) for (e, label) in times]
    return variants, measure, log


def test_round_one_tries_every_setting_interleaved_then_only_the_fastest():
    times = {
        ("ct2", "batch 16"): [3.0],
        ("ct2", "batch 32"): [2.0, 2.5, 1.5],
        ("ct2", "batch 64"): [2.2],
        ("hf", "batch 16"): [5.0, 5.5, 4.0],
        ("hf", "batch 32"): [6.0],
        ("tandem", "default"): [1.0, 1.2, 0.9],
    }
    variants, measure, log = _fake(times)
    chosen = rounds.sweep_rounds(variants, 3, measure)
    assert log == [
        ("ct2", "batch 16"), ("hf", "batch 16"), ("tandem", "default"),  # engines take turns
        ("ct2", "batch 32"), ("hf", "batch 32"),
        ("ct2", "batch 64"),
        ("ct2", "batch 32"), ("hf", "batch 16"), ("tandem", "default"),  # round 2: kept settings
        ("ct2", "batch 32"), ("hf", "batch 16"), ("tandem", "default"),
    ]
    assert chosen["ct2"].label == "batch 32"
    assert chosen["ct2"].values == [2.0, 2.5, 1.5]
    assert (chosen["ct2"].best, chosen["ct2"].median) == (1.5, 2.0)
    assert chosen["ct2"].sweep == {"batch 16": 3.0, "batch 32": 2.0, "batch 64": 2.2}
    assert chosen["ct2"].payloads[0] == "ct2/batch 32#4"  # the kept setting's first-round run
    assert chosen["hf"].label == "batch 16" and chosen["hf"].values == [5.0, 5.5, 4.0]
    assert chosen["tandem"].values == [1.0, 1.2, 0.9]


def test_one_round_keeps_the_fastest_and_rejects_bad_input():
    variants, measure, log = _fake({("a", "x"): [2.0], ("a", "y"): [1.0]})
    chosen = rounds.sweep_rounds(variants, 1, measure)
    assert chosen["a"].label == "y" and chosen["a"].values == [1.0] and len(log) == 2
    with pytest.raises(ValueError, match="rounds must be >= 1, got 0"):
        rounds.sweep_rounds(variants, 0, measure)
    dup = [rounds.Variant("a", "x", lambda: None)] * 2
    with pytest.raises(ValueError, match="duplicate setting labels"):
        rounds.sweep_rounds(dup, 1, measure)


@pytest.mark.parametrize("n", [1, 2, 3, 8, 17, 100])
def test_percentile_matches_numpy(n):
    rng = random.Random(n)
    values = [rng.uniform(1, 50) for _ in range(n)]
    for q in (0, 1, 25, 50, 90, 99, 100):
        assert rounds.percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-12)
    with pytest.raises(ValueError, match="q must be in"):
        rounds.percentile(values, 101)


def test_sweep_candidates_and_thread_layouts():
    assert rounds.batch_candidates([16, 32, 64, 128], 256) == [16, 32, 64, 128]
    assert rounds.batch_candidates([16, 32, 64, 128], 20) == [16, 20]  # 32.. batch all 20 alike
    assert rounds.thread_layouts(1) == [(1, 1)]
    assert rounds.thread_layouts(2) == [(2, 1), (1, 2)]
    assert rounds.thread_layouts(8) == [(8, 1), (4, 2), (1, 8)]
    assert rounds.parse_thread_layouts("2x1, 1X2,2x1") == [(2, 1), (1, 2)]
    with pytest.raises(ValueError, match="'2-1'"):
        rounds.parse_thread_layouts("2-1")
    assert rounds.parse_int_list("64,16,64", "--batch-sizes") == [64, 16]
    with pytest.raises(ValueError, match="--batch-sizes.*'0,16'"):
        rounds.parse_int_list("0,16", "--batch-sizes")
