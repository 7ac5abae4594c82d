"""``cpu_paged``: torch_sdpa's encoder and prefill paths, with every decode (self-
and cross-attention) computed by one C++ op per layer that reads K/V in place
from the paged cache through the block tables.

torch_sdpa gathers each decoding sequence's blocks into a padded batch every
layer of every step, then runs masked SDPA over the padding; on CPU those
gathers and the padded work were ~20% of a translation run's time. The op
instead walks each sequence's blocks where they lie, one task per sequence
(split into runs of KV heads only for small batches) over torch's intra-op
threads, in float32 arithmetic. Decodes that share a cross table (a request's
beams, its n > 1 samples, requests with one encoder input) attend to it as one
multi-query task: its cross K/V is read once per step, not once per row.

Serves the ``"relative_position_bias"`` feature (T5): encoder runs and prefills take
it as torch_sdpa does (SDPA's additive mask); decodes hand the op one float32 row
``[H, W]`` per stack and step, the bias of a query at ``W - 1`` over keys
``0..W-1``, which every sequence reads right-aligned (T5's bias depends only on the
query-to-key distance), added inside the op's softmax.

Uses the default KV layout ``[2, num_blocks, block_size, H_kv, D]`` and core's
swap/copy ops; new keys and values go in by the op library's ``write_slots`` (a memcpy a
token, where core's two ``index_copy_`` calls cost ~20 us each on a decode step's rows),
or core's write where its preconditions do not hold (an fp8 cache, a dtype to convert). An fp8 cache (``kv_cache_dtype="fp8"``): decodes read the bytes in
place (converted to float32 in vectors, the scales folded into the query scale and
the softmax's normalizer); prefills read it dequantized as torch_sdpa does. Chosen automatically on CPU (priority 15, above
torch_sdpa) when the op builds; if it cannot (no C++ compiler or ninja), the
reason is reported and torch_sdpa serves.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.backends.cpu_paged import ops
from tandem.backends.cpu_sampling import ops as sampling_ops
from tandem.backends.torch_sdpa import SDPAImplBase, SDPAMetadata, SDPAMetadataBuilderBase
from tandem.core.attention import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    BackendCapabilities,
)
from tandem.core.kv import fp8
from tandem.core.relative_position import FEATURE as RELATIVE_POSITION_BIAS
from tandem.core.kv_compress_config import FEATURE as CROSS_KV_COMPRESS
from tandem.core.kv_compress_config import PER_HEAD_FEATURE as CROSS_KV_COMPRESS_PER_HEAD
from tandem.core.relative_position import RelativePositionBias


@dataclass
class CPUPagedMetadata(SDPAMetadata):
    seq_lens_t: torch.Tensor  # [S] int64: cached + new tokens
    cross_seq_lens_t: torch.Tensor  # [S] int64: encoder positions each sequence reads
    # Offsets into the decodes [G + 1] of runs that share one cross table (a request's
    # beams or n > 1 samples); None when no two adjacent decodes share one.
    cross_groups: torch.Tensor | None
    # The decodes whose cross table the op reads ([Dc] packed rows and sequence indices):
    # all of them but those kv_compress reads per head (SDPAImplBase.forward reads those).
    cross_decode_rows: torch.Tensor
    cross_decode_seqs: torch.Tensor


def shared_runs(tables: torch.Tensor, lens: torch.Tensor) -> torch.Tensor | None:
    """``[G + 1]`` int64 offsets of the runs of adjacent rows with equal tables and
    lengths (``tables`` ``[D, W]``, ``lens`` ``[D]``), or None if every run is one row."""
    if tables.shape[0] < 2:
        return None
    same = (tables[1:] == tables[:-1]).all(dim=1) & (lens[1:] == lens[:-1])  # [D - 1]
    if not bool(same.any()):
        return None
    breaks = (~same).nonzero().flatten() + 1
    n = torch.tensor([tables.shape[0]], dtype=torch.long)
    return torch.cat([torch.zeros(1, dtype=torch.long), breaks, n])


class CPUPagedMetadataBuilder(SDPAMetadataBuilderBase):
    def __init__(self, block_size, device, kv_spec) -> None:
        super().__init__(block_size, device, kv_spec)
        # The last decode step's cross inputs (its cross tables and lengths, as objects) and
        # what was found from them: the runner hands the same objects on while the step's
        # rows are those of the last (model_runner._Rows), and never writes into them.
        self._cross_memo: tuple | None = None

    def build(self, inputs) -> CPUPagedMetadata:
        common, _, _ = self.common_fields(inputs, view_starts=False)
        seqs, rows = common["decode_seqs"], common["decode_rows"]
        memo = self._cross_memo
        every_row = inputs.max_query_len == 1 and not common["cross_head_decodes"]  # seqs: all rows
        if (every_row and memo is not None and memo[0] is inputs.cross_block_tables
                and memo[1] is inputs.cross_seq_lens):
            cross_lens, groups = memo[2], memo[3]
        else:
            cross_lens = torch.tensor(inputs.cross_seq_lens, dtype=torch.long)
            if common["cross_head_decodes"]:
                per_head = common["cross_head_index"]
                keep = torch.tensor([i not in per_head for i in seqs.tolist()], dtype=torch.bool)
                seqs, rows = seqs[keep], rows[keep]
            groups = None
            if seqs.numel() > 1 and inputs.max_cross_seq_len > 0:
                # Beams and forks sit next to each other in the step (a group's sequences are
                # listed together), so adjacent decodes with one cross table find each other.
                groups = shared_runs(inputs.cross_block_tables.index_select(0, seqs),
                                     cross_lens.index_select(0, seqs))
            self._cross_memo = (inputs.cross_block_tables, inputs.cross_seq_lens, cross_lens, groups) \
                if every_row else None
        return CPUPagedMetadata.from_inputs(
            inputs,
            **common,
            seq_lens_t=torch.tensor(inputs.seq_lens, dtype=torch.long),
            cross_seq_lens_t=cross_lens,
            cross_groups=groups,
            cross_decode_rows=rows,
            cross_decode_seqs=seqs,
        )


class CPUPagedImpl(SDPAImplBase):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int) -> None:
        super().__init__(num_heads, head_size, scale, num_kv_heads)
        self._op = ops.load()
        sampling_ops.install()  # the greedy argmax in C++ too, where it builds (worker/reductions.py)

    def write_kv_cache(self, key, value, kv_cache, slot_mapping) -> None:
        if (key.dtype is kv_cache.dtype and value.dtype is kv_cache.dtype and key.stride(-1) == 1
                and value.stride(-1) == 1 and key.stride(-2) == key.shape[-1] and value.stride(-2) == value.shape[-1]
                and kv_cache.is_contiguous() and slot_mapping.dtype is torch.long and slot_mapping.is_contiguous()):
            if key.shape[0]:
                torch.ops.tandem_cpu.write_slots(key, value, kv_cache, slot_mapping)
            return
        super().write_kv_cache(key, value, kv_cache, slot_mapping)

    def forward_decodes(self, query, kv_cache, md: CPUPagedMetadata, is_cross, out, position_bias=None) -> None:
        if query.stride(-1) != 1:
            query = query.contiguous()
        # An fp8 cache: the op converts each byte in its inner loop and applies the scales.
        scales = (self.kv_scales.k_scale, self.kv_scales.v_scale) if fp8.is_fp8(kv_cache.dtype) else (1.0, 1.0)
        if is_cross:
            if md.cross_decode_seqs.numel():
                self._op(query, kv_cache, out, md.cross_decode_rows, md.cross_decode_seqs, md.cross_seq_lens_t,
                         md.cross_block_tables, self.scale, None, md.cross_groups, *scales)
        elif position_bias is None:
            self._op(query, kv_cache, out, md.decode_rows, md.decode_seqs, md.seq_lens_t, md.block_tables, self.scale,
                     None, None, *scales)
        else:
            pb = position_bias
            row = pb.memo(("cpu_paged decode",), lambda: self._decode_bias(pb, md.max_seq_len))
            self._op(query, kv_cache, out, md.decode_rows, md.decode_seqs, md.seq_lens_t, md.block_tables,
                     self.scale, row, None, *scales)

    @staticmethod
    def _decode_bias(pb: RelativePositionBias, width: int) -> torch.Tensor:
        """``[H, width]`` float32: the bias of a query at ``width - 1`` over keys
        ``0..width-1``; a sequence of length ``L`` reads its last ``L`` columns."""
        key_pos = torch.arange(width)
        return pb.bias(key_pos[-1:], key_pos)[:, 0].float().contiguous()


class CPUPagedBackend(AttentionBackend):
    name = "cpu_paged"
    priority = 15  # above torch_sdpa (10), on CPU only
    capabilities = BackendCapabilities(
        devices=("cpu",),
        dtypes=(torch.float32, torch.float16, torch.bfloat16),
        attn_features=frozenset({RELATIVE_POSITION_BIAS, CROSS_KV_COMPRESS, CROSS_KV_COMPRESS_PER_HEAD}),
        requires=("a C++ compiler and ninja (the op builds on first use, then loads from torch's cache)",),
        notes="decodes: one C++ op per layer reading paged K/V in place (float32 arithmetic; an fp8 cache "
        "converted in its inner loop); encoder and prefills: SDPA as torch_sdpa; relative position bias in both",
        fp8_kv_dtypes=(torch.float8_e4m3fn, torch.float8_e5m2),
    )

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return CPUPagedImpl

    @staticmethod
    def get_metadata_builder_cls() -> type[AttentionMetadataBuilder]:
        return CPUPagedMetadataBuilder

    @classmethod
    def auto_priority(cls, device: torch.device, dtype: torch.dtype) -> int | None:
        return cls.priority if device.type == "cpu" else None

    @classmethod
    def unsupported_reasons(cls, device, dtype, head_size, attn_types, block_size, kv_cache_dtype) -> list[str]:
        reasons = super().unsupported_reasons(device, dtype, head_size, attn_types, block_size, kv_cache_dtype)
        if not reasons:  # build (or load) the op only where it would serve
            try:
                ops.load()
            except ops.CPUOpUnavailable as e:
                reasons.append(f"its C++ op is unavailable: {e}")
        return reasons
