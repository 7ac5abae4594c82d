"""benchmarks/stream_frontend.py: a small run streams every token of every request
through the server's output path and prints its CPU per token."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_small_run_prints_cpu_per_token(bart_dir):
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "stream_frontend.py"), str(bart_dir), "--streams", "4",
         "--tokens", "5", "--stream-interval", "2", "--repeat", "1"],
        capture_output=True, text=True, timeout=600)  # seconds alone; generous for a shared machine
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert "cpu_flags=" in lines[-2]
    assert re.search(r"4 streams x 5 tokens, stream_interval 2, gc frozen: CPU us per token best [\d.]+", lines[-1])
