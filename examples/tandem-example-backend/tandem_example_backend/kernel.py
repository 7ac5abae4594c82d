"""``tandem_example::paged_attention``: attention over a block-major paged KV cache,
read in place, registered as a PyTorch custom operator.

The cache is ``[num_blocks, 2, num_kv_heads, block_size, head_size]``: one block
holds its keys and values together, heads first, so one block-table column is
one ``index_select`` of whole blocks. The operator walks the block-table columns
and keeps a running (online) softmax per query token and head, so it never
builds the padded ``[batch, max_len]`` copy of the keys a gather would: memory
is O(tokens x block_size) whatever the cache length. Every query token of the
step is processed at once (prefills, chunks and decodes alike); the only Python
loop is over block-table columns.

It is a custom op (not a plain function) so that ``torch.compile`` sees one
opaque call with a known output (``register_fake``), the way a compiled CUDA or
C++ kernel would be wrapped.
"""

from __future__ import annotations

import torch


@torch.library.custom_op("tandem_example::paged_attention", mutates_args=())
def paged_attention(
    query: torch.Tensor,  # [T, H, D]
    kv_cache: torch.Tensor,  # [num_blocks, 2, H_kv, block_size, D]
    block_tables: torch.Tensor,  # [S, max_blocks] int64
    token_seq: torch.Tensor,  # [T] int64: the sequence of each query token
    token_pos: torch.Tensor,  # [T] int64: each token's position (its last visible key when causal)
    seq_lens: torch.Tensor,  # [S] int64: keys each sequence attends over
    scale: float,
    causal: bool,
) -> torch.Tensor:
    num_tokens, num_heads, head_size = query.shape
    num_kv_heads, block_size = kv_cache.shape[2], kv_cache.shape[3]
    group = num_heads // num_kv_heads
    # Queries grouped by their KV head: [T, H_kv, group, D], in float32 for the sums.
    q = query.view(num_tokens, num_kv_heads, group, head_size).float() * scale
    m = torch.full((num_tokens, num_kv_heads, group), float("-inf"), device=query.device)
    l = torch.zeros_like(m)
    acc = torch.zeros(num_tokens, num_kv_heads, group, head_size, device=query.device)
    token_len = seq_lens.index_select(0, token_seq)  # [T]
    offsets = torch.arange(block_size, device=query.device)
    columns = int(-(-int(seq_lens.max()) // block_size)) if seq_lens.numel() else 0
    for col in range(columns):
        blocks = block_tables[:, col].index_select(0, token_seq)  # [T] this column's block per token
        kv = kv_cache.index_select(0, blocks).float()  # [T, 2, H_kv, block_size, D]
        scores = torch.einsum("thgd,thnd->thgn", q, kv[:, 0])  # [T, H_kv, group, block_size]
        pos = col * block_size + offsets  # [block_size] key positions in this column
        visible = pos[None, :] < token_len[:, None]
        if causal:
            visible &= pos[None, :] <= token_pos[:, None]
        scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
        m_new = torch.maximum(m, scores.amax(dim=-1))
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        p = torch.exp(scores - m_safe[..., None])
        alpha = torch.exp(m - m_safe)
        l = l * alpha + p.sum(dim=-1)
        acc = acc * alpha[..., None] + torch.einsum("thgn,thnd->thgd", p, kv[:, 1])
        m = m_new
    out = acc / l.clamp_min(torch.finfo(torch.float32).tiny)[..., None]
    return out.view(num_tokens, num_heads, head_size).to(query.dtype)


@paged_attention.register_fake
def _(query, kv_cache, block_tables, token_seq, token_pos, seq_lens, scale, causal):
    return torch.empty_like(query)
