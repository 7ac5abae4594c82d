"""An fp8 KV cache (``kv_cache_dtype="fp8"``, ``"fp8_e4m3"``, ``"fp8_e5m2"``): one byte per
element, read back as ``fp8 * scale`` in the model's dtype.

Scales are per tensor, as vLLM's ``k_scale`` / ``v_scale``: each attention impl (a
decoder layer's self-attention, or its cross-attention) holds one scale for its keys
and one for its values (:class:`KVScales`). A layer's self and cross attention share
one cache tensor, but every block is written and read by one of them only (a self
table's blocks by self-attention, a cross table's by cross-attention; copy-on-write,
swaps and the prefix and encoder caches move a block within its kind), so each block
is read with the scale it was written with.

A scale is calibrated at its impl's first write with a nonzero value (the first
prefill: the encoder output for cross K/V, the decoder prompt for self K/V), vLLM's
``calculate_kv_scales`` pattern: ``scale = 2^ceil(log2(amax * HEADROOM / fp8_max))``,
then fixed. A power of two, so scaling is exact (only the fp8 rounding loses
precision: unit roundoff 2^-4 for e4m3, 2^-3 for e5m2), and values up to
``HEADROOM``-``2 * HEADROOM`` times the calibrating write's largest magnitude are
represented; larger later values saturate at ``fp8_max * scale`` (never inf/NaN).
Small values lose relative precision only below ``amax * 2 * HEADROOM * 2^-6 / 448``
(e4m3's smallest normal), where they barely move a dot product.
"""

from __future__ import annotations

import math

import torch

from tandem.core.config import FP8_KV_DTYPES  # noqa: F401 - vLLM's names -> torch dtypes

# The calibrating write's largest magnitude times this (up to twice it, the scale being a
# power of two) is what the format's largest value stands for.
HEADROOM = 16.0


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def raw(t: torch.Tensor) -> torch.Tensor:
    """An fp8 tensor as its bytes (``uint8``, a view), for the index ops torch's CPU kernels
    lack for float8 (``index_copy_``); any other tensor as it is."""
    return t.view(torch.uint8) if is_fp8(t.dtype) else t


def calibrated_scale(x: torch.Tensor, dtype: torch.dtype) -> float | None:
    """The power-of-two scale for a tensor whose largest magnitude is ``x``'s; None when
    ``x`` is all zeros (or empty): nothing to calibrate on yet."""
    if x.numel() == 0:
        return None
    amax = float(x.detach().abs().max())
    if not math.isfinite(amax) or amax <= 0.0:
        return None
    return 2.0 ** math.ceil(math.log2(amax * HEADROOM / torch.finfo(dtype).max))


def quantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``x / scale`` in fp8, saturated at the format's largest finite value."""
    m = torch.finfo(dtype).max
    return (x.float() * (1.0 / scale)).clamp_(-m, m).to(dtype)


def dequantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``x * scale`` in ``dtype`` (exact for a power-of-two scale: e4m3/e5m2 values fit
    float16, bfloat16 and float32 but for float16's subnormal edge)."""
    out = x.to(dtype)
    return out.mul_(scale) if scale != 1.0 else out


class KVScales:
    """One impl's ``k_scale`` and ``v_scale`` (floats, 1.0 until calibrated)."""

    def __init__(self) -> None:
        self.k_scale = 1.0
        self.v_scale = 1.0
        self.calibrated = False
        self._tensor: torch.Tensor | None = None  # [2] float32 on the cache's device, for kernels

    def calibrate(self, key: torch.Tensor, value: torch.Tensor, dtype: torch.dtype) -> None:
        """Set both scales from this write, once (the first write with nonzero keys and values)."""
        if self.calibrated:
            return
        k, v = calibrated_scale(key, dtype), calibrated_scale(value, dtype)
        if k is None or v is None:
            return  # zeros quantize exactly with any scale: calibrate on a later write
        self.k_scale, self.v_scale, self.calibrated = k, v, True
        self._tensor = None

    def tensor(self, device: torch.device) -> torch.Tensor:
        """``[k_scale, v_scale]`` float32 on ``device`` (kernels read it by pointer)."""
        if self._tensor is None or self._tensor.device != device:
            self._tensor = torch.tensor([self.k_scale, self.v_scale], dtype=torch.float32, device=device)
        return self._tensor


def write_fp8(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    value: torch.Tensor,
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size], fp8
    slot_mapping: torch.Tensor,  # [num_tokens] int64
    scales: KVScales,
) -> None:
    """Calibrate ``scales`` (on the first write that can), quantize and scatter by slot."""
    if key.shape[0] == 0:
        return
    scales.calibrate(key, value, kv_cache.dtype)
    num_kv_heads, head_size = kv_cache.shape[-2], kv_cache.shape[-1]
    flat = raw(kv_cache).view(2, -1, num_kv_heads, head_size)
    flat[0].index_copy_(0, slot_mapping, raw(quantize(key, scales.k_scale, kv_cache.dtype)))
    flat[1].index_copy_(0, slot_mapping, raw(quantize(value, scales.v_scale, kv_cache.dtype)))
