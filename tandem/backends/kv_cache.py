"""The KV-cache write op every backend shares."""

from __future__ import annotations

import torch


def write_to_paged_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, block * block_size + offset
) -> None:
    """Scatter new keys and values into their slots of the paged cache."""
    if key.shape[0] == 0:
        return
    num_kv_heads, head_size = kv_cache.shape[-2], kv_cache.shape[-1]
    flat = kv_cache.view(2, -1, num_kv_heads, head_size)
    flat[0].index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, value.to(kv_cache.dtype))


def gather_from_paged_cache(
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int64 (padding may be any valid id)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of each sequence, padded: ``[num_seqs, max_blocks * block_size, H, D]``."""
    num_seqs, max_blocks = block_tables.shape
    block_size, num_kv_heads, head_size = kv_cache.shape[2:]
    keys = kv_cache[0].index_select(0, block_tables.reshape(-1))
    values = kv_cache[1].index_select(0, block_tables.reshape(-1))
    shape = (num_seqs, max_blocks * block_size, num_kv_heads, head_size)
    return keys.view(shape), values.view(shape)
