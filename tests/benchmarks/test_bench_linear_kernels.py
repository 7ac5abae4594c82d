"""benchmarks/linear_kernels.py: its grid of shapes, and a tiny run printing a row per
(in, out, rows) cell with both kernels' times and the rule's pick."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tandem.core.layers.linear_kernels import packed_gemm_unsupported

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))
import linear_kernels  # noqa: E402


def test_shapes_are_every_pair_of_dims_then_the_extra_ones_once():
    assert linear_kernels.parse_shapes("64x2000, 768x50265") == [(64, 2000), (768, 50265)]
    shapes = linear_kernels.shapes_of([8, 16], [(16, 8), (8, 40)])
    assert shapes == [(8, 8), (8, 16), (16, 8), (16, 16), (8, 40)]


@pytest.mark.skipif(bool(packed_gemm_unsupported(torch.device("cpu"), torch.float32)),
                    reason="no oneDNN packed GEMM in this build")
def test_a_tiny_run_prints_a_row_per_cell_with_the_rules_pick():
    out = subprocess.run([sys.executable, str(BENCH / "linear_kernels.py"), "--dims", "16,512", "--extra", "",
                          "--rows", "1,3", "--threads", "1", "--dtypes", "float32", "--rounds", "2",
                          "--sample-ms", "0.2", "--working-set-mib", "1"],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    assert "cpu_flags=" in out.splitlines()[0]
    cells = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit() and "|" in line]
    assert [(c[0], c[1], c[2]) for c in cells] == [(k, n, m) for k in ("16", "512") for n in ("16", "512")
                                                   for m in ("1", "3")]
    # in out rows | dense best median | packed best median | ratio | faster rule [<- miss]
    picks = {(c[0], c[1]): c[13] for c in cells}
    assert picks[("16", "16")] == "dense" and picks[("512", "512")] == "packed"
    summary = next(line for line in out.splitlines() if line.startswith("rows <= 256, 8 cells:"))
    assert "all packed" in summary and "rule" in summary and "all dense" in summary
