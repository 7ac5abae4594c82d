"""Choosing how a loaded model's linear layers multiply (``cpu_gemm``,
``quantization``): walks the model once after loading and sets each layer's
kernel (``linear_kernels`` holds the kernels themselves)."""

from __future__ import annotations

import torch

from tandem.core.config import check_choice
from tandem.core.layers.embedding import VocabParallelEmbedding
from tandem.core.layers.linear import LinearBase
from tandem.core.layers.linear_kernels import Int8DynamicKernel, PackedCPUKernel, int8_unsupported, packed_gemm_unsupported


def prepare_linear_kernels(
    model: torch.nn.Module,
    *,
    device: torch.device,
    dtype: torch.dtype,
    gemm: str = "auto",
    quantization: str | None = None,
    batch_hint: int = 128,
) -> str:
    """Give every linear layer of ``model`` (and each tied or untied LM head) its
    kernel; returns a one-line description for the engine's start line.

    ``gemm``: "auto" (packed where :func:`packed_gemm_unsupported` is empty, else
    dense), "packed" (an error if it can't run), "dense". ``quantization``: None
    or "int8" (every linear layer and the LM head int8, as CTranslate2's int8
    does; the embedding lookups stay in ``dtype``).
    """
    check_choice("cpu_gemm", gemm)
    reasons = packed_gemm_unsupported(device, dtype)
    if gemm == "packed" and reasons:
        raise ValueError("cpu_gemm='packed' cannot run here: " + "; ".join(reasons))
    packed = gemm != "dense" and not reasons
    if quantization is not None:
        check_choice("quantization", quantization)
        why = int8_unsupported(device)
        if dtype != torch.float32:
            why.append(f"int8 dynamic quantization computes in float32, not {dtype}")
        if why:
            raise ValueError("quantization='int8' cannot run here: " + "; ".join(why))

    counts: dict[str, int] = {}
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, LinearBase):
                if quantization == "int8":
                    if module.tp_size != 1:
                        raise ValueError("quantization='int8' runs without tensor parallelism only")
                    kernel = Int8DynamicKernel(module.weight, module.bias)
                elif packed:
                    kernel = PackedCPUKernel(module.weight, batch_hint)
                else:
                    continue
                module.set_kernel(kernel)
            elif isinstance(module, VocabParallelEmbedding):
                # The table stays for lookups (a tied head); the LM-head GEMM gets its own copy.
                if quantization == "int8":
                    if module.tp.size != 1:
                        raise ValueError("quantization='int8' runs without tensor parallelism only")
                    module.logits_kernel = Int8DynamicKernel(module.weight, None)
                elif packed:
                    module.logits_kernel = PackedCPUKernel(module.weight, batch_hint)
                else:
                    continue
                kernel = module.logits_kernel
            else:
                continue
            counts[kernel.name] = counts.get(kernel.name, 0) + 1
    if not counts:
        why = "; ".join(reasons) if gemm != "dense" else "cpu_gemm='dense'"
        return f"linear layers: dense F.linear ({why})"
    return "linear layers: " + ", ".join(f"{n} x {name}" for name, n in sorted(counts.items()))
