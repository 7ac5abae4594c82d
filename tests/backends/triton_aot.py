"""Compile the triton backend's kernels ahead of time for a CUDA target, without a GPU.

Triton's compiler (ttir -> ttgir -> llir -> ptx -> cubin, ptxas included in the
wheel) needs no GPU; only its driver asks one for the target. A stand-in driver
reports ``GPUTarget("cuda", ARCH, 32)``, ``JITFunction.run`` is switched to
warm-up mode (compile, never launch), and the backend's own code then runs
unchanged: its metadata builder on a step's layout, ``TritonImpl.forward`` for
each attention kind, its launch-configuration choice and launchers. Every kernel
those launches compile is checked against the target's limits
(``tandem.backends.triton.configs.TARGETS``): shared memory per block, registers
per thread and per block, local memory (spills) and stack from ``cuobjdump
-res-usage`` on the cubin, and which MMA instructions the PTX uses.

Run as a script (its own process: the kernels must load with the interpreter
off, and the stand-in driver is process-wide):

    python tests/backends/triton_aot.py --arch 90 --matrix ci --out report.json
    python tests/backends/triton_aot.py --arch 80 --matrix full
    python tests/backends/triton_aot.py --arch 90 --only float32/256 --force-varlen 16,64,4,3

The report is one JSON object per compiled kernel variant; ``problems`` lists
what would fail on the target (empty when it fits). Triton's own on-disk cache
makes a second run of the same matrix fast.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, replace
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"  # before triton and the kernels load
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # triton 3.9 warns when unset; 1 is its default

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from layouts import Seq, random_layout, step_inputs  # noqa: E402

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# kv_cache_dtype's fp8 formats (the KV_FP8 kernel variants); "" is the model's dtype.
KV_DTYPES = {"": None, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


@dataclass(frozen=True)
class Case:
    dtype: str
    head_size: int
    num_heads: int
    num_kv_heads: int
    block_size: int
    layout: str  # see LAYOUTS
    bias: bool = False  # the relative position bias (T5) in self-attention: the HAS_BIAS variants
    kv: str = ""  # an fp8 cache (KV_DTYPES): the KV_FP8 variants

    @property
    def label(self) -> str:
        return (f"{self.dtype}/d{self.head_size}/h{self.num_heads}:{self.num_kv_heads}/"
                f"b{self.block_size}/{self.layout}" + ("/bias" if self.bias else "") +
                (f"/{self.kv}" if self.kv else ""))


def _layout(name: str, block_size: int) -> tuple[list[Seq], int, int | None]:
    """(sequences, pool blocks, split-K threshold) of a named step layout."""
    rng = random.Random(0)
    if name in ("mixed", "decodes"):
        seqs, blocks = random_layout(rng, block_size, name)
        return seqs, blocks, None
    if name == "split":  # decodes over caches long enough to split 4 ways
        seqs, blocks = random_layout(rng, block_size, "decodes")
        return seqs, blocks, 8
    if name == "long":  # a long prefill (wide tiles) next to a decode; one long encoder run
        def table(start, n):
            return list(range(start, start + -(-n // block_size)))
        enc, q = 200, 96
        cross = table(0, enc)
        a = table(len(cross), q)
        b = table(len(cross) + len(a), 31)
        seqs = [Seq(0, 0, q, a, enc, cross, True), Seq(1, 30, 1, b, 40, cross[: -(-40 // block_size)], False)]
        return seqs, len(cross) + len(a) + len(b) + 1, None
    raise ValueError(f"unknown layout {name!r}")


LAYOUTS = ("mixed", "long", "decodes", "split")


def matrix(kind: str) -> list[Case]:
    if kind == "ci":
        # Every kernel and launch path once per dtype family; the head sizes that
        # stress resources (256) and padding (80 -> 128).
        combos = [("float32", 64), ("float32", 256), ("float16", 64), ("float16", 80), ("float16", 256),
                  ("bfloat16", 128)]
        # Each with and without the relative position bias (its own kernel variants).
        return [Case(dt, d, 8, 2, 16, lay, bias) for bias in (False, True) for dt, d in combos for lay in LAYOUTS]
    if kind == "fp8":
        # The KV_FP8 variants: each fp8 format under each query dtype, every layout (and the
        # bias once), at the head sizes that stress registers (256) and padding (80).
        combos = [("float32", 64), ("float16", 80), ("float16", 256), ("bfloat16", 128)]
        return [Case(dt, d, 8, 2, 16, lay, bias, kv) for kv in ("fp8_e4m3", "fp8_e5m2") for dt, d in combos
                for lay in LAYOUTS for bias in ((False, True) if lay == "mixed" else (False,))]
    if kind == "full":
        heads = [(8, 8), (8, 2), (32, 1)]
        return [Case(dt, d, h, kv, bs, lay, bias)
                for dt, d, (h, kv), bs, lay, bias in itertools.product(
                    DTYPES, (64, 72, 80, 96, 128, 160, 256), heads, (1, 16, 32), LAYOUTS, (False, True))]
    raise ValueError(f"unknown matrix {kind!r}")


# -- the stand-in driver and warm-up launches ----------------------------------


def install_stand_in_driver(arch: int) -> None:
    from triton.backends.compiler import GPUTarget
    from triton.backends.driver import DriverBase
    from triton.runtime import driver

    class StandInCudaDriver(DriverBase):
        """Answers what compilation asks of a driver; launching is never reached."""

        @classmethod
        def is_active(cls):
            return True

        def map_python_to_cpp_type(self, ty):
            raise NotImplementedError("stand-in driver: nothing is launched")

        def get_current_target(self):
            return GPUTarget("cuda", arch, 32)

        def get_active_torch_device(self):
            return torch.device("cpu")

        def get_benchmarker(self):
            raise NotImplementedError("stand-in driver: nothing is launched")

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_device_interface(self):
            return torch.cuda

    driver.set_active(StandInCudaDriver())


_LAUNCHES: list[tuple[object, dict]] = []


def compile_instead_of_launch() -> None:
    from triton.runtime.jit import JITFunction

    real_run = JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        kernel = real_run(self, *args, grid=grid, warmup=True, **kwargs)
        consts = {k: v for k, v in kwargs.items() if isinstance(v, (bool, int, str)) or v is None}
        _LAUNCHES.append((kernel, consts))
        return kernel

    JITFunction.run = run


def launchable_kernels() -> set[str]:
    """The @triton.jit functions of the kernels module that no other one calls:
    the kernels the backend launches."""
    from triton.runtime.jit import JITFunction

    from tandem.backends.triton import kernels

    jits = {n: f for n, f in vars(kernels).items() if isinstance(f, JITFunction)}
    return {n for n, f in jits.items() if not any(n in g.src for m, g in jits.items() if m != n)}


# -- running the backend's own launch code on one case --------------------------


def run_case(case: Case, arch: int, force_varlen=None) -> list[tuple[object, dict]]:
    from tandem.backends.triton import backend as tb
    from tandem.backends.triton import configs
    from tandem.core.attention import AttentionType, KVCacheSpec
    from tandem.core.relative_position import RelativePositionBias

    dtype = DTYPES[case.dtype]
    seqs, num_blocks, split = _layout(case.layout, case.block_size)
    builder_cls = tb.TritonMetadataBuilder
    if split is not None:
        builder_cls = type("SplitBuilder", (builder_cls,), {"split_kv_tokens": split})
    builder = builder_cls(case.block_size, torch.device("cpu"), KVCacheSpec(1, case.num_kv_heads, case.head_size))
    inputs = step_inputs(seqs, case.block_size)
    md = builder.build(inputs)
    later = builder.build(step_inputs([replace(s, run_encoder=False) for s in seqs], case.block_size))
    impl = tb.TritonImpl(case.num_heads, case.head_size, case.head_size ** -0.5, case.num_kv_heads)
    cache = tb.TritonBackend.allocate_kv_cache(num_blocks, case.block_size, case.num_kv_heads, case.head_size,
                                               KV_DTYPES[case.kv] or dtype, torch.device("cpu"))
    t, e = sum(inputs.query_lens), sum(inputs.encoder_seq_lens)

    def rand(n, h):
        return torch.zeros(n, h, case.head_size, dtype=dtype)

    def bias(bidirectional):  # t5-small's bucketing; a fresh one per stack, as the model makes them
        if not case.bias:
            return {}
        return {"position_bias": RelativePositionBias(torch.zeros(32, case.num_heads, dtype=dtype), 32, 128,
                                                      bidirectional)}

    saved = configs.varlen
    if force_varlen is not None:
        configs.varlen = lambda *a, **k: configs.LaunchConfig(*force_varlen)
    start = len(_LAUNCHES)
    try:
        impl.forward(rand(t, case.num_heads), rand(t, case.num_kv_heads), rand(t, case.num_kv_heads), cache, md,
                     AttentionType.DECODER, **bias(False))
        ck = rand(e, case.num_kv_heads) if e else None
        impl.forward(rand(t, case.num_heads), ck, ck, cache, md, AttentionType.ENCODER_DECODER)
        impl.forward(rand(t, case.num_heads), None, None, cache, later, AttentionType.ENCODER_DECODER)
        if e:
            impl.forward(rand(e, case.num_heads), rand(e, case.num_kv_heads), rand(e, case.num_kv_heads), None, md,
                         AttentionType.ENCODER, **bias(True))
    finally:
        configs.varlen = saved
    return _LAUNCHES[start:]


# -- what a compiled kernel needs, against the target ---------------------------


def _tool(name: str) -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def resource_usage(cubin: bytes) -> dict:
    """REG / STACK / SHARED / LOCAL of the cubin's kernel, from ``cuobjdump -res-usage``."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([_tool("cuobjdump"), "-res-usage", f.name], capture_output=True, text=True,
                             check=True).stdout
    line = next(ln for ln in out.splitlines() if "REG:" in ln)
    fields = dict(tok.split(":", 1) for tok in line.split() if ":" in tok)
    return {k.lower(): int(fields[k]) for k in ("REG", "STACK", "SHARED", "LOCAL")}


