"""Triton kernels for the three attention kinds, flash style (online softmax in
base 2, ``tl.dot`` tiles, float32 accumulation).

* :func:`_varlen_attn` serves every query layout: decoder self-attention over
  the paged cache (bottom-right causal after the cached tokens, prefills,
  chunks and decodes in one launch), cross-attention over the paged cross cache
  (non-causal) and encoder self-attention over packed K/V (non-causal, no cache).
  One program computes ``BLOCK_M`` query rows of one sequence for one head.
* :func:`_decode_attn` + :func:`_combine_splits`: batches of single-token queries
  (every decode step once prompts are in). One program takes all query heads
  that share a KV head (GQA rows fill the ``tl.dot`` tile instead of padding) and
  one slice of the keys; long caches are split over several programs (split-K)
  whose partial results are merged by their log-sum-exp.

Paged K/V are read in place: key ``n`` of a sequence lives in slot
``table[n // PAGE] * PAGE + n % PAGE`` of the cache ``[2, num_blocks, PAGE, H_kv, D]``,
so any block size works and nothing is gathered into a padded batch.

With ``HAS_BIAS`` (T5's relative position bias) both kernels add
``bias[head, center + key_pos - query_pos]`` to the scores before the softmax:
``bias`` ``[H, 2 * center + 1]`` holds one float32 value per head and relative
position (in base-2 units, like the scores), bucketed once per stack and step
by the model's own rule (``backend.relative_bias``), so a bucket here is the
bucket the model defines, to the last boundary, whatever a GPU's ``log`` would
round to. Split-K needs nothing more: each slice's log-sum-exp includes its bias.

An fp8 cache (``KV_FP8``: float8 e4m3fn or e5m2, ``kv_cache_dtype="fp8"``) is loaded
as bytes and upcast tile by tile to the query's dtype (exact: every fp8 value is a
float16 / bfloat16 / float32 one); its per-tensor scales cost nothing per element:
``k_scale`` is folded into the launch's softmax scale (q . (s k) = (s q) . k) and
``v_scale`` multiplies each output row once.

Whether the kernels run compiled (CUDA) or in Triton's interpreter (CPU, for
tests) is fixed when this module is imported, from ``TRITON_INTERPRET``. Launch
configurations (tiles, warps, stages) come from ``configs`` per target.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from tandem.backends.triton.configs import LaunchConfig, block_d

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
LOG2E = 1.4426950408889634


@triton.jit
def _load_kv_tile(
    kv_ptr, offs_n, n_mask, offs_d, d_mask, seq, kv_start_ptr, table_ptr,
    stride_tab, stride_slot, stride_kvh, kvh,
    PAGE: tl.constexpr, PAGED: tl.constexpr,
):
    """``[BLOCK_N, BLOCK_D]`` rows of keys (or values) ``offs_n`` of sequence ``seq``."""
    if PAGED:
        block = tl.load(table_ptr + seq * stride_tab + offs_n // PAGE, mask=n_mask, other=0)
        slot = block.to(tl.int64) * PAGE + offs_n % PAGE
    else:
        slot = (tl.load(kv_start_ptr + seq) + offs_n).to(tl.int64)
    ptrs = kv_ptr + slot[:, None] * stride_slot + kvh * stride_kvh + offs_d[None, :]
    return tl.load(ptrs, mask=n_mask[:, None] & d_mask[None, :], other=0.0)


@triton.jit
def _online_softmax_step(qk, valid, m_i, l_i, acc, v, DOT_F32: tl.constexpr, PRECISION: tl.constexpr):
    """Fold one tile of scores (already in base-2 units) into the running max,
    normalizer and output; masked scores count as -inf. Rows with nothing
    valid yet keep m = -inf without producing NaNs."""
    qk = tl.where(valid, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(qk - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    if DOT_F32:
        pv = tl.dot(p, v.to(tl.float32), input_precision=PRECISION)
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def _varlen_attn(
    q_ptr, k_ptr, v_ptr, o_ptr,
    tile_seq_ptr, tile_row_ptr,  # [num_tiles] sequence and first query row (within it) of each tile
    q_start_ptr,  # [S + 1] packed row where each sequence's queries start
    kv_len_ptr,  # [S] keys each sequence attends over (cached + new, or encoder length)
    kv_start_ptr,  # [S] packed row of each sequence's first key (unpaged only)
    table_ptr,  # [S, max_blocks] block table (paged only)
    bias_ptr,  # [H, 2 * bias_center + 1] float32 bias per relative position (HAS_BIAS only)
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_slot, stride_kvh, stride_tab, stride_bias, bias_center,
    scale_log2, v_scale,  # v_scale: an fp8 cache's (KV_FP8 only; its k_scale is in scale_log2)
    QUERIES_PER_KV: tl.constexpr, HEAD_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr, PAGED: tl.constexpr, CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr,
    DOT_F32: tl.constexpr, PRECISION: tl.constexpr, KV_FP8: tl.constexpr = False,
):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    kvh = head // QUERIES_PER_KV
    seq = tl.load(tile_seq_ptr + tile)
    row0 = tl.load(tile_row_ptr + tile)
    q_start = tl.load(q_start_ptr + seq)
    q_len = tl.load(q_start_ptr + seq + 1) - q_start
    kv_len = tl.load(kv_len_ptr + seq)

    offs_m = row0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < q_len
    d_mask = offs_d < HEAD_SIZE
    q_rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)

    # Bottom-right causal: query row r sits at position kv_len - q_len + r.
    q_pos = kv_len - q_len + offs_m
    hi = kv_len
    if CAUSAL:
        hi = tl.minimum(kv_len, kv_len - q_len + row0 + BLOCK_M)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(0, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < kv_len
        k = _load_kv_tile(k_ptr, offs_n, n_mask, offs_d, d_mask, seq, kv_start_ptr, table_ptr,
                          stride_tab, stride_slot, stride_kvh, kvh, PAGE, PAGED)
        v = _load_kv_tile(v_ptr, offs_n, n_mask, offs_d, d_mask, seq, kv_start_ptr, table_ptr,
                          stride_tab, stride_slot, stride_kvh, kvh, PAGE, PAGED)
        if KV_FP8:  # upcast (exact) to the dtype the dots take
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        if DOT_F32:
            k = k.to(tl.float32)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        valid = n_mask[None, :]
        if CAUSAL:
            valid = valid & (offs_n[None, :] <= q_pos[:, None])
        if HAS_BIAS:
            # In range wherever the score counts (|key - query| < kv_len <= center + 1); clamped
            # for the rest, whose scores are masked, rather than masking the loads: the mask's
            # predicates cost registers the 64-row tiles do not have.
            rel = tl.minimum(tl.maximum(bias_center + offs_n[None, :] - q_pos[:, None], 0), 2 * bias_center)
            qk += tl.load(bias_ptr + head * stride_bias + rel)
        m_i, l_i, acc = _online_softmax_step(qk, valid, m_i, l_i, acc, v, DOT_F32, PRECISION)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if KV_FP8:
        out = out * v_scale
    tl.store(o_ptr + q_rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


@triton.jit
def _decode_attn(
    q_ptr, kv_ptr, o_ptr, part_o_ptr, part_lse_ptr,
    q_row_ptr,  # [B] packed row of each sequence's single query
    kv_len_ptr,  # [B]
    table_ptr,  # [B, max_blocks]
    bias_ptr,  # [H, 2 * bias_center + 1] float32 bias per relative position (HAS_BIAS only)
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kv, stride_slot, stride_kvh, stride_tab, stride_bias, bias_center,
    scale_log2, num_heads, v_scale,  # v_scale: an fp8 cache's (KV_FP8 only; its k_scale is in scale_log2)
    QUERIES_PER_KV: tl.constexpr, HEAD_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr, NUM_SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr,
    DOT_F32: tl.constexpr, PRECISION: tl.constexpr, KV_FP8: tl.constexpr = False,
):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    kv_len = tl.load(kv_len_ptr + seq)
    q_row = tl.load(q_row_ptr + seq).to(tl.int64)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_mask = offs_h < QUERIES_PER_KV
    d_mask = offs_d < HEAD_SIZE
    heads = kvh * QUERIES_PER_KV + offs_h
    q = tl.load(q_ptr + q_row * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=h_mask[:, None] & d_mask[None, :], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)

    # This program's slice of the keys, a whole number of tiles.
    per_split = tl.cdiv(tl.cdiv(kv_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * per_split
    hi = tl.minimum(kv_len, lo + per_split)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < hi
        k = _load_kv_tile(kv_ptr, offs_n, n_mask, offs_d, d_mask, seq, kv_len_ptr, table_ptr,
                          stride_tab, stride_slot, stride_kvh, kvh, PAGE, True)
        v = _load_kv_tile(kv_ptr + stride_kv, offs_n, n_mask, offs_d, d_mask, seq, kv_len_ptr, table_ptr,
                          stride_tab, stride_slot, stride_kvh, kvh, PAGE, True)
        if KV_FP8:  # upcast (exact) to the dtype the dots take
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        if DOT_F32:
            k = k.to(tl.float32)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        if HAS_BIAS:  # the query sits at kv_len - 1
            rel = bias_center + offs_n - (kv_len - 1)
            qk += tl.load(bias_ptr + heads[:, None] * stride_bias + rel[None, :],
                          mask=h_mask[:, None] & n_mask[None, :], other=0.0)
        m_i, l_i, acc = _online_softmax_step(qk, n_mask[None, :], m_i, l_i, acc, v, DOT_F32, PRECISION)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if KV_FP8:  # before the split-K merge, which is linear in each part
        out = out * v_scale
    if NUM_SPLITS == 1:
        tl.store(o_ptr + q_row * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=h_mask[:, None] & d_mask[None, :])
    else:
        # Partial results [B, num_heads, NUM_SPLITS, (D)]; an empty slice has lse -inf.
        part = (seq * num_heads + heads) * NUM_SPLITS + split
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=h_mask)
        tl.store(part_o_ptr + part[:, None] * HEAD_SIZE + offs_d[None, :], out,
                 mask=h_mask[:, None] & d_mask[None, :])


@triton.jit
def _combine_splits(
    part_o_ptr, part_lse_ptr, o_ptr, q_row_ptr,
    stride_ot, stride_oh, num_heads,
    HEAD_SIZE: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < NUM_SPLITS
    d_mask = offs_d < HEAD_SIZE
    base = (seq * num_heads + head) * NUM_SPLITS
    lse = tl.load(part_lse_ptr + base + offs_s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)  # finite: the first slice always holds keys
    w = tl.where(s_mask, tl.exp2(lse - m), 0.0)
    parts = tl.load(part_o_ptr + (base + offs_s)[:, None] * HEAD_SIZE + offs_d[None, :],
                    mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    out = tl.sum(parts * w[:, None], 0) / tl.sum(w, 0)
    q_row = tl.load(q_row_ptr + seq).to(tl.int64)
    tl.store(o_ptr + q_row * stride_ot + head * stride_oh + offs_d, out.to(o_ptr.dtype.element_ty), mask=d_mask)


# -- launchers ---------------------------------------------------------------
# Tile sizes, warps and pipeline depth come from ``configs`` per target, dtype and
# head size; the caller passes the chosen ``LaunchConfig``.


def _dot_mode(dtype: torch.dtype) -> tuple[bool, str | None]:
    """(compute the dots in float32, input precision). The interpreter's tl.dot on
    16-bit inputs is wrong, so it gets float32 tiles; float32 on a GPU must not
    fall to TF32 (10-bit mantissa) if float32 is to mean float32."""
    if dtype == torch.float32:
        return True, "ieee"
    return INTERPRETED, "ieee" if INTERPRETED else None


def _bias_args(bias: torch.Tensor | None, query: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """(tensor, head stride, center column) for a launch; without a bias, a stand-in
    the kernel never reads."""
    if bias is None:
        return query, 0, 0
    if bias.dtype != torch.float32 or bias.stride(1) != 1 or bias.shape[1] % 2 != 1:
        raise ValueError(f"relative bias must be float32 [H, 2 * c + 1] with unit column stride, "
                         f"got {bias.dtype} {tuple(bias.shape)} strides {bias.stride()}")
    return bias, bias.stride(0), bias.shape[1] // 2


def varlen_attention(
    query: torch.Tensor,  # [T, H, D]
    key: torch.Tensor,  # [2, num_blocks, PAGE, H_kv, D] cache when paged; [E, H_kv, D] packed keys when not
    value: torch.Tensor | None,  # None when paged (the cache holds both); [E, H_kv, D] when not
    out: torch.Tensor,  # [T, H, D]
    tile_seq: torch.Tensor,  # [num_tiles] sequence of each config.block_m-row tile
    tile_row: torch.Tensor,  # [num_tiles] its first query row within the sequence
    q_start: torch.Tensor,
    kv_lens: torch.Tensor,
    *,
    scale: float,
    causal: bool,
    config: LaunchConfig,
    block_table: torch.Tensor | None = None,
    kv_start: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,  # [H, 2 * c + 1] float32, base 2: position k - q at column c + k - q
    kv_scales: tuple[float, float] | None = None,  # an fp8 cache's (k_scale, v_scale)
) -> None:
    num_tiles = tile_seq.shape[0]
    num_heads, head_size = query.shape[1], query.shape[2]
    if num_tiles == 0:
        return
    dot_f32, precision = _dot_mode(query.dtype)
    if block_table is not None:
        k_src, v_src = key[0], key[1]  # [num_blocks, PAGE, H_kv, D]; a slot is (block, offset) flattened
        stride_slot, stride_kvh = key.stride(2), key.stride(3)
        num_kv_heads, page = key.shape[3], key.shape[2]
        table, stride_tab, starts = block_table, block_table.stride(0), kv_lens
    else:
        k_src, v_src = key, value
        assert key.stride() == value.stride()
        stride_slot, stride_kvh = key.stride(0), key.stride(1)
        num_kv_heads, page, table, stride_tab, starts = key.shape[1], 1, kv_lens, 0, kv_start
    bias_t, stride_bias, center = _bias_args(bias, query)
    k_scale, v_scale = kv_scales if kv_scales is not None else (1.0, 1.0)
    _varlen_attn[(num_tiles, num_heads)](
        query, k_src, v_src, out, tile_seq, tile_row, q_start, kv_lens, starts, table, bias_t,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        stride_slot, stride_kvh, stride_tab, stride_bias, center,
        scale * k_scale * LOG2E, v_scale,
        QUERIES_PER_KV=num_heads // num_kv_heads, HEAD_SIZE=head_size,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_D=block_d(head_size),
        PAGE=page, PAGED=block_table is not None, CAUSAL=causal, HAS_BIAS=bias is not None,
        DOT_F32=dot_f32, PRECISION=precision, KV_FP8=kv_scales is not None,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )


def decode_attention(
    query: torch.Tensor,  # [T, H, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, PAGE, H_kv, D]
    out: torch.Tensor,  # [T, H, D]
    q_rows: torch.Tensor,  # [B] packed row of each sequence's single query
    kv_lens: torch.Tensor,  # [B]
    block_table: torch.Tensor,  # [B, max_blocks]
    *,
    scale: float,
    num_splits: int,
    config: LaunchConfig,
    bias: torch.Tensor | None = None,  # as varlen_attention's
    kv_scales: tuple[float, float] | None = None,  # as varlen_attention's
) -> None:
    batch = q_rows.shape[0]
    if batch == 0:
        return
    num_heads, head_size = query.shape[1], query.shape[2]
    num_kv_heads, page = kv_cache.shape[3], kv_cache.shape[2]
    per_kv = num_heads // num_kv_heads
    if config.block_m < per_kv:
        raise ValueError(f"decode config holds {config.block_m} query heads per program, "
                         f"fewer than the {per_kv} that share a KV head")
    dot_f32, precision = _dot_mode(query.dtype)
    if num_splits > 1:
        part_o = torch.empty(batch, num_heads, num_splits, head_size, dtype=torch.float32, device=query.device)
        part_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=query.device)
    else:
        part_o = part_lse = out  # unused
    bias_t, stride_bias, center = _bias_args(bias, query)
    k_scale, v_scale = kv_scales if kv_scales is not None else (1.0, 1.0)
    _decode_attn[(batch, num_kv_heads, num_splits)](
        query, kv_cache, out, part_o, part_lse, q_rows, kv_lens, block_table, bias_t,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(2), kv_cache.stride(3), block_table.stride(0), stride_bias, center,
        scale * k_scale * LOG2E, num_heads, v_scale,
        QUERIES_PER_KV=per_kv, HEAD_SIZE=head_size,
        BLOCK_H=config.block_m, BLOCK_N=config.block_n, BLOCK_D=block_d(head_size),
        PAGE=page, NUM_SPLITS=num_splits, HAS_BIAS=bias is not None, DOT_F32=dot_f32, PRECISION=precision,
        KV_FP8=kv_scales is not None,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if num_splits > 1:
        _combine_splits[(batch, num_heads)](
            part_o, part_lse, out, q_rows, out.stride(0), out.stride(1), num_heads,
            HEAD_SIZE=head_size, BLOCK_D=block_d(head_size), NUM_SPLITS=num_splits,
            BLOCK_S=triton.next_power_of_2(num_splits),
        )
