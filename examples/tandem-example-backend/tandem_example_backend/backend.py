"""``example_paged``: a complete tandem attention backend with its own KV layout
and its own operator, built only on tandem's public API.

What a backend provides (see tandem's docs/backends.md):

1. the cache layout: ``get_kv_cache_shape`` and ``kv_cache_block_dim`` (here
   block-major ``[num_blocks, 2, H_kv, block_size, D]``, blocks on dim 0);
   tandem sizes the pool from it, and its default ``swap_blocks`` /
   ``copy_blocks`` move whole blocks along that dimension;
2. the write: ``AttentionImpl.write_kv_cache`` puts new K/V at their slots
   (``slot = block * block_size + offset``) in that layout;
3. a metadata builder: turns the step's ``StepInputs`` into what the kernel
   needs, once per step (not per layer);
4. the impl: writes first (``write_new_kv``), then computes each attention kind;
5. the capability check: ``unsupported_reasons`` names every value it can't
   serve; ``auto_priority`` says whether automatic selection may pick it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tandem import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadata,
    AttentionMetadataBuilder,
    AttentionType,
    BackendCapabilities,
    StepInputs,
)
from tandem_example_backend.kernel import paged_attention


@dataclass
class ExampleMetadata(AttentionMetadata):
    token_seq: torch.Tensor  # [T] sequence of each decoder token
    token_pos: torch.Tensor  # [T] position of each decoder token (cached + offset in this step)
    seq_lens: torch.Tensor  # [S] self-attention keys per sequence
    cross_seq_lens: torch.Tensor  # [S] cross-attention keys per sequence
    block_tables: torch.Tensor  # [S, max_blocks]
    cross_block_tables: torch.Tensor  # [S, max_cross_blocks]
    encoder_runs: list[tuple[int, int]]  # (first packed row, length) of each encoder run this step


class ExampleMetadataBuilder(AttentionMetadataBuilder):
    def build(self, inputs: StepInputs) -> ExampleMetadata:
        dev = self.device
        q_lens = torch.tensor(inputs.query_lens, dtype=torch.long, device=dev)
        seq_lens = torch.tensor(inputs.seq_lens, dtype=torch.long, device=dev)
        token_seq = torch.repeat_interleave(torch.arange(len(inputs.query_lens), device=dev), q_lens)
        runs, row = [], 0
        for n in inputs.encoder_seq_lens:
            runs.append((row, n))
            row += n
        return ExampleMetadata(
            num_decoder_tokens=int(inputs.input_ids.shape[0]),
            slot_mapping=inputs.slot_mapping,
            cross_slot_mapping=inputs.cross_slot_mapping,
            num_encoder_tokens=int(inputs.encoder_positions.shape[0]),
            token_seq=token_seq,
            token_pos=inputs.positions,
            seq_lens=seq_lens,
            cross_seq_lens=torch.tensor(inputs.cross_seq_lens, dtype=torch.long, device=dev),
            block_tables=inputs.block_tables,
            cross_block_tables=inputs.cross_block_tables,
            encoder_runs=runs,
        )


class ExampleImpl(AttentionImpl):
    def write_kv_cache(self, key, value, kv_cache, slot_mapping) -> None:
        # key/value [N, H_kv, D] -> cache[block, 0 or 1, :, offset, :]
        block_size = kv_cache.shape[3]
        blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
        kv_cache[blocks, 0, :, offsets] = key.to(kv_cache.dtype)
        kv_cache[blocks, 1, :, offsets] = value.to(kv_cache.dtype)

    def forward(self, query, key, value, kv_cache, attn_metadata: ExampleMetadata, attn_type) -> torch.Tensor:
        md = attn_metadata
        self.write_new_kv(key, value, kv_cache, md, attn_type)
        if attn_type is AttentionType.ENCODER:  # packed runs, no cache: plain SDPA per run
            out = torch.empty_like(query)
            gqa = self.num_kv_heads != self.num_heads
            for start, n in md.encoder_runs:
                q, k, v = (t[start : start + n].transpose(0, 1).unsqueeze(0) for t in (query, key, value))
                o = F.scaled_dot_product_attention(q, k, v, scale=self.scale, enable_gqa=gqa)
                out[start : start + n] = o[0].transpose(0, 1)
            return out
        if query.shape[0] == 0:
            return torch.empty_like(query)
        cross = attn_type is AttentionType.ENCODER_DECODER
        return paged_attention(
            query, kv_cache,
            md.cross_block_tables if cross else md.block_tables,
            md.token_seq, md.token_pos,
            md.cross_seq_lens if cross else md.seq_lens,
            self.scale, not cross,
        )


class ExamplePagedBackend(AttentionBackend):
    name = "example_paged"  # must equal the name plugin.py registers
    priority = 0
    capabilities = BackendCapabilities(
        devices=("cpu", "cuda"),
        dtypes=(torch.float32, torch.float16, torch.bfloat16),
        notes="an example: block-major KV layout, a custom op reading blocks in place; only when asked for",
    )

    kv_cache_block_dim = 0

    @staticmethod
    def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size):
        return (num_blocks, 2, num_kv_heads, block_size, head_size)

    @staticmethod
    def get_impl_cls():
        return ExampleImpl

    @staticmethod
    def get_metadata_builder_cls():
        return ExampleMetadataBuilder

    @classmethod
    def auto_priority(cls, device, dtype):
        return None  # an example: serve only when asked for by name

    @classmethod
    def unsupported_reasons(cls, device, dtype, head_size, attn_types, block_size, kv_cache_dtype):
        reasons = []
        if device.type not in ("cpu", "cuda"):
            reasons.append(f"device {device.type!r} is not cpu or cuda")
        if dtype not in cls.capabilities.dtypes:
            reasons.append(f"dtype {dtype} is not float32, float16 or bfloat16")
        if kv_cache_dtype != dtype:
            reasons.append(f"KV-cache dtype {kv_cache_dtype} differs from the model dtype {dtype}")
        if block_size < 1:
            reasons.append(f"block_size {block_size} is not >= 1")
        return reasons