def mma_kind(ptx: str) -> str:
    if "wgmma.mma_async" in ptx:
        return "wgmma"
    if "tcgen05.mma" in ptx:
        return "tcgen05"
    if "mma.sync" in ptx:
        return "mma.sync"
    return "fma"


def check(kernel, consts: dict, arch: int) -> dict:
    from tandem.backends.triton.configs import target

    lim = target(arch)
    md = kernel.metadata
    res = resource_usage(kernel.asm["cubin"])
    num_warps = md.num_warps
    shared = md.shared  # dynamic shared memory Triton asks for at launch (its OutOfResources check)
    problems = []
    if shared + res["shared"] > lim.max_shared_bytes:
        problems.append(f"shared memory {shared + res['shared']} bytes > {lim.max_shared_bytes} on {lim.name}")
    if res["reg"] > lim.max_regs_per_thread:
        problems.append(f"{res['reg']} registers per thread > {lim.max_regs_per_thread}")
    if res["reg"] * 32 * num_warps > lim.regs_per_block:
        problems.append(f"{res['reg']} registers x {32 * num_warps} threads > {lim.regs_per_block} per block")
    return {
        "kernel": kernel.name, "arch": arch, "hash": md.hash, "num_warps": num_warps,
        "num_stages": md.num_stages, "dynamic_shared": shared, **res,
        "mma": mma_kind(kernel.asm["ptx"]),
        "consts": {k: v for k, v in consts.items() if k.isupper()},
        "problems": problems,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, required=True, help="compute capability as major*10+minor, e.g. 90")
    ap.add_argument("--matrix", default="ci", choices=("ci", "full", "fp8"))
    ap.add_argument("--only", help="cases whose label contains this text")
    ap.add_argument("--force-varlen", help="block_m,block_n,num_warps,num_stages for every varlen launch")
    ap.add_argument("--out", help="write the JSON report here (default: stdout)")
    args = ap.parse_args(argv)

    install_stand_in_driver(args.arch)
    compile_instead_of_launch()
    force = tuple(int(x) for x in args.force_varlen.split(",")) if args.force_varlen else None
    cases = [c for c in matrix(args.matrix) if not args.only or args.only in c.label]
    seen: dict[str, dict] = {}
    errors = []
    t0 = time.perf_counter()
    for case in cases:
        try:
            launches = run_case(case, args.arch, force)
        except Exception as exc:  # a compile failure is a finding, reported per case
            errors.append({"case": case.label, "arch": args.arch,
                           "error": "".join(traceback.format_exception_only(exc)).strip()[-2000:]})
            continue
        for kernel, consts in launches:
            entry = seen.get(kernel.metadata.hash)
            if entry is None:
                entry = seen[kernel.metadata.hash] = check(kernel, consts, args.arch) | {"cases": []}
            entry["cases"].append(case.label)
    report = {
        "arch": args.arch, "matrix": args.matrix, "cases": [asdict(c) | {"label": c.label} for c in cases],
        "kernels": list(seen.values()), "errors": errors,
        "launchable": sorted(launchable_kernels()), "seconds": round(time.perf_counter() - t0, 1),
        "triton": __import__("triton").__version__,
    }
    text = json.dumps(report, indent=1)
    if args.out:
        Path(args.out).write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
