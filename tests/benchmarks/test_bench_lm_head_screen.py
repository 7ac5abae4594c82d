"""benchmarks/lm_head_screen.py on the trained demo checkpoint: it captures real decoder
hidden states, and its screened tokens equal the float32 argmax (it refuses to print
otherwise)."""

import subprocess
import sys
from pathlib import Path

import tandem

ROOT = Path(__file__).resolve().parents[2]


def test_the_benchmark_runs_and_checks_its_tokens():
    demo = Path(tandem.__file__).parent / "demo_model"
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "lm_head_screen.py"), "--model", str(demo),
         "--rows", "1,3", "--rounds", "2", "--threads", "1"],
        capture_output=True, text=True, timeout=600)  # ~10 s alone; generous for a shared machine
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert "cpu_flags=" in lines[0]
    rows = [line.split() for line in lines if line.strip()[:1].isdigit()]
    assert [r[0] for r in rows] == ["1", "3"]
    for r in rows:
        assert float(r[-2]) >= 1.0  # candidates per row: at least the winner
