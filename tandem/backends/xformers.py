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
write/swap/copy ops. xformers is imported only when the backend is first used.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

import torch

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


def _fmha(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_bias: Any, scale: float) -> torch.Tensor:
    """The kernel call: ``[1, M, G, H, D]`` queries over ``[1, N, G, H, D]`` keys and
    values under ``attn_bias`` (tests replace this with a float64 reference)."""
    from xformers.ops import memory_efficient_attention

    return memory_efficient_attention(query, key, value, attn_bias=attn_bias, scale=scale)


def _bias_classes():
    from xformers.ops.fmha import attn_bias

    return attn_bias


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
            return ["the xformers package is not installed (pip install 'tandem-engine[xformers]')"]
        return []
