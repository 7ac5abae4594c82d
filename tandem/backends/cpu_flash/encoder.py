"""Which encoder attention calls take the bf16 flash op (encoder_attention.cpp)
instead of SDPA, and the call itself.

The op serves what Whisper's encoder asks for on a CPU with avx512_bf16:
bfloat16 Q, K and V ``[T, H, D]`` (head dimension contiguous), as many KV heads
as query heads, a head size that is a multiple of 32, each run attending over its
own positions with no mask and no bias. Anything else, a CPU without the
instruction, an op that cannot be built, or ``TANDEM_CPU_FLASH=0`` in the
environment, keeps SDPA: :func:`attend` then returns None.
"""

from __future__ import annotations

import logging
import os

import torch

from tandem.backends.cpu_flash import ops

logger = logging.getLogger("tandem.backends.cpu_flash")

ENV = "TANDEM_CPU_FLASH"  # "0" keeps SDPA for every call

_reported = False


def unsupported(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> str | None:
    """Why the op does not serve these tensors (None where it does); the CPU and the
    build are checked by :func:`attend`, not here."""
    if os.environ.get(ENV, "1") == "0":
        return f"{ENV}=0"
    if query.device.type != "cpu":
        return f"device {query.device}"
    if any(t.dtype != torch.bfloat16 for t in (query, key, value)):
        return f"dtype {query.dtype}, not bfloat16"
    if not (query.dim() == key.dim() == value.dim() == 3) or not (query.shape == key.shape == value.shape):
        return f"shapes {tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)} differ (GQA?)"
    if query.shape[2] % 32:
        return f"head size {query.shape[2]} is not a multiple of 32"
    if any(t.stride(2) != 1 for t in (query, key, value)):
        return "a head dimension is strided"
    return None


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, runs: list[tuple[int, int]],
           scale: float) -> torch.Tensor | None:
    """softmax(Q K^T * scale) V of each ``(start, length)`` run over its own rows, as
    ``[T, H, D]`` bfloat16; None where SDPA must serve instead (see the module)."""
    global _reported
    if unsupported(query, key, value) is not None:
        return None
    try:
        op = ops.load()
    except ops.CPUOpUnavailable as e:
        if not _reported:
            _reported = True
            logger.info("cpu_flash: bf16 encoder attention stays on SDPA: %s", e)
        return None
    out = torch.empty(query.shape, dtype=query.dtype)
    op(query, key, value, out, torch.tensor(runs, dtype=torch.long).view(-1, 2), float(scale))
    return out
