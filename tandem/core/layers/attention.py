"""The ``Attention`` layer models build on."""

from __future__ import annotations

import torch
from torch import nn

from tandem.core.attention import AttentionBackend, AttentionMetadata, AttentionType


class Attention(nn.Module):
    """Shapes packed q/k/v into heads and hands them to the backend's impl, which
    writes the new K/V into its cache and computes attention.

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
        out = self.impl.forward(q, k, v, kv_cache, attn_metadata, self.attn_type)
        return out.reshape(-1, self.num_heads * self.head_size)
