"""Triton backend: one varlen kernel for every mixed batch (paged self- and
cross-attention, packed encoder attention) and a split-K decode kernel for
batches of single-token queries. Uses the default KV layout
``[2, num_blocks, block_size, H_kv, D]`` and core's write/swap/copy ops; the
kernels read blocks in place through the block tables (no gathers).

Serves the ``"relative_position_bias"`` feature (T5) in both kernels: encoder runs
(bidirectional), prefills and chunks (causal), decodes (split-K included). The
bias reaches them as one float32 value per head and relative position
(:func:`relative_bias`), bucketed by the model's own
:func:`~tandem.core.relative_position.relative_position_bucket` once per stack
and step, so the kernels never recompute T5's float32 log bucketing (a GPU's
``log`` could round a boundary distance into the next bucket)."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from dataclasses import dataclass, field

import torch

from tandem.core.attention import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadata,
    AttentionMetadataBuilder,
    AttentionType,
    BackendCapabilities,
    SizeRule,
)
from tandem.backends.triton import configs
from tandem.core.kv import fp8
from tandem.core.kv_compress_config import FEATURE as CROSS_KV_COMPRESS
from tandem.core.relative_position import FEATURE as RELATIVE_POSITION_BIAS
from tandem.core.relative_position import RelativePositionBias

_KERNELS = "tandem.backends.triton.kernels"
MAX_HEAD_SIZE = 256  # the head dimension lives in registers, padded to a power of two


def _kernels():
    return importlib.import_module(_KERNELS)


def _interpreting() -> bool:
    """Whether the kernels run (or, once imported, would run) in Triton's interpreter."""
    loaded = sys.modules.get(_KERNELS)
    if loaded is not None:
        return loaded.INTERPRETED
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@dataclass
class TritonMetadata(AttentionMetadata):
    query_start_loc_i32: torch.Tensor  # [S + 1] int32
    seq_lens_i32: torch.Tensor  # [S] int32, cached + new tokens
    cross_seq_lens_i32: torch.Tensor  # [S] int32, encoder positions each sequence reads
    # Every sequence has exactly one new token: the decode kernel runs instead,
    # its keys split over this many programs per sequence and KV head.
    decode_only: bool
    self_splits: int
    cross_splits: int
    # Encoder runs this step, packed: [G + 1] starts, [G] lengths.
    encoder_start_loc: torch.Tensor
    encoder_lens: torch.Tensor
    # Varlen launches: (sequence, first query row within it) of each tile, per
    # (encoder?, rows per tile), built on first use: the tile height is the
    # launch configuration's, chosen per target, dtype and head size.
    _tiles: dict = field(default_factory=dict, repr=False)

    def tiles(self, encoder: bool, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        key = (encoder, rows)
        if key not in self._tiles:
            lens = self.encoder_seq_lens if encoder else self.query_lens
            seq, row = _tiles(torch.tensor(lens, dtype=torch.int32), rows)
            dev = self.encoder_lens.device
            self._tiles[key] = (seq.to(dev, non_blocking=True), row.to(dev, non_blocking=True))
        return self._tiles[key]


def _tiles(lens: torch.Tensor, rows_per_tile: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence, first row) of each ``rows_per_tile``-row tile over sequences of ``lens``."""
    per_seq = (lens + rows_per_tile - 1) // rows_per_tile
    seq = torch.repeat_interleave(torch.arange(lens.numel(), dtype=torch.int32), per_seq)
    first = torch.cumsum(per_seq, 0) - per_seq
    row = (torch.arange(int(per_seq.sum()), dtype=torch.int32) - torch.repeat_interleave(first, per_seq))
    return seq, (row * rows_per_tile).to(torch.int32)


class TritonMetadataBuilder(AttentionMetadataBuilder):
    # Keys per decode program before a sequence's keys are split over more
    # programs (split-K), and the most splits: a long cache otherwise leaves
    # one program per (sequence, KV head) walking it alone while the GPU idles.
    split_kv_tokens = 512
    max_splits = 16

    def _splits(self, lens: list[int]) -> int:
        longest = max(lens, default=0)
        return max(1, min(self.max_splits, -(-longest // self.split_kv_tokens)))

    def build(self, inputs) -> TritonMetadata:
        dev = self.device
        enc_lens = torch.tensor(inputs.encoder_seq_lens, dtype=torch.int32)
        enc_start = torch.zeros(len(inputs.encoder_seq_lens) + 1, dtype=torch.int32)
        torch.cumsum(enc_lens, 0, out=enc_start[1:])
        decode_only = bool(inputs.query_lens) and all(q == 1 for q in inputs.query_lens)

        def on_dev(t: torch.Tensor) -> torch.Tensor:
            return t.to(dev, non_blocking=True)

        return TritonMetadata.from_inputs(
            inputs,
            query_start_loc_i32=inputs.query_start_loc.to(dev, torch.int32),
            seq_lens_i32=on_dev(torch.tensor(inputs.seq_lens, dtype=torch.int32)),
            cross_seq_lens_i32=on_dev(torch.tensor(inputs.cross_seq_lens, dtype=torch.int32)),
            decode_only=decode_only,
            self_splits=self._splits(inputs.seq_lens) if decode_only else 1,
            cross_splits=self._splits(inputs.cross_seq_lens) if decode_only else 1,
            encoder_start_loc=on_dev(enc_start),
            encoder_lens=on_dev(enc_lens),
        )


_LOG2E = 1.4426950408889634


def relative_bias(pb: RelativePositionBias, longest: int, device: torch.device) -> torch.Tensor:
    """``[H, 2 * longest - 1]`` float32: the bias of each head for relative position
    ``key_pos - query_pos = r`` at column ``longest - 1 + r``, ``|r| < longest``, in
    base-2 units (times log2 e, as the kernels' scores are). Computed once per stack
    and step (memoized on ``pb``) and read by every layer."""

    longest = max(longest, 1)

    def compute() -> torch.Tensor:
        rel = torch.arange(-(longest - 1), longest, device=pb.table.device)
        bias = pb.bias(torch.zeros(1, dtype=rel.dtype, device=rel.device), rel)[:, 0]  # [H, 2 * longest - 1]
        return (bias.to(device, torch.float32) * _LOG2E).contiguous()

    return pb.memo(("triton", longest), compute)


class TritonImpl(AttentionImpl):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int) -> None:
        super().__init__(num_heads, head_size, scale, num_kv_heads)
        self._k = _kernels()

    def forward(
        self,
        query: torch.Tensor,  # [T, H, D]
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor | None,  # [2, num_blocks, block_size, H_kv, D]; None for ENCODER
        attn_metadata: TritonMetadata,
        attn_type: AttentionType,
        position_bias: RelativePositionBias | None = None,  # self-attention of T5-like models
    ) -> torch.Tensor:
        md = attn_metadata
        self.write_new_kv(key, value, kv_cache, md, attn_type)
        out = torch.empty_like(query)
        arch = target_arch(query.device)
        if attn_type is AttentionType.ENCODER:
            cfg = configs.varlen(arch, query.dtype, self.head_size, md.max_encoder_seq_len,
                                 bias=position_bias is not None)
            tile_seq, tile_row = md.tiles(True, cfg.block_m)
            bias = None if position_bias is None else relative_bias(position_bias, md.max_encoder_seq_len,
                                                                     query.device)
            self._k.varlen_attention(
                query, key, value, out, tile_seq, tile_row, md.encoder_start_loc, md.encoder_lens,
                scale=self.scale, causal=False, config=cfg, kv_start=md.encoder_start_loc, bias=bias,
            )
            return out
        cross = attn_type is AttentionType.ENCODER_DECODER
        if cross and position_bias is not None:
            raise ValueError("relative position bias is for self-attention; cross attention takes none")
        bias = None if position_bias is None else relative_bias(position_bias, md.max_seq_len, query.device)
        lens = md.cross_seq_lens_i32 if cross else md.seq_lens_i32
        tables = md.cross_block_tables if cross else md.block_tables
        # An fp8 cache: the kernels upcast its tiles and take the scales (as floats:
        # fixed once calibrated, so no device read per step).
        scales = (self.kv_scales.k_scale, self.kv_scales.v_scale) if fp8.is_fp8(kv_cache.dtype) else None
        if md.decode_only:
            cfg = configs.decode(arch, query.dtype, self.head_size, self.num_heads // self.num_kv_heads,
                                 kv_fp8=scales is not None)
            self._k.decode_attention(
                query, kv_cache, out, md.query_start_loc_i32[:-1], lens, tables, scale=self.scale,
                num_splits=md.cross_splits if cross else md.self_splits, config=cfg, bias=bias, kv_scales=scales,
            )
        else:
            cfg = configs.varlen(arch, query.dtype, self.head_size, md.max_query_len, bias=bias is not None,
                                 kv_fp8=scales is not None)
            tile_seq, tile_row = md.tiles(False, cfg.block_m)
            self._k.varlen_attention(
                query, kv_cache, None, out, tile_seq, tile_row, md.query_start_loc_i32, lens,
                scale=self.scale, causal=not cross, config=cfg, block_table=tables, bias=bias, kv_scales=scales,
            )
        return out


# The target whose launch configurations the interpreter runs (it has none of its
# own; tests set 90 to run Hopper's tiles interpreted).
INTERPRETER_ARCH = 80
_ARCHS: dict[int, int] = {}


def target_arch(device: torch.device) -> int:
    """``major * 10 + minor`` of the GPU the kernels compile for: Triton's own
    target for ``device`` (so a stand-in driver's target drives ahead-of-time
    compiles), or :data:`INTERPRETER_ARCH` when the kernels run interpreted."""
    if _interpreting():
        return INTERPRETER_ARCH
    index = device.index if device.index is not None else (
        torch.cuda.current_device() if device.type == "cuda" else -1)
    arch = _ARCHS.get(index)
    if arch is None:
        from triton.runtime import driver

        arch = _ARCHS[index] = int(driver.active.get_current_target().arch)
    return arch


class TritonBackend(AttentionBackend):
    name = "triton"
    priority = 20
    capabilities = BackendCapabilities(
        devices=("cuda", "cpu"),
        dtypes=(torch.float32, torch.float16, torch.bfloat16),
        block_sizes=SizeRule(note="keys are addressed per token through the block table"),
        head_sizes=SizeRule(max=MAX_HEAD_SIZE),
        requires=("triton",),
        attn_features=frozenset({RELATIVE_POSITION_BIAS, CROSS_KV_COMPRESS}),
        notes="cpu only in Triton's interpreter (TRITON_INTERPRET=1 before first use): "
        "exact but slow, for tests; chosen automatically on cuda only; an fp8 cache is upcast tile by tile "
        "(float8_e4m3fn on compute capability 8.9+)",
        fp8_kv_dtypes=(torch.float8_e4m3fn, torch.float8_e5m2),
    )

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return TritonImpl

    @staticmethod
    def get_metadata_builder_cls() -> type[AttentionMetadataBuilder]:
        return TritonMetadataBuilder

    @classmethod
    def auto_priority(cls, device: torch.device, dtype: torch.dtype) -> int | None:
        return cls.priority if device.type == "cuda" else None

    @classmethod
    def extra_unsupported_reasons(cls, device, dtype, head_size, attn_types, block_size,
                                  kv_cache_dtype) -> list[str]:
        reasons = []
        if importlib.util.find_spec("triton") is None:
            reasons.append("the triton package is not installed (pip install 'tandem-engine[triton]')")
        if device.type == "cpu" and not _interpreting():
            reasons.append(
                "device cpu: tandem's Triton kernels compile for CUDA; on CPU they run only in "
                "Triton's interpreter (set TRITON_INTERPRET=1 before the backend is first used; "
                "slow, meant for tests)"
            )
        elif device.type == "cuda" and _interpreting():
            reasons.append("TRITON_INTERPRET=1 was set when the kernels loaded: they run interpreted, "
                           "not compiled for cuda")
        if kv_cache_dtype == torch.float8_e4m3fn and device.type == "cuda" and torch.cuda.is_available():
            cap = torch.cuda.get_device_capability(device)
            if cap < (8, 9):
                reasons.append(f"an fp8 e4m3 KV cache needs compute capability 8.9+ for Triton's float8e4nv "
                               f"(this GPU is {cap[0]}.{cap[1]}); kv_cache_dtype='fp8_e5m2' is served here")
        return reasons
