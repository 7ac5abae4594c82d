"""Bucketed relative position bias (T5): the ``"relative_position_bias"`` attention feature.

A model that needs it declares it (``EncoderDecoderModel.attn_features``) and hands
its self-attention layers a :class:`RelativePositionBias`: the learned table and the
bucketing rule, not a dense ``[H, q, k]`` tensor, since a paged or varlen kernel sees
keys block by block. A backend that declares the feature
(``BackendCapabilities.attn_features``) adds ``bias(q_pos, k_pos)`` to the scores
inside its own attention, with positions it knows: a decoder query at
``cached + index``, keys ``0..seq_len-1``; encoder queries and keys ``0..n-1``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

FEATURE = "relative_position_bias"


def relative_position_bucket(
    relative_position: torch.Tensor, bidirectional: bool, num_buckets: int, max_distance: int
) -> torch.Tensor:
    """Bucket of each ``key_pos - query_pos`` (int64, any shape), in ``[0, num_buckets)``.

    Half the buckets (of each direction when ``bidirectional``) are exact distances,
    the rest log-spaced up to ``max_distance``; beyond it, the last bucket. Causal
    (``bidirectional=False``): keys after the query share bucket 0. As Mesh
    TensorFlow and HF's T5 compute it (the log in float32).
    """
    buckets = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (relative_position > 0).to(torch.long) * num_buckets
        distance = relative_position.abs()
    else:
        distance = (-relative_position).clamp(min=0)
    max_exact = num_buckets // 2
    is_small = distance < max_exact
    # distance 0 goes through log(0) = -inf here, but is_small picks the exact bucket for it
    large = max_exact + (
        torch.log(distance.float() / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact)
    ).to(torch.long)
    large = large.clamp(max=num_buckets - 1)
    return buckets + torch.where(is_small, distance, large)


@dataclass
class RelativePositionBias:
    """One stack's bias for one step: the table (this rank's heads) and its bucketing.

    The model builds one per stack per forward and passes it to every self-attention
    layer of the stack; :meth:`bias` memoizes by a key the backend chooses, so each
    sequence's bias is computed once per stack, not once per layer.
    """

    table: torch.Tensor  # [num_buckets, H]
    num_buckets: int
    max_distance: int
    bidirectional: bool  # encoder: True; decoder self-attention: False (causal)
    _memo: dict = field(default_factory=dict, repr=False)

    def bias(self, query_pos: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
        """``[..., q]`` query and ``[..., k]`` key positions -> ``[..., H, q, k]`` bias
        (``...`` broadcast), in the table's dtype."""
        rel = key_pos.unsqueeze(-2) - query_pos.unsqueeze(-1)  # [..., q, k]
        buckets = relative_position_bucket(rel, self.bidirectional, self.num_buckets, self.max_distance)
        return self.table[buckets].movedim(-1, -3)  # [..., q, k, H] -> [..., H, q, k]

    def memo(self, key: object, compute: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``compute()`` the first time ``key`` is asked for on this object, then the same tensor."""
        if key not in self._memo:
            self._memo[key] = compute()
        return self._memo[key]
