"""How a linear layer multiplies, chosen once after the weights are loaded.

- :class:`DenseKernel` is ``F.linear`` on the layer's own ``weight`` (every
  device and dtype; what a layer does before :func:`prepare_linear_kernels`).
- :class:`PackedCPUKernel` multiplies by a copy of the weight that oneDNN has
  reordered once into its blocked GEMM layout (``mkldnn._reorder_linear_weight``
  / ``mkldnn._linear_pointwise``, the ops inductor's CPU freezing emits), with
  ReLU fused into the GEMM's epilogue (GELU too on AVX-512 CPUs: see
  ``fused_epilogues``) and a row-parallel layer's residual add as oneDNN's
  binary post-op. ``F.linear`` re-packs the
  ``[out, in]`` weight on every call; for decode-sized batches that is most of
  the work (bart-base's LM head, 128 rows: 64 -> 113 GFLOP/s on a 2-core AVX2
  EPYC, see docs/performance.md).
- :class:`Int8DynamicKernel` is ``quantization="int8"``: weights quantized
  once per output channel (symmetric int8), activations per tensor at run time
  (``quantized::linear_dynamic`` from PyTorch's x86 / fbgemm engine), output in
  float32. The LM head is quantized too (one int8 row per vocabulary entry;
  the embedding table for lookups stays in float32): it is a third of a
  bart-base decode step's GEMM work, and int8 runs it ~1.3x faster at 128-256
  rows on a 2-core AVX2 EPYC (benchmarks/int8_quality.py has the quality cost).

Which float32 layers pack (``cpu_gemm="auto"``, :func:`packed_beats_dense`):
those with more than :data:`DENSE_MAX_WEIGHTS` (65,536) weights. oneDNN costs a
fixed ~15-25 us a call before any arithmetic where ``F.linear`` costs
~3-6, more than a small GEMM's whole arithmetic: on a 2-core Xeon (2 threads)
64 -> 64 at 256 rows took 13.7 us dense against 32.4 packed, the tiny BART's
fc1 (64 -> 256) 37.6 against 53.2.
benchmarks/linear_kernels.py times both kernels over in x out in {64, ..., 1024}
plus bart-base's shapes, rows 1-1024, 1 and 2 threads, float32 and bfloat16
(docs/performance.md, "Small layers stay dense", has the table): at 1-256 rows,
on AVX-512 and with torch, oneDNN and MKL capped at AVX2, dense was faster on
426 of the 432 cells of layers of at most 65,536 weights (1.9-6.9x at one row),
and the other 6 (48-64 Ki weights at 256 rows) lost by at most 8%. Above the
bar a Xeon's MKL stays close to the packed kernel (dense was ahead on most
cells up to ~1M weights there), but an AVX2 EPYC's is not (bart-base's fc1 at
16 rows: 45-69 GFLOP/s dense against 92-114 packed): MKL re-packs the weight
each call, ~0.1-0.4 ns a weight there, which passes oneDNN's fixed cost
somewhere between ~40 Ki and ~180 Ki weights. So the bar stays where both
CPUs agree, and bart-base's layers (576 Ki weights and up) keep packing.
A rule, not a timing at load: the choice is the same on every start (the two
kernels round differently, so a timed choice could change outputs between
starts on one machine), costs nothing, and is tested. Rows do not enter it:
they change every step while the kernel is chosen once, and under the bar
dense won at nearly every row count. bfloat16 always packs:
its ``F.linear`` is a oneDNN matmul too (on the unpacked weight, every call:
``ONEDNN_VERBOSE=1`` shows it), so it pays the fixed cost as well, and the
packed kernel was as fast or faster on 471 of 504 cells (it lost 4.5x at one
row of 64 -> 64, which torch runs without oneDNN, and at most 1.32x elsewhere).
``cpu_gemm="packed"`` packs every layer whatever its size.

A kernel replaces the dense weight it was built from: after
:func:`prepare_linear_kernels` the layer's ``weight`` parameter is an empty
placeholder, so memory holds one copy of each weight. A layer left dense keeps
its ``weight`` and :class:`DenseKernel` (what a compiled decode step traces as
an ordinary ``F.linear``; the packed and int8 kernels are opaque ops there).
"""

from __future__ import annotations

import logging
import warnings

import torch
import torch.nn.functional as F

from tandem.core.layers.opaque_ops import packed_linear

logger = logging.getLogger(__name__)

