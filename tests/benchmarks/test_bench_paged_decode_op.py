"""benchmarks/paged_decode_op.py: it prints one line per shape of its grid after the
CPU's flags, for every storage it is given."""

import subprocess
import sys
from pathlib import Path

import pytest

from tandem.backends.cpu_paged import ops

ROOT = Path(__file__).resolve().parents[2]
needs_op = pytest.mark.skipif(not ops.available(), reason="cpu_paged's C++ op is unavailable here")


@needs_op
@pytest.mark.parametrize("extra", [[], ["--kv", "fp8_e4m3", "--hot", "--clock", "cpu"]])
def test_the_benchmark_prints_every_shape(extra):
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "paged_decode_op.py"), "--rounds", "1",
                          "--round-ms", "1", "--threads", "1", "--rows", "3", "--keys", "1,17", "--head-sizes", "16,24",
                          "--dtypes", "float32,bfloat16", *extra],
                         capture_output=True, text=True, timeout=900)  # seconds alone; a build is ~1 min
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert "cpu_flags=" in lines[0] and "build=tandem_cpu_paged_" in lines[0]
    shapes = [tuple(line.split()[:4]) for line in lines[2:]]
    assert shapes == [("3", k, hs, dt) for k in ("1", "17") for hs in ("16", "24") for dt in ("float32", "bfloat16")]
