"""xFormers backend: ``xformers.ops.memory_efficient_attention`` over block-diagonal
masks, the whole step in one call per attention kind.

- encoder: the packed encoder runs with ``BlockDiagonalMask`` (non-causal).
- decoder self: each sequence's keys (cached + new) gathered from the paged
  cache into one packed run per sequence, ``BlockDiagonalCausalFromBottomRightMask``
  (query j of a sequence with q new tokens after c cached sees keys 0..c+j).
- cross: each sequence's encoder keys gathered from the paged cross cache,
  ``BlockDiagonalMask``.

Why gathered K/V rather than xFormers' ``PagedBlockDiagonal*`` masks: those run
only on xFormers' Triton split-K and flash operators, each with its own page
size rules, while packed runs with these masks run on every forward operator
xFormers dispatches to (CUTLASS, which also takes float32 and pre-Ampere GPUs,
and flash); any block size works. The cost is one extra read and write of the
step's K/V per layer. GQA goes through xFormers' 5-D ``[B, M, G, H, D]`` form
with the KV heads broadcast, not copied.

The layout is the default ``[2, num_blocks, block_size, H_kv, D]`` with core's
write/swap/copy ops.

``import xformers.ops`` raises when a ``flash_attn`` package it cannot use is
installed (a flash-attn 2 outside the range xFormers' ``ops/fmha/flash.py``
enforces, or flash-attn-4's ``flash_attn.cute`` without flash-attn 2). The
capability check says so before anything imports: it mirrors that check from
the installed packages' metadata and sources (cheap), and only where the
backend would otherwise serve does it import ``xformers.ops`` itself (about
1.5 s on CPU, once per process), so a selected backend has imported already
and its builder is never the first to fail.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
import re
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from tandem.backends.installed import dist_version as _dist_version
from tandem.backends.installed import package_dirs as _package_dirs
from tandem.core.attention import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadata,
    AttentionMetadataBuilder,
    AttentionType,
    BackendCapabilities,
    SizeRule,
)
from tandem.core.kv.cache_ops import packed_slots

# The largest head size every forward operator xFormers may dispatch to takes
# (flash: 256; CUTLASS more), and the alignment CUTLASS wants on sm80+ for 16-bit
# tensor-core GEMMs (128 bits = 8 halves; float32 needs 4, so 8 serves all).
MAX_HEAD_SIZE = 256
HEAD_ALIGN = 8


INSTALL_HINT = "pip install 'tandem-engine[xformers]'"


def flash_attn_range() -> tuple[str, str] | None:
    """The flash-attn versions (lowest, highest; inclusive) the installed xFormers imports
    with, read from its own check (``FLASH_VER_MIN`` / ``FLASH_VER_LAST`` in
    ``xformers/ops/fmha/flash.py``) without importing it; None where that cannot be read."""
    for root in _package_dirs("xformers"):
        try:
            text = (root / "ops" / "fmha" / "flash.py").read_text()
        except OSError:
            continue
        lo, hi = (re.search(rf"{var}\s*=\s*parse_version\(\s*[\"']([^\"']+)", text)
                  for var in ("FLASH_VER_MIN", "FLASH_VER_LAST"))
        if lo and hi:
            return lo.group(1), hi.group(1)
    return None


def _flash_attn_version(dirs: list[Path]) -> str | None:
    """``flash_attn.__version__`` as xFormers reads it, from the source (importing
    flash_attn would load its CUDA extension); the distribution's version otherwise."""
    for root in dirs:
        try:
            found = re.search(r"^__version__\s*=\s*[\"']([^\"']+)", (root / "__init__.py").read_text(), re.M)
        except OSError:
            continue
        if found:
            return found.group(1)
    return _dist_version("flash-attn")


def installed_flash_attn() -> str:
    """The installed flash-attn packages and the range xFormers accepts, for messages."""
    fa2, fa4 = _dist_version("flash-attn"), _dist_version("flash-attn-4")
    rng = flash_attn_range()
    return (f"installed: flash-attn {fa2 or '(none)'}, flash-attn-4 {fa4 or '(none)'}; xformers "
            f"{_dist_version('xformers') or '?'} imports with no flash-attn or with flash-attn "
            + (f"{rng[0]} to {rng[1]}" if rng else "in the range its ops/fmha/flash.py names"))


