"""benchmarks/packing.py: the step's GEMM shapes, and a tiny run printing one row
per row count with a cell per packing."""

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))
import packing  # noqa: E402


def test_step_shapes_are_the_decoders_projections_then_the_lm_head():
    shapes = packing.step_shapes(d_model=8, ffn=32, layers=2, vocab=50)
    assert len(shapes) == 2 * 6 + 1 and shapes[-1] == ("lm_head", 50, 8)
    # Weights read per step: 2 layers x (qkv 3d^2 + 3 d^2 + 2 d*ffn) + vocab x d.
    assert sum(o * i for _, o, i in shapes) == 2 * (3 * 64 + 3 * 64 + 2 * 8 * 32) + 50 * 8


def test_a_tiny_run_prints_a_row_per_row_count():
    out = subprocess.run([sys.executable, str(BENCH / "packing.py"), "--d-model", "16", "--ffn", "32", "--layers", "1",
                          "--vocab", "40", "--rows", "1,3", "--hints", "1,8", "--rounds", "2", "--threads", "1"],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    assert "cpu_flags=" in out and "packed for 1" in out and "packed for 8" in out
    rows = [line.split()[0] for line in out.splitlines()[-2:]]
    assert rows == ["1", "3"]
