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
   needs, once per step (not per layer); its metadata extends
   ``AttentionMetadata`` (slot mappings, lengths, block tables: built by tandem's
   runner) with the kernel's own fields only;
4. the impl: writes first (``write_new_kv``), then computes each attention kind;
5. what it serves, declared as ``capabilities`` (tandem's default
   ``unsupported_reasons`` names every value outside them); ``auto_priority``
   says whether automatic selection may pick it.
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
    # block_tables, cross_block_tables, seq_lens, ... come with AttentionMetadata.
    token_seq: torch.Tensor  # [T] sequence of each decoder token
    token_pos: torch.Tensor  # [T] position of each decoder token (cached + offset in this step)
    key_lens: torch.Tensor  # [S] self-attention keys per sequence (seq_lens as a tensor)
    cross_key_lens: torch.Tensor  # [S] cross-attention keys per sequence
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
        return ExampleMetadata.from_inputs(
            inputs,
            token_seq=token_seq,
            token_pos=inputs.positions,
            key_lens=seq_lens,
            cross_key_lens=torch.tensor(inputs.cross_seq_lens, dtype=torch.long, device=dev),
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
            md.cross_key_lens if cross else md.key_lens,
            self.scale, not cross,
        )


class ExamplePagedBackend(AttentionBackend):
    name = "example_paged"  # must equal the name plugin.py registers
    priority = 0
    capabilities = BackendCapabilities(
        devices=("cpu", "cuda"),
        dtypes=(torch.float32, torch.float16, torch.bfloat16),
        # head_sizes, block_sizes (SizeRule), kv_cache_dtypes and attn_types default to "any"
        # and "the model's dtype"; narrow them here and the default check names what is not served.
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