# Epilogues the packed kernel fuses; any other activation runs after the GEMM.
# GELU is fused only where torch runs AVX-512 kernels: on a 2-core AVX2 EPYC
# oneDNN's erf-GELU epilogue cost more than the GEMM saved (768 -> 3072 at M=128:
# 95 GFLOP/s-equivalent fused vs 121-124 with a separate F.gelu; at M=4480: 87-93
# vs 106-112; tanh GELU no better), while on an AVX-512 EPYC (avx512_bf16) the
# fused epilogue is no slower in float32 (bit-equal output) and saves bfloat16 a
# pass over the [M, ffn] output and its second rounding (docs/performance.md,
# "Issue 40"). ``fused_epilogues`` is the one place that decides.
_FUSED = {"relu": ("relu", [], "")}
_FUSED_AVX512 = {**_FUSED, "gelu": ("gelu", [], "none")}


# cpu_gemm="auto": a float32 layer of at most this many weights (in x out, this rank's;
# 256 KiB) runs F.linear, a larger one the packed kernel (the module docstring has why).
DENSE_MAX_WEIGHTS = 1 << 16


def packed_beats_dense(in_features: int, out_features: int, dtype: torch.dtype) -> bool:
    """Whether ``cpu_gemm="auto"`` gives a layer whose weight is ``[out_features, in_features]``
    the packed kernel rather than ``F.linear`` (where oneDNN runs ``dtype`` at all:
    :func:`packed_gemm_unsupported`). float32: above :data:`DENSE_MAX_WEIGHTS` weights;
    bfloat16: always. The module docstring has the evidence."""
    if dtype != torch.float32:
        return True
    return in_features * out_features > DENSE_MAX_WEIGHTS


def fused_epilogues(capability: str | None = None) -> dict[str, tuple[str, list, str]]:
    """The activations :class:`PackedCPUKernel` fuses into its GEMM on a CPU whose torch
    capability is ``capability`` (this process's by default)."""
    if capability is None:
        capability = torch.backends.cpu.get_cpu_capability()
    return _FUSED_AVX512 if capability.startswith("AVX512") else _FUSED


class DenseKernel:
    name = "dense"

    def __call__(self, layer, x: torch.Tensor, bias: torch.Tensor | None, activation: str | None,
                 residual: torch.Tensor | None = None):
        y = F.linear(x, layer.weight, bias)
        if activation is not None:
            y = activate(y, activation)
        # A layer too small to pack runs every step: no Python call that has nothing to do.
        return y if residual is None else _add_residual(y, residual)


def _add_residual(y: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """``residual + y`` written into the GEMM's fresh output (float addition commutes,
    so the result is bit-equal to ``residual + y``)."""
    if residual is None:
        return y
    if y.requires_grad or residual.requires_grad or residual.shape != y.shape or residual.dtype != y.dtype:
        return residual + y  # autograd, broadcasting or type promotion: out of place, as the caller's add
    return y.add_(residual)


def activate(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    """The activation on a GEMM's fresh output, in place: no second ``[M, ffn]``
    tensor to allocate and write (the encoder's fc1 output is ~100 MiB at 9K
    tokens). Outside inference mode a tensor that needs grad gets the
    out-of-place op."""
    if activation is None:
        return y
    if activation == "gelu":
        return F.gelu(y) if y.requires_grad else torch.ops.aten.gelu_(y)
    if activation == "relu":
        return F.relu(y) if y.requires_grad else y.relu_()
    raise ValueError(f"activation={activation!r}: a linear layer fuses only 'gelu' or 'relu'")


class _Opaque:
    """A kernel a compiled step calls as ``torch.ops.tandem.packed_linear`` (layers/opaque_ops.py):
    ``opaque_index`` is its place in the step's context, set by the compiled step."""

    opaque_index: int | None = None

    def _traced(self, x: torch.Tensor, bias: torch.Tensor | None, activation: str | None):
        return packed_linear(x, bias, self.opaque_index, activation or "")


class PackedCPUKernel(_Opaque):
    name = "packed"

    def __init__(self, weight: torch.Tensor, batch_hint: int) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint)
        self.batch_hint = batch_hint  # the rows oneDNN chose the blocked layout for
        self.out_features = weight.shape[0]
        self.fused = fused_epilogues()

    def __call__(self, layer, x: torch.Tensor, bias: torch.Tensor | None, activation: str | None,
                 residual: torch.Tensor | None = None):
        if self.opaque_index is not None and torch.compiler.is_compiling():
            return _add_residual(self._traced(x, bias, activation), residual)
        if residual is not None and activation is None and _fusable_residual(x, residual, self.out_features):
            # oneDNN's binary post-op: (x W^T + bias) + residual in the GEMM's epilogue, one
            # pass fewer over the output (bit-equal in float32; bfloat16 rounds once, not twice).
            return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.packed, bias, "add")
        attr, scalars, algorithm = self.fused.get(activation, ("none", [], ""))
        y = torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, attr, scalars, algorithm)
        y = y if activation is None or activation in self.fused else activate(y, activation)
        return _add_residual(y, residual)


