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

A kernel replaces the dense weight it was built from: after
:func:`prepare_linear_kernels` the layer's ``weight`` parameter is an empty
placeholder, so memory holds one copy of each weight.
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
        return _add_residual(activate(y, activation), residual)


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
