"""flash_attn backend: FlashAttention's varlen kernels, one call per attention kind.

Three kernel sources, the first that can serve the GPU and head size wins
(``KERNELS`` in ``flash_attn_kernels``):

- ``fa4``: FlashAttention-4, ``flash_attn.cute.flash_attn_varlen_func`` (the
  ``flash-attn-4`` wheel, CuTe DSL, 4.0.0b11 or later), Hopper (sm90) and
  Blackwell (sm100). Reads the paged cache in place through ``page_table`` with
  ``seqused_k``. A block size equal to FA4's key tile takes its TMA path; any
  other its non-TMA paged loader, which FA4 refuses ("Paged KV does not support
  irregular head dim") for head sizes that are not multiples of 16: there the
  step's K/V are gathered into packed runs instead. The key tile is 128 on
  sm100; on sm90 it depends on the head size and on causality (128, but 144 for
  head sizes 65-96 non-causal, 112 for 129-192, 80 for 193-256:
  ``fa4_key_tile``). On sm100 FA4 takes head sizes 8..128 and 256 only.
- ``fa2``: FlashAttention-2, ``flash_attn.flash_attn_varlen_func`` (the
  ``flash-attn`` package, a source build), Ampere or newer (sm80+). Its
  ``block_table`` path needs a page size divisible by 256 ("Paged KV cache block
  size must be divisible by 256", ``mha_varlen_fwd`` in
  csrc/flash_attn/flash_api.cpp); with other block sizes the step's K/V are
  gathered into packed runs.
- ``torch``: PyTorch's own FlashAttention-2 build,
  ``torch.nn.attention.varlen.varlen_attn`` (sm80+). Its ``block_table`` path
  goes through the same ``mha_varlen_fwd`` (aten/src/ATen/native/transformers/
  cuda/flash_attn/flash_api.cpp): page size divisible by 256, else gathered.

A source counts only where its installed interface takes tandem's call (read
from the installed files, not imported): flash-attn 2's sdist installs its own
older ``flash_attn/cute`` whose ``flash_attn_varlen_func`` has no
``max_seqlen_q``, and if it overwrote FA4's, ``fa4`` is passed over with that
reason.

All three: float16 / bfloat16 only, head size a multiple of 8 up to 256, GQA
native (``enable_gqa`` for torch), causal masks aligned bottom-right when the
query run is shorter than the key run (FA2 since 2.1; FA4; torch's build
enables causal as window (-1, 0), which is the same alignment) -- exactly
decoder self-attention after cached tokens.

The cache layout is the default ``[2, num_blocks, block_size, H_kv, D]``:
``kv_cache[0]`` / ``kv_cache[1]`` are FlashAttention's paged
``[num_pages, page_size, H_kv, D]`` key and value caches as they are.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from tandem.backends import flash_attn_kernels as kernels
from tandem.backends.flash_attn_kernels import (
    FA2_PAGE_MULTIPLE,
    HEAD_ALIGN,
    KERNELS,
    MAX_HEAD_SIZE,
    Kernel,
    fa4_key_tile,
    kernel_problem,
    pages_in_place,
)
from tandem.core.attention import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadata,
    AttentionMetadataBuilder,
    AttentionType,
    BackendCapabilities,
    SizeRule,
)
from tandem.core.kv.cache_ops import packed_slots

logger = logging.getLogger(__name__)


def _capability(device: torch.device) -> tuple[int, int] | None:
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(device)


def kernel_problems(device: torch.device, head_size: int) -> dict[str, str | None]:
    """Each kernel source's reason it cannot serve ``device`` at ``head_size`` (None: it can),
    in ``KERNELS`` order (when the GPU can't be asked, e.g. no CUDA here, only what is
    installed decides)."""
    cap = _capability(device)
    return {k.name: kernel_problem(k, cap, head_size) for k in KERNELS}


def pick_kernel(device: torch.device, head_size: int) -> Kernel | None:
    """The first kernel in ``KERNELS`` that can serve ``device`` at ``head_size``."""
    problems = kernel_problems(device, head_size)
    return next((k for k in KERNELS if problems[k.name] is None), None)


def paging_mode(kernel: Kernel, block_size: int, capability: tuple[int, int] | None, head_size: int,
                causal: bool) -> str:
    """How one attention kind reads the cache, in words (the builder logs it)."""
    if not pages_in_place(kernel, block_size, capability, head_size, causal):
        if kernel.any_page_size:
            why = (f"FA4's non-TMA paged loader refuses head size {head_size} (not a multiple of 16) at block "
                   f"size {block_size}" + (", its key tile being "
                                           f"{fa4_key_tile(capability, head_size, causal)}" if capability else
                                           " on an unknown GPU"))
        else:
            why = f"block size {block_size} is not a multiple of {FA2_PAGE_MULTIPLE}"
        return f"K/V gathered per step ({why})"
    if kernel.any_page_size and capability is not None:
        tile = fa4_key_tile(capability, head_size, causal)
        return "read in place, " + ("TMA path" if block_size == tile else f"non-TMA paged loader (key tile {tile})")
    return "read in place"


@dataclass
class FlashAttnMetadata(AttentionMetadata):
    kernel: Kernel
    # Per kind: read the cache through block tables, else gather into packed runs.
    self_paged: bool
    cross_paged: bool
    cu_q: torch.Tensor  # [S + 1] int32
    # Decoder self-attention keys (cached + new) and cross-attention keys, per sequence.
    self_lens: torch.Tensor  # [S] int32
    cu_self: torch.Tensor  # [S + 1] int32
    cross_lens: torch.Tensor
    cu_cross: torch.Tensor
    page_tables: torch.Tensor | None  # [S, max_blocks] int32 block tables when self_paged
    cross_page_tables: torch.Tensor | None  # when cross_paged
    self_slots: torch.Tensor | None  # [sum(self_lens)] cache slots to gather when not self_paged
    cross_slots: torch.Tensor | None
    cu_encoder: torch.Tensor  # [G + 1] int32


def _cumulative(lens: list[int], device) -> torch.Tensor:
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    if lens:
        torch.cumsum(torch.tensor(lens, dtype=torch.int32), 0, out=cu[1:])
    return cu.to(device)


class FlashAttnMetadataBuilder(AttentionMetadataBuilder):
    def __init__(self, block_size, device, kv_spec) -> None:
        super().__init__(block_size, device, kv_spec)
        device = torch.device(device)
        head_size = kv_spec.head_size
        self.kernel = pick_kernel(device, head_size)
        if self.kernel is None:
            raise RuntimeError("flash_attn: no FlashAttention kernel can serve head size "
                               f"{head_size} here (see unsupported_reasons)")
        cap = _capability(device)
        # Decoder self-attention is causal, cross-attention is not: FA4's key tile can differ.
        self.self_paged = pages_in_place(self.kernel, block_size, cap, head_size, causal=True)
        self.cross_paged = pages_in_place(self.kernel, block_size, cap, head_size, causal=False)
        logger.info("flash_attn backend: %s kernel; self-attention: %s; cross-attention: %s", self.kernel.name,
                    paging_mode(self.kernel, block_size, cap, head_size, causal=True),
                    paging_mode(self.kernel, block_size, cap, head_size, causal=False))

    def build(self, inputs) -> FlashAttnMetadata:
        dev = self.device
        seq_lens = torch.tensor(inputs.seq_lens, dtype=torch.int32)
        cross_lens = torch.tensor(inputs.cross_seq_lens, dtype=torch.int32)

        def tables_or_slots(paged, tables, lens):
            if paged:
                return tables.to(torch.int32), None
            return None, packed_slots(tables, lens.long(), self.block_size)

        tables, self_slots = tables_or_slots(self.self_paged, inputs.block_tables, seq_lens)
        cross_tables, cross_slots = tables_or_slots(self.cross_paged, inputs.cross_block_tables, cross_lens)
        return FlashAttnMetadata.from_inputs(
            inputs,
            kernel=self.kernel,
            self_paged=self.self_paged,
            cross_paged=self.cross_paged,
            cu_q=_cumulative(inputs.query_lens, dev),
            self_lens=seq_lens.to(dev),
            cu_self=_cumulative(inputs.seq_lens, dev),
            cross_lens=cross_lens.to(dev),
            cu_cross=_cumulative(inputs.cross_seq_lens, dev),
            page_tables=tables,
            cross_page_tables=cross_tables,
            self_slots=self_slots,
            cross_slots=cross_slots,
            cu_encoder=_cumulative(inputs.encoder_seq_lens, dev),
        )


class FlashAttnImpl(AttentionImpl):
    def forward(
        self,
        query: torch.Tensor,  # [T, H, D]
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor | None,  # [2, num_blocks, block_size, H_kv, D]; None for ENCODER
        attn_metadata: FlashAttnMetadata,
        attn_type: AttentionType,
    ) -> torch.Tensor:
        md = attn_metadata
        self.write_new_kv(key, value, kv_cache, md, attn_type)
        if query.shape[0] == 0:
            return torch.empty_like(query)
        call = getattr(kernels, md.kernel.call)
        if attn_type is AttentionType.ENCODER:
            return call(query, key, value, cu_q=md.cu_encoder, max_q=md.max_encoder_seq_len, cu_k=md.cu_encoder,
                        max_k=md.max_encoder_seq_len, seqused_k=None, block_table=None, scale=self.scale,
                        causal=False)
        cross = attn_type is AttentionType.ENCODER_DECODER
        lens, cu_k, max_k = (md.cross_lens, md.cu_cross, md.max_cross_seq_len) if cross else \
            (md.self_lens, md.cu_self, md.max_seq_len)
        if md.cross_paged if cross else md.self_paged:
            k, v = kv_cache[0], kv_cache[1]
            table = md.cross_page_tables if cross else md.page_tables
        else:
            slots = md.cross_slots if cross else md.self_slots
            flat = kv_cache.flatten(1, 2)  # [2, num_blocks * block_size, H_kv, D]
            k, v = flat[0].index_select(0, slots), flat[1].index_select(0, slots)
            table = None
        return call(query, k, v, cu_q=md.cu_q, max_q=md.max_query_len, cu_k=cu_k, max_k=max_k, seqused_k=lens,
                    block_table=table, scale=self.scale, causal=not cross)


class FlashAttnBackend(AttentionBackend):
    name = "flash_attn"
    priority = 40
    capabilities = BackendCapabilities(
        devices=("cuda",),
        dtypes=(torch.float16, torch.bfloat16),
        block_sizes=SizeRule(note="read in place with FA4 (any, but head sizes not a multiple of 16 only at "
                             f"its key tile) and FA2 / torch (multiples of {FA2_PAGE_MULTIPLE}), gathered "
                             "per step otherwise"),
        head_sizes=SizeRule(multiple_of=HEAD_ALIGN, max=MAX_HEAD_SIZE,
                            note="FA4 on sm100: 8..128 and 256, else the next source"),
        requires=("flash-attn-4 (sm90/sm100)", "or flash-attn (sm80+)", "or torch's varlen_attn (sm80+)"),
        notes="kernel chosen in that order; float32 is not served (FlashAttention is 16-bit only)",
        no_fp8_kv_reason="FlashAttention's paged kernels take K/V in the query's dtype (float16/bfloat16) and "
        "have no per-tensor fp8 descaling here; use attention_backend='triton' for an fp8 cache on GPU",
    )

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return FlashAttnImpl

    @staticmethod
    def get_metadata_builder_cls() -> type[AttentionMetadataBuilder]:
        return FlashAttnMetadataBuilder

    @classmethod
    def extra_unsupported_reasons(cls, device, dtype, head_size, attn_types, block_size,
                                  kv_cache_dtype) -> list[str]:
        if device.type != "cuda":
            return []  # the device's own reason says it
        cap = _capability(device)
        if cap is not None and cap < (8, 0):
            return [f"GPU compute capability {cap[0]}.{cap[1]} is below 8.0 (Ampere), "
                    "the oldest FlashAttention supports"]
        problems = kernel_problems(device, head_size)
        if all(problems.values()):
            return [f"no FlashAttention kernel can serve head size {head_size} here: "
                    + "; ".join(f"{name}: {why}" for name, why in problems.items())]
        return []