def _fusable_residual(x: torch.Tensor, residual: torch.Tensor, out_features: int) -> bool:
    """Whether oneDNN can add ``residual`` in the GEMM: the output's exact shape, dtype and a
    dense row-major layout (anything else is added after the GEMM)."""
    return (residual.dtype == x.dtype and residual.shape == (*x.shape[:-1], out_features)
            and residual.is_contiguous() and not (x.requires_grad or residual.requires_grad))


class Int8DynamicKernel(_Opaque):
    name = "int8"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        w = weight.detach().float()
        scales = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12).double()
        zero_points = torch.zeros(w.shape[0], dtype=torch.long)
        with warnings.catch_warnings():
            # PyTorch 2.13 marks quantized tensor creation as deprecated (torchao is the successor);
            # int8_unsupported() reports it once the ops are gone.
            warnings.filterwarnings("ignore", message=".*quantize_per_.*deprecated", category=UserWarning)
            qweight = torch.quantize_per_channel(w, scales, zero_points, 0, torch.qint8)
        self.packed = torch.ops.quantized.linear_prepack(qweight, None if bias is None else bias.detach().float())
        self.has_bias = bias is not None
        self.out_features = weight.shape[0]

    def __call__(self, layer, x: torch.Tensor, bias: torch.Tensor | None, activation: str | None,
                 residual: torch.Tensor | None = None):
        if self.opaque_index is not None and torch.compiler.is_compiling():
            return _add_residual(self._traced(x, bias, activation), residual)
        shape = x.shape
        # reduce_range: 7-bit activations, so AVX2's int16 pair sums (vpmaddubsw) never saturate.
        y = torch.ops.quantized.linear_dynamic(x.reshape(-1, shape[-1]).float(), self.packed, True)
        if self.has_bias and bias is None:  # the bias lives in the packed weight; a rank that must not add it
            raise RuntimeError("Int8DynamicKernel: a packed bias cannot be dropped on this rank")
        if bias is not None and not self.has_bias:  # a call-time bias (the LM head's final_logits_bias)
            y.add_(bias)
        return _add_residual(activate(y.reshape(*shape[:-1], y.shape[-1]).to(x.dtype), activation), residual)


def onednn_bf16_gemm() -> bool:
    """Whether oneDNN runs bfloat16 GEMMs on this CPU (avx512bw/vl/dq, avx_ne_convert
    or AMX; ``ONEDNN_MAX_CPU_ISA`` can lower it). One place, so tests take both branches."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def packed_gemm_unsupported(device: torch.device, dtype: torch.dtype) -> list[str]:
    """Why the oneDNN packed kernel can't run here (empty: it can)."""
    reasons = []
    if device.type != "cpu":
        reasons.append(f"device {device.type} is not cpu")
    if not torch.backends.mkldnn.is_available():
        reasons.append("this PyTorch build has no oneDNN (mkldnn)")
    if dtype == torch.bfloat16 and not onednn_bf16_gemm():
        reasons.append("oneDNN has no bfloat16 GEMM on this CPU (it needs avx512bw/vl/dq, avx_ne_convert or AMX)")
    elif dtype not in (torch.float32, torch.bfloat16):
        reasons.append(f"dtype {dtype} is not float32 or bfloat16")
    return reasons


def int8_unsupported(device: torch.device) -> list[str]:
    reasons = []
    if device.type != "cpu":
        reasons.append(f"int8 dynamic quantization runs on CPU only, not {device.type}")
    if not all(hasattr(torch.ops.quantized, op) for op in ("linear_prepack", "linear_dynamic")):
        reasons.append("this PyTorch build has no quantized::linear_dynamic (removed after its deprecation)")
    engines = torch.backends.quantized.supported_engines
    if not any(e in engines for e in ("x86", "fbgemm", "onednn")):
        reasons.append(f"this PyTorch build has no x86 quantized engine (it has {engines})")
    return reasons
