"""Choosing how a loaded model's linear layers multiply (``cpu_gemm``,
``quantization``): walks the model once after loading and sets each layer's
kernel (``linear_kernels`` holds the kernels themselves)."""

from __future__ import annotations

import torch

from tandem.core.config import check_choice
from tandem.core.layers.embedding import VocabParallelEmbedding
from tandem.core.layers.linear import LinearBase
from tandem.core.layers.lm_head_screen import ScreenedHead, screen_unsupported
from tandem.core.layers.linear_kernels import (
    DENSE_MAX_WEIGHTS,
    Int8DynamicKernel,
    PackedCPUKernel,
    int8_unsupported,
    packed_beats_dense,
    packed_gemm_unsupported,
)

# Rows an encoder's GEMMs see: a source of tens to hundreds of tokens per request
# (Whisper: 1500 frames), so the large-GEMM packing whatever max_num_seqs is.
ENCODER_BATCH_HINT = 128


def _encoder_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's encoder-side submodules (``EncoderDecoderModel.encoder_modules``);
    none for a module without the method (a test's bare layer)."""
    fn = getattr(model, "encoder_modules", None)
    return list(fn()) if callable(fn) else []


def prepare_linear_kernels(
    model: torch.nn.Module,
    *,
    device: torch.device,
    dtype: torch.dtype,
    gemm: str = "auto",
    quantization: str | None = None,
    batch_hint: int = 128,
    encoder_batch_hint: int = ENCODER_BATCH_HINT,
    screen: str = "off",
) -> str:
    """Give every linear layer of ``model`` (and each tied or untied LM head) its
    kernel; returns a one-line description for the engine's start line.

    ``gemm``: "auto" (packed where :func:`packed_gemm_unsupported` is empty and
    :func:`~tandem.core.layers.linear_kernels.packed_beats_dense` says so for the
    layer's shape, else dense), "packed" (every layer; an error if it can't run),
    "dense". ``quantization``: None
    or "int8" (every linear layer and the LM head int8, as CTranslate2's int8
    does; the embedding lookups stay in ``dtype``).

    ``batch_hint`` is the row count oneDNN packs the decoder's weights and the LM
    head for (the worker passes ``min(max_num_seqs, 128)``: a decode step has one
    row per running sequence); the layers under ``model.encoder_modules()`` run
    over whole inputs and are packed for ``encoder_batch_hint`` rows instead. The
    packing is the same arithmetic in another blocked layout (bit-equal outputs),
    but its speed depends on the rows: on a 2-core AVX-512 EPYC, bart-base's
    decode-step GEMMs at one row took 17.7 ms (median) packed for 1 row against 18.7
    packed for 128, while at 4-16 rows the 1-row packing was 30-50% slower
    (docs/performance.md, "Packing for the batch"; benchmarks/packing.py).

    ``screen`` ("auto" or "off", ``lm_head_screen``): "auto" gives each LM head an
    int8 copy from which greedy steps of few rows take their exact float32 argmax
    (``lm_head_screen``), where :func:`lm_head_screen.screen_unsupported` is empty
    and without ``quantization`` (whose head is int8 already).
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

    def float_kernel(weight: torch.Tensor, hint: int) -> PackedCPUKernel | None:
        """A packed copy of this rank's ``[out, in]`` weight, or None: F.linear on it (too small
        to pack under "auto", or no packing at all)."""
        if packed and (gemm == "packed" or packed_beats_dense(weight.shape[1], weight.shape[0], dtype)):
            return PackedCPUKernel(weight, hint)
        return None

    check_choice("lm_head_screen", screen)
    screen_why = ["off"] if screen == "off" else (
        [f"quantization={quantization!r}"] if quantization is not None else screen_unsupported(device, dtype))
    screens = 0
    encoder_side = {id(m) for enc in _encoder_modules(model) for m in enc.modules()}
    counts: dict[str, int] = {}
    with torch.no_grad():
        for module in model.modules():
            hint = encoder_batch_hint if id(module) in encoder_side else batch_hint
            if isinstance(module, LinearBase):
                if quantization == "int8":
                    if module.tp_size != 1:
                        raise ValueError("quantization='int8' runs without tensor parallelism only")
                    kernel = Int8DynamicKernel(module.weight, module.bias)
                else:
                    kernel = float_kernel(module.weight, hint)
                if kernel is not None:
                    module.set_kernel(kernel)
                name = kernel.name if kernel is not None else module.kernel.name
            elif isinstance(module, VocabParallelEmbedding):
                if not screen_why and module.tp.size == 1:
                    module.screen_head = ScreenedHead(module.weight)
                    screens += 1
                # The table stays for lookups (a tied head); the LM-head GEMM gets its own copy
                # (or, left without one, runs F.linear on the table).
                if quantization == "int8":
                    if module.tp.size != 1:
                        raise ValueError("quantization='int8' runs without tensor parallelism only")
                    module.logits_kernel = Int8DynamicKernel(module.weight, None)
                else:
                    # The LM head runs in every decode step, even where the table is shared
                    # with the encoder's embedding (BART's model.shared).
                    module.logits_kernel = float_kernel(module.weight, batch_hint)
                name = "dense" if module.logits_kernel is None else module.logits_kernel.name
            else:
                continue
            counts[name] = counts.get(name, 0) + 1
    if screen != "off" and quantization is None:  # int8's head is int8 already: nothing to say
        counts_note = (f"; lm_head_screen: {screens} int8 LM-head cop{'y' if screens == 1 else 'ies'} for greedy steps"
                       if screens else "; lm_head_screen off: " + ("; ".join(screen_why) or "no LM head"))
    else:
        counts_note = ""
    if not counts or (quantization is None and not packed):
        why = "; ".join(reasons) if gemm != "dense" else "cpu_gemm='dense'"
        return f"linear layers: dense F.linear ({why})" + counts_note
    said = "linear layers: " + ", ".join(f"{n} x {name}" for name, n in sorted(counts.items()))
    if "dense" in counts:  # chosen by shape (cpu_gemm="auto")
        said += (f" (dense: float32 layers of at most {DENSE_MAX_WEIGHTS:,} weights, where F.linear beats "
                 "oneDNN's fixed cost a call)")
    return said + counts_note
