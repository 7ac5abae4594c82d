"""Position embeddings of the BART family: learned (BART, mBART), the sin/cos table of
Marian and Pegasus, and the fairseq table of M2M100 / NLLB.

Each module maps ``positions`` (0-based, per sequence, ``[num_tokens]``) and the
tokens' ids to ``[num_tokens, dim]``. Computed tables are buffers the model fills in
``load_weights`` (:meth:`BartSinusoidalPositionalEmbedding.reset_table`): the model is
built on the meta device.
"""

from __future__ import annotations

import math

import torch
from torch import nn


class BartLearnedPositionalEmbedding(nn.Embedding):
    def __init__(self, num_positions: int, dim: int, offset: int) -> None:
        super().__init__(num_positions + offset, dim)
        self.offset = offset

    def forward(self, positions: torch.Tensor, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        return super().forward(positions + self.offset)


def sinusoidal_table(num_positions: int, dim: int) -> torch.Tensor:
    """``[num_positions, dim]`` float32: sines in the first half of each row, cosines in the second.

    The same numerics as transformers' ``MarianSinusoidalPositionalEmbedding.create_weight``
    (Pegasus's is the same table): angles and sin/cos in float64 numpy, one rounding to
    float32, so the table is bit-identical to HF's.
    """
    import numpy as np

    div = np.array([np.power(10000, 2 * (j // 2) / dim) for j in range(dim)])  # [dim]
    angles = np.arange(num_positions)[:, None] / div[None, :]  # [num_positions, dim], C order as in HF
    half = (dim + 1) // 2
    out = torch.empty(num_positions, dim, dtype=torch.float32)
    out[:, :half] = torch.from_numpy(np.sin(angles[:, 0::2])).to(torch.float32)
    out[:, half:] = torch.from_numpy(np.cos(angles[:, 1::2])).to(torch.float32)
    return out


def fairseq_sinusoidal_table(num_rows: int, dim: int, padding_idx: int | None) -> torch.Tensor:
    """``[num_rows, dim]`` float32, the table of transformers' ``M2M100SinusoidalPositionalEmbedding``
    (fairseq's): frequencies ``exp(-i * ln(10000) / (dim/2 - 1))``, sines then cosines, a zero
    column when ``dim`` is odd, and the ``padding_idx`` row zero. Computed in float32 torch with
    HF's order of operations, so the values are bit-identical to HF's. ``dim`` must be >= 4
    (HF divides by ``dim // 2 - 1``)."""
    half = dim // 2
    step = math.log(10000) / (half - 1)
    freqs = torch.exp(torch.arange(half, dtype=torch.int64).float() * -step)  # [half]
    angles = torch.arange(num_rows, dtype=torch.int64).float().unsqueeze(1) * freqs.unsqueeze(0)  # [rows, half]
    table = torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)
    if dim % 2:
        table = torch.cat([table, torch.zeros(num_rows, 1)], dim=1)
    if padding_idx is not None:
        table[padding_idx] = 0
    return table.to(torch.float32)


class BartSinusoidalPositionalEmbedding(nn.Module):
    """Fixed sinusoidal positions (Marian, Pegasus). The table is computed, not learned;
    a checkpoint that carries ``embed_positions.weight`` (older HF saves) overwrites it
    with the same values."""

    def __init__(self, num_positions: int, dim: int, offset: int) -> None:
        super().__init__()
        self.offset = offset
        self.register_buffer("weight", torch.empty(num_positions + offset, dim), persistent=False)

    def table(self) -> torch.Tensor:
        return sinusoidal_table(*self.weight.shape)

    @torch.no_grad()
    def reset_table(self) -> None:
        self.weight.copy_(self.table())

    def forward(self, positions: torch.Tensor, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        return nn.functional.embedding(positions + self.offset, self.weight)


class PaddedSinusoidalPositionalEmbedding(BartSinusoidalPositionalEmbedding):
    """M2M100 / NLLB: :func:`fairseq_sinusoidal_table`, looked up from ``padding_idx + 1``;
    a ``<pad>`` token takes the zero row ``padding_idx``. This is HF's numbering of every
    decode step (a generated ``<pad>`` gets the zero row and still counts towards later
    positions) and of any prompt without a ``<pad>`` followed by other tokens (HF's prefill
    would not count such a ``<pad>``; real prompts carry none)."""

    def __init__(self, num_positions: int, dim: int, padding_idx: int) -> None:
        super().__init__(num_positions, dim, padding_idx + 1)
        self.padding_idx = padding_idx

    def table(self) -> torch.Tensor:
        return fairseq_sinusoidal_table(*self.weight.shape, self.padding_idx)

    def forward(self, positions: torch.Tensor, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        index = positions + self.offset
        if input_ids is not None:
            index = torch.where(input_ids == self.padding_idx, self.padding_idx, index)
        return nn.functional.embedding(index, self.weight)


def make_position_embedding(config, variant) -> nn.Module:
    """The position embedding ``variant`` (a ``BartVariant``) asks for, sized from ``config``."""
    n, dim = config.max_position_embeddings, config.d_model
    if variant.fairseq_positions:
        return PaddedSinusoidalPositionalEmbedding(n, dim, int(config.pad_token_id))
    if variant.sinusoidal_positions:
        return BartSinusoidalPositionalEmbedding(n, dim, variant.position_offset)
    return BartLearnedPositionalEmbedding(n, dim, variant.position_offset)