def predicted_import_error() -> str | None:
    """Why ``import xformers.ops`` will raise, found without importing anything: xFormers'
    own flash-attn check (``ops/fmha/flash.py``) replayed on what is installed. None
    where it will pass that check (the import itself may still fail otherwise)."""
    dirs = _package_dirs("flash_attn")
    if not dirs:
        return None  # xFormers then uses the FlashAttention inside PyTorch
    if not any((d / "flash_attn_interface.py").is_file() for d in dirs):
        # flash-attn-4 installs flash_attn/cute only, a namespace package xFormers still finds.
        return ("import xformers.ops fails: a flash_attn package without flash_attn_interface (flash-attn-4 "
                "without flash-attn 2?) is installed, and xFormers imports flash_attn.flash_attn_interface "
                f"whenever flash_attn exists ({installed_flash_attn()})")
    if os.environ.get("XFORMERS_IGNORE_FLASH_VERSION_CHECK", "0") == "1":
        return None
    version, rng = _flash_attn_version(dirs), flash_attn_range()
    if version is None or rng is None:
        return None  # nothing to compare: the import decides
    from packaging.version import InvalidVersion, Version

    try:
        inside = Version(rng[0]) <= Version(version) <= Version(rng[1])
    except InvalidVersion:
        return None
    if inside:
        return None
    return (f"import xformers.ops fails: flash_attn {version} is installed and xFormers requires "
            f"{rng[0]} to {rng[1]} ({installed_flash_attn()}); install 'flash-attn>={rng[0]},<={rng[1]}' "
            "or uninstall flash-attn (xFormers then uses the FlashAttention inside PyTorch)")


@functools.cache
def _import_ops() -> tuple[ModuleType | None, Exception | None]:
    """``xformers.ops``, imported once per process (a failed import would otherwise be
    retried at every call), or the exception its import raised."""
    try:
        import xformers.ops
    except Exception as e:  # ImportError, or whatever a broken CUDA extension raises
        return None, e
    return xformers.ops, None


def import_error() -> str | None:
    """Why the xformers backend cannot import its kernels here, or None when it can.
    Imports ``xformers.ops`` (once per process) unless the cause is already known."""
    if importlib.util.find_spec("xformers") is None:
        return f"the xformers package is not installed ({INSTALL_HINT})"
    predicted = predicted_import_error()
    if predicted:
        return predicted
    _, error = _import_ops()
    if error is None:
        return None
    quoted = " ".join(f"{type(error).__name__}: {error}".split())
    return f"import xformers.ops fails ({quoted}); {installed_flash_attn()}"


def _ops() -> ModuleType:
    """``xformers.ops``, or an ImportError naming why it does not import."""
    reason = import_error()
    if reason:
        raise ImportError(f"the xformers attention backend cannot run: {reason}")
    return _import_ops()[0]


def _fmha(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_bias: Any, scale: float) -> torch.Tensor:
    """The kernel call: ``[1, M, G, H, D]`` queries over ``[1, N, G, H, D]`` keys and
    values under ``attn_bias`` (tests replace this with a float64 reference)."""
    return _ops().memory_efficient_attention(query, key, value, attn_bias=attn_bias, scale=scale)


def _bias_classes():
    return _ops().fmha.attn_bias


@dataclass
class XFormersMetadata(AttentionMetadata):
    # Flat cache slots of every key of every sequence, packed sequence after
    # sequence: [sum(seq_lens)] for self-attention, [sum(cross_seq_lens)] for cross.
    self_slots: torch.Tensor
    cross_slots: torch.Tensor
    self_bias: Any  # BlockDiagonalCausalFromBottomRightMask, or None without decoder tokens
    cross_bias: Any  # BlockDiagonalMask
    encoder_bias: Any  # BlockDiagonalMask over the encoder runs, or None when none runs


class XFormersMetadataBuilder(AttentionMetadataBuilder):
    def __init__(self, block_size: int, device: torch.device, kv_spec) -> None:
        super().__init__(block_size, device, kv_spec)
        _ops()  # an install xFormers cannot import fails here, at engine construction, naming why

    def build(self, inputs) -> XFormersMetadata:
        ab = _bias_classes()
        dev = self.device
        seq_lens = torch.tensor(inputs.seq_lens, dtype=torch.long)
        cross_lens = torch.tensor(inputs.cross_seq_lens, dtype=torch.long)
        have_decoder = bool(inputs.query_lens)
        return XFormersMetadata.from_inputs(
            inputs,
            self_slots=packed_slots(inputs.block_tables, seq_lens, self.block_size),
            cross_slots=packed_slots(inputs.cross_block_tables, cross_lens, self.block_size),
            self_bias=ab.BlockDiagonalCausalFromBottomRightMask.from_seqlens(
                inputs.query_lens, inputs.seq_lens, device=dev) if have_decoder else None,
            cross_bias=ab.BlockDiagonalMask.from_seqlens(
                inputs.query_lens, inputs.cross_seq_lens, device=dev) if have_decoder else None,
            encoder_bias=ab.BlockDiagonalMask.from_seqlens(
                inputs.encoder_seq_lens, device=dev) if inputs.encoder_seq_lens else None,
        )


