"""The ``Attention`` layer models build on."""

from __future__ import annotations

import torch
from torch import nn

from tandem.backends.kv_cache import write_to_paged_cache
from tandem.core.attention import AttentionBackend, AttentionMetadata, AttentionType


class Attention(nn.Module):
    """Writes new K/V into the paged cache by slot mapping, then runs the backend.

    Inputs are packed tokens: ``query`` ``[num_tokens, num_heads * head_size]``,
    ``key``/``value`` ``[num_kv_tokens, num_kv_heads * head_size]``. For
    ``ENCODER_DECODER`` layers, pass ``key=value=None`` on steps where no
    encoder ran: the cross-attention cache is then the only source of K/V.
    """

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        backend: type[AttentionBackend],
        attn_type: AttentionType,
        num_kv_heads: int | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = num_kv_heads or num_heads
        self.attn_type = attn_type
        self.impl = backend.get_impl_cls()(num_heads, head_size, scale, self.num_kv_heads)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor | None,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        q = query.view(-1, self.num_heads, self.head_size)
        k = key.view(-1, self.num_kv_heads, self.head_size) if key is not None else None
        v = value.view(-1, self.num_kv_heads, self.head_size) if value is not None else None
        if self.attn_type is AttentionType.DECODER:
            write_to_paged_cache(k, v, kv_cache, attn_metadata.slot_mapping)
        elif self.attn_type is AttentionType.ENCODER_DECODER and k is not None:
            write_to_paged_cache(k, v, kv_cache, attn_metadata.cross_slot_mapping)
        out = self.impl.forward(q, k, v, kv_cache, attn_metadata, self.attn_type)
        return out.reshape(-1, self.num_heads * self.head_size)
