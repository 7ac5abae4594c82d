"""The ``Attention`` layer models build on."""

from __future__ import annotations

import torch
from torch import nn

from tandem.core.attention import AttentionBackend, AttentionMetadata, AttentionType
from tandem.core.layers import opaque_ops
from tandem.core.relative_position import RelativePositionBias


class Attention(nn.Module):
    """Shapes packed q/k/v into heads and hands them to the backend's impl, which
    writes the new K/V into its cache and computes attention.

    Inputs are packed tokens: ``query`` ``[num_tokens, num_heads * head_size]``,
    ``key``/``value`` ``[num_kv_tokens, num_kv_heads * head_size]``. For
    ``ENCODER_DECODER`` layers, pass ``key=value=None`` on steps where no
    encoder ran: the cross-attention cache is then the only source of K/V.

    ``position_bias`` (self-attention of models that declare the
    ``"relative_position_bias"`` feature, e.g. T5) goes to the impl as its
    ``position_bias`` keyword; only backends that declare the feature get one.
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
        # Set by a compiled step (tandem/core/worker/compiled_step.py): this layer's index in
        # its opaque_context, through which the opaque op finds it while Dynamo traces.
        self.opaque_index: int | None = None

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor | None,
        attn_metadata: AttentionMetadata,
        position_bias: RelativePositionBias | None = None,
    ) -> torch.Tensor:
        q = query.view(-1, self.num_heads, self.head_size)
        k = key.view(-1, self.num_kv_heads, self.head_size) if key is not None else None
        v = value.view(-1, self.num_kv_heads, self.head_size) if value is not None else None
        if self.opaque_index is not None and kv_cache is not None and torch.compiler.is_compiling():
            out = _opaque(q, k, v, kv_cache, self.opaque_index, position_bias)
        elif position_bias is None:
            out = self.impl.forward(q, k, v, kv_cache, attn_metadata, self.attn_type)
        else:  # a keyword only backends with the feature take (the registry chose one)
            out = self.impl.forward(q, k, v, kv_cache, attn_metadata, self.attn_type, position_bias=position_bias)
        observer = getattr(attn_metadata, "cross_observer", None)  # metadata a backend built by hand may lack it
        if observer is not None and self.attn_type is AttentionType.ENCODER_DECODER:
            observer.observe(q, kv_cache, self.impl.scale)  # kv_compress's observation window
        return out.reshape(-1, self.num_heads * self.head_size)


def _opaque(q, k, v, kv_cache, index: int, pb: RelativePositionBias | None) -> torch.Tensor:
    """The backend call as ``torch.ops.tandem.paged_attention`` (layers/opaque_ops.py),
    so a compiled graph holds it as one node."""
    if pb is None:
        return opaque_ops.paged_attention(q, k, v, kv_cache, index, None, 0, 0, False)
    return opaque_ops.paged_attention(q, k, v, kv_cache, index, pb.table, pb.num_buckets, pb.max_distance,
                                        pb.bidirectional)