class XFormersImpl(AttentionImpl):
    def _grouped(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        """``[N, heads, D]`` -> ``[1, N, G, heads / G, D]``, G = KV heads; KV heads are
        broadcast over their query heads (a stride-0 view, no copy)."""
        g = self.num_kv_heads
        if heads == g:
            x = x.unsqueeze(2).expand(-1, -1, self.num_heads // g, -1)
        else:
            x = x.view(x.shape[0], g, heads // g, x.shape[-1])
        return x.unsqueeze(0)

    def _attend(self, query, key, value, bias) -> torch.Tensor:
        out = _fmha(self._grouped(query, self.num_heads), self._grouped(key, self.num_kv_heads),
                    self._grouped(value, self.num_kv_heads), bias, self.scale)
        return out.reshape(query.shape)

    def forward(
        self,
        query: torch.Tensor,  # [T, H, D]
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor | None,  # [2, num_blocks, block_size, H_kv, D]; None for ENCODER
        attn_metadata: XFormersMetadata,
        attn_type: AttentionType,
    ) -> torch.Tensor:
        md = attn_metadata
        self.write_new_kv(key, value, kv_cache, md, attn_type)
        if query.shape[0] == 0:
            return torch.empty_like(query)
        if attn_type is AttentionType.ENCODER:
            return self._attend(query, key, value, md.encoder_bias)
        cross = attn_type is AttentionType.ENCODER_DECODER
        slots = md.cross_slots if cross else md.self_slots
        flat = kv_cache.flatten(1, 2)  # [2, num_blocks * block_size, H_kv, D]
        k, v = flat[0].index_select(0, slots), flat[1].index_select(0, slots)
        return self._attend(query, k, v, md.cross_bias if cross else md.self_bias)


def _device_present(device: torch.device) -> bool:
    return device.type != "cuda" or torch.cuda.is_available()


def _device_capability(device: torch.device) -> tuple[int, int] | None:
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(device)


def float32_operator_reasons(capability: tuple[int, int] | None) -> list[str]:
    """float32 runs only on xFormers' CUTLASS forward operator; it is built up to a
    highest compute capability (9.0 in 0.0.35), read from the installed xformers."""
    if capability is None:
        return []
    from xformers.ops.fmha import cutlass

    op = cutlass.FwOp
    highest = getattr(op, "CUDA_MAXIMUM_COMPUTE_CAPABILITY", None)
    if torch.float32 in op.SUPPORTED_DTYPES and highest is not None and tuple(capability) > tuple(highest):
        return [f"dtype torch.float32: xFormers runs float32 only on its CUTLASS operator, built for compute "
                f"capability <= {highest[0]}.{highest[1]}; this GPU is {capability[0]}.{capability[1]} "
                "(use float16/bfloat16, or attention_backend='triton' / 'torch_sdpa')"]
    return []


class XFormersBackend(AttentionBackend):
    name = "xformers"
    priority = 30
    capabilities = BackendCapabilities(
        devices=("cuda",),
        dtypes=(torch.float32, torch.float16, torch.bfloat16),
        block_sizes=SizeRule(note="K/V are gathered into packed runs per step"),
        head_sizes=SizeRule(multiple_of=HEAD_ALIGN, max=MAX_HEAD_SIZE),
        requires=("xformers",),
        notes="float32 runs on xFormers' CUTLASS kernel; float16/bfloat16 on flash where it applies",
        no_fp8_kv_reason="xFormers' memory-efficient attention takes gathered K/V in the query's dtype and reads "
        "no fp8; use attention_backend='triton' for an fp8 cache on GPU",
    )

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return XFormersImpl

    @staticmethod
    def get_metadata_builder_cls() -> type[AttentionMetadataBuilder]:
        return XFormersMetadataBuilder

    @classmethod
    def extra_unsupported_reasons(cls, device, dtype, head_size, attn_types, block_size,
                                  kv_cache_dtype) -> list[str]:
        if importlib.util.find_spec("xformers") is None:
            return [f"the xformers package is not installed ({INSTALL_HINT})"]
        predicted = predicted_import_error()
        return [predicted] if predicted else []

    @classmethod
    def unsupported_reasons(cls, device, dtype, head_size, attn_types, block_size, kv_cache_dtype) -> list[str]:
        reasons = super().unsupported_reasons(device, dtype, head_size, attn_types, block_size, kv_cache_dtype)
        # import xformers.ops (once per process) only where it would serve, on a GPU that
        # is there: asking about cuda on a machine without one imports nothing.
        if not reasons and _device_present(device):
            error = import_error()
            if error:
                reasons.append(error)
            elif dtype == torch.float32:
                reasons += float32_operator_reasons(_device_capability(device))
        return reasons
