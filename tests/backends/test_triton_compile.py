"""Every Triton kernel the triton backend launches, compiled ahead of time for
Hopper (sm90) and Ampere (sm80) on this CPU, through the backend's own launch
code, and checked against each target's limits (``triton_aot.py`` says how).

The default tier compiles a representative matrix (float32 / float16 / bfloat16;
head sizes 64, 80 -> padded 128, 128 and 256; GQA 8:2; mixed, long-prefill,
decode and split-K steps; self, cross and encoder attention; each with and without
the relative position bias): about two minutes per target cold, seconds from
Triton's cache. ``-m aot_full`` compiles the full
matrix (7 head sizes x MHA / GQA / MQA x block sizes 1, 16, 32) for sm80, sm86,
sm89, sm90 and sm100."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("triton")
AOT = Path(__file__).with_name("triton_aot.py")
BIN = Path(__import__("triton").__file__).parent / "backends" / "nvidia" / "bin"
pytestmark = pytest.mark.skipif(not (BIN / "ptxas").exists() or not (BIN / "cuobjdump").exists(),
                                reason="this triton wheel ships no ptxas / cuobjdump (not a linux x86-64 build)")
# Per-thread stack the compiled kernels may keep (ABI slots, a few spilled
# scalars): tiles that live on the stack cost kilobytes (6-11 KB before the
# float32 configurations were split per head size).
MAX_STACK_BYTES = 64


def _compile(tmp: Path, arch: int, *extra: str) -> dict:
    out = tmp / f"aot-{arch}-{abs(hash(extra))}.json"
    proc = subprocess.run([sys.executable, str(AOT), "--arch", str(arch), "--out", str(out), *extra],
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, f"triton_aot.py --arch {arch} {' '.join(extra)} failed:\n{proc.stderr[-4000:]}"
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> dict[int, dict]:
    tmp = tmp_path_factory.mktemp("aot")
    with ThreadPoolExecutor(2) as pool:  # one compiler process per target
        done = dict(zip((90, 80), pool.map(lambda a: _compile(tmp, a, "--matrix", "ci"), (90, 80))))
    return done


ARCHS = pytest.mark.parametrize("arch", [90, 80])


def _describe(k: dict) -> str:
    return f"{k['kernel']} {k['consts']} warps={k['num_warps']} stages={k['num_stages']} ({k['cases'][0]})"


@ARCHS
@pytest.mark.slow
def test_every_case_compiles_to_cubin(reports, arch):
    report = reports[arch]
    assert not report["errors"], "\n".join(f"{e['case']}: {e['error']}" for e in report["errors"])
    assert len(report["kernels"]) >= len(report["cases"])  # each case compiles several distinct variants


@ARCHS
def test_every_launchable_kernel_is_compiled(reports, arch):
    report = reports[arch]
    assert {k["kernel"] for k in report["kernels"]} == set(report["launchable"]) == {
        "_varlen_attn", "_decode_attn", "_combine_splits"}


@ARCHS
def test_every_kernel_fits_the_target(reports, arch):
    over = [f"{_describe(k)}: {'; '.join(k['problems'])}" for k in reports[arch]["kernels"] if k["problems"]]
    assert not over, "\n".join(over)


@ARCHS
def test_no_kernel_keeps_its_tiles_on_the_stack(reports, arch):
    spilled = [f"{_describe(k)}: stack {k['stack']} B, local {k['local']} B" for k in reports[arch]["kernels"]
               if k["stack"] > MAX_STACK_BYTES or k["local"]]
    assert not spilled, "\n".join(spilled)


@ARCHS
def test_every_bias_variant_is_compiled(reports, arch):
    """The relative position bias (T5) compiles its own variants (``HAS_BIAS``) of every
    path that takes it: causal paged prefill / chunks at both tile heights, the packed
    encoder, decodes with and without split-K; never cross attention."""
    biased = [k["consts"] for k in reports[arch]["kernels"] if k["consts"].get("HAS_BIAS")]
    varlen = {(c["PAGED"], c["CAUSAL"], c["BLOCK_M"], c["DOT_F32"]) for c in biased if "PAGED" in c}
    for dot_f32 in (True, False):
        assert {(True, True, 16, dot_f32), (False, False, 16, dot_f32)} <= varlen
    assert {(True, True, 64, False), (False, False, 64, False)} <= varlen
    assert not any(paged and not causal for paged, causal, _, _ in varlen), "a biased cross-attention variant"
    splits = {c["NUM_SPLITS"] > 1 for c in biased if "NUM_SPLITS" in c and "PAGE" in c}
    assert splits == {False, True}


def test_hopper_prefill_and_encoder_tiles_use_wgmma(reports):
    wide = [k for k in reports[90]["kernels"]
            if k["kernel"] == "_varlen_attn" and not k["consts"]["DOT_F32"] and k["consts"]["BLOCK_M"] == 64]
    # paged causal (prefill), paged non-causal (cross), packed (encoder), for each 16-bit case
    assert {(k["consts"]["PAGED"], k["consts"]["CAUSAL"]) for k in wide} == {(True, True), (True, False),
                                                                            (False, False)}
    assert all(k["mma"] == "wgmma" for k in wide), [_describe(k) for k in wide if k["mma"] != "wgmma"]
    # Ampere has no wgmma: the same tiles are mma.sync there; float32 stays off the tensor cores (IEEE).
    assert {k["mma"] for k in reports[80]["kernels"] if k["kernel"] == "_varlen_attn"
            and not k["consts"]["DOT_F32"]} == {"mma.sync"}
    assert {k["mma"] for r in reports.values() for k in r["kernels"] if k["consts"].get("DOT_F32")} == {"fma"}


def test_the_check_catches_the_old_encoder_launch(tmp_path):
    # The launch the backend used before (16 x 64 tiles, 3 stages, 4 warps for every
    # dtype): float32 with 256-wide heads asks for 282,688 bytes of shared memory,
    # over H100's 232,448 -- OutOfResources at the first call on a GPU.
    report = _compile(tmp_path, 90, "--only", "float32/d256/h8:2/b16/long", "--force-varlen", "16,64,4,3")
    problems = [p for k in report["kernels"] for p in k["problems"]]
    assert problems and all(p.startswith("shared memory") and "> 232448" in p for p in problems), problems
    assert {k["dynamic_shared"] for k in report["kernels"] if k["problems"]} >= {282688}


@pytest.mark.slow
@pytest.mark.parametrize("arch", [90, 89])
def test_fp8_kv_cache_variants_compile_and_fit(tmp_path, arch):
    """kv_cache_dtype fp8: the KV_FP8 kernels (e4m3 and e5m2 tiles upcast to the query's
    dtype) for Hopper and Ada, the targets with native float8e4nv."""
    report = _compile(tmp_path, arch, "--matrix", "fp8")
    assert not report["errors"], "\n".join(f"{e['case']}: {e['error']}" for e in report["errors"][:20])
    fp8 = [k for k in report["kernels"] if k["consts"].get("KV_FP8")]
    assert {k["kernel"] for k in fp8} >= {"_varlen_attn", "_decode_attn"}
    assert {c.split("/")[-1] for k in fp8 for c in k["cases"]} == {"fp8_e4m3", "fp8_e5m2"}
    over = [f"{_describe(k)}: {'; '.join(k['problems'])}" for k in report["kernels"] if k["problems"]]
    assert not over, "\n".join(over[:20])
    spilled = [_describe(k) for k in report["kernels"] if k["stack"] > MAX_STACK_BYTES or k["local"]]
    assert not spilled, "\n".join(spilled[:20])


@pytest.mark.aot_full
@pytest.mark.parametrize("arch", [80, 86, 89, 90, 100])
def test_full_matrix(tmp_path, arch):
    report = _compile(tmp_path, arch, "--matrix", "full")
    assert not report["errors"], "\n".join(f"{e['case']}: {e['error']}" for e in report["errors"][:20])
    over = [f"{_describe(k)}: {'; '.join(k['problems'])}" for k in report["kernels"] if k["problems"]]
    assert not over, "\n".join(over[:20])
    spilled = [_describe(k) for k in report["kernels"] if k["stack"] > MAX_STACK_BYTES or k["local"]]
    assert not spilled, "\n".join(spilled[:20])
