"""KV-cache ops for the default layout ``[2, num_blocks, block_size, H, D]``: scatter
new keys and values by slot, gather by block table. Any backend using that layout
may reuse them; tandem's torch_sdpa does."""

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


class GatherWorkspace:
    """Reusable output buffers for gathers.

    A fresh multi-megabyte tensor per gather costs more than the gather itself
    on CPU (the allocator maps new pages every time); layers run one after
    another, so one growing buffer for keys and one for values serve them all.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        numel = 1
        for n in shape:
            numel *= n
        key = (name, like.dtype, like.device)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(max(numel, int(1.25 * (buf.numel() if buf is not None else 0))),
                              dtype=like.dtype, device=like.device)
            self._buffers[key] = buf
        return buf[:numel].view(shape)


def gather_from_paged_cache(
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int64 (padding may be any valid id)
    workspace: GatherWorkspace | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of each sequence, padded: ``[num_seqs, max_blocks * block_size, H, D]``.

    With a workspace the results are views of its buffers, valid until the
    next gather through the same workspace.
    """
    num_seqs, max_blocks = block_tables.shape
    block_size, num_kv_heads, head_size = kv_cache.shape[2:]
    index = block_tables.reshape(-1)
    shape = (num_seqs, max_blocks * block_size, num_kv_heads, head_size)
    if workspace is None:
        keys = kv_cache[0].index_select(0, index)
        values = kv_cache[1].index_select(0, index)
        return keys.view(shape), values.view(shape)
    rows = (index.numel(), block_size, num_kv_heads, head_size)
    keys = torch.index_select(kv_cache[0], 0, index, out=workspace.get("k", rows, kv_cache))
    values = torch.index_select(kv_cache[1], 0, index, out=workspace.get("v", rows, kv_cache))
    return keys.view(shape), values.view(shape)


def packed_slots(tables: torch.Tensor, lens: torch.Tensor, block_size: int) -> torch.Tensor:
    """Slot of position ``p`` of sequence ``i`` for every ``p < lens[i]``, sequences
    one after another: ``[sum(lens)]``, for gathering each sequence's K/V into one
    packed run (index ops only, no per-token loop)."""
    lens = lens.to(tables.device)
    seq = torch.repeat_interleave(torch.arange(lens.numel(), device=tables.device), lens)
    starts = torch.cumsum(lens, 0) - lens
    pos = torch.arange(seq.numel(), device=tables.device) - starts.index_select(0, seq)
    return tables[seq, pos // block_size] * block_size + pos % block_size
