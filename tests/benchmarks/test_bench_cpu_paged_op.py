"""benchmarks/cpu_paged_op.py: it times cpu_paged's op on issue 40's decode shapes,
and it refuses to print timings of an op version whose outputs differ."""

import subprocess
import sys
from pathlib import Path

import pytest

from tandem.backends.cpu_paged import ops

ROOT = Path(__file__).resolve().parents[2]
needs_op = pytest.mark.skipif(not ops.available(), reason="cpu_paged's C++ op is unavailable here")
CASES = ["beam4 cross, grouped", "beam4 cross, per row", "256 short", "batch 1"]


def _run(*args):
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cpu_paged_op.py"), "--rounds", "1",
                           "--threads", "1", *args],
                          capture_output=True, text=True, timeout=900)  # seconds alone; a build is ~1 min


@needs_op
def test_the_benchmark_prints_every_case():
    out = _run()
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert "cpu_flags=" in lines[0] and "build=tandem_cpu_paged_" in lines[0]
    assert [line[:22].strip() for line in lines[2:]] == CASES


@needs_op
@pytest.mark.slow
def test_a_version_with_other_outputs_is_refused(tmp_path):
    source = ops.SOURCE.read_text()
    wrong = source.replace("acc[v * head_size + i] * inv[v]", "acc[v * head_size + i] * inv[v] * 1.001f")
    assert wrong != source
    (tmp_path / "wrong.cpp").write_text(wrong)
    out = _run("--against", str(tmp_path / "wrong.cpp"))
    assert out.returncode != 0
    assert "beam4 cross, grouped: --against wrong.cpp differs from this checkout's op by" in out.stderr
