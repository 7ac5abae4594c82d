"""kv_compress per head: the cross-table layout where each (layer, KV head) keeps its
own count of encoder positions, and the read that backends declaring the
``cross_kv_compress_per_head`` feature use for it.

A compressed request keeps one cross block table. Each layer's memory of those blocks
is read as a flat array of single-head slots: a block ``[block_size, num_kv_heads,
head_size]`` holds ``block_size * num_kv_heads`` of them, flat index ``f = t *
num_kv_heads + h'`` within the block, as laid out in memory. Head ``h`` of layer ``l``
owns the contiguous flat range ``[offset[l, h], offset[l, h] + len[l, h])`` of the
table (its kept positions' K/V, in any order: cross attention has no positional term
over keys). A head with concentrated attention keeps few slots and its neighbours use
the room; the request holds ``ceil(max_l sum_h len[l, h] / (block_size *
num_kv_heads))`` blocks. See ``docs/kv_compress.md``.
"""

from __future__ import annotations

import torch


def flat_heads(kv_cache: torch.Tensor) -> torch.Tensor:
    """``[2, num_blocks * block_size * num_kv_heads, head_size]``: the default layout's
    cache by single-head slot (a view)."""
    return kv_cache.view(2, -1, kv_cache.shape[-1])


def table_slots(table: torch.Tensor, flat: torch.Tensor, block_size: int, num_kv_heads: int) -> torch.Tensor:
    """Cache single-head slots of flat indices ``flat`` (any shape) of a request's table."""
    per_block = block_size * num_kv_heads
    return table[flat // per_block] * per_block + flat % per_block


def head_slots(table: torch.Tensor, offsets: torch.Tensor, lens: torch.Tensor, block_size: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's read of one request: ``table`` ``[W]`` its blocks, ``offsets``/``lens``
    ``[Hkv]`` int64 its heads' ranges. Returns the cache single-head slots ``[Hkv, M]``
    (``M`` the longest range; padding points at the head's first slot) and which are
    kept ``[Hkv, M]`` bool."""
    width = int(lens.max())
    j = torch.arange(width, device=lens.device)
    valid = j[None, :] < lens[:, None]
    flat = offsets[:, None] + torch.where(valid, j[None, :], 0)
    return table_slots(table, flat, block_size, offsets.shape[0]), valid


def attend(query: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor, valid: torch.Tensor,
           scale: float) -> torch.Tensor:
    """``query`` ``[q, Hq, D]`` over one request's per-head kept K/V (:func:`head_slots`),
    in float32; returns ``[q, Hq, D]`` in the query's dtype. Query head ``i`` reads KV
    head ``i // (Hq / Hkv)`` (GQA)."""
    flat = flat_heads(kv_cache)
    hkv, d = slots.shape[0], query.shape[-1]
    k = flat[0].index_select(0, slots.flatten()).view(hkv, -1, d).float()  # [Hkv, M, D]
    v = flat[1].index_select(0, slots.flatten()).view(hkv, -1, d).float()
    q = query.float().view(query.shape[0], hkv, -1, d)  # [q, Hkv, G, D]
    scores = torch.einsum("qhgd,hmd->hgqm", q, k) * scale
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    out = torch.einsum("hgqm,hmd->qhgd", torch.softmax(scores, dim=-1), v)
    return out.reshape(query.shape).to(query.dtype)
