"""flash_attn backend: FlashAttention's varlen kernels, one call per attention kind.

Three kernel sources, the first that loads wins (``KERNELS``):

- ``fa4``: FlashAttention-4, ``flash_attn.cute.flash_attn_varlen_func`` (the
  ``flash-attn-4`` wheel, CuTe DSL), Hopper (sm90) and Blackwell (sm100). Reads
  the paged cache in place through ``page_table`` with ``seqused_k``; any page
  size (page size 128 = its key tile takes the TMA fast path, others its
  generic paged loader).
- ``fa2``: FlashAttention-2, ``flash_attn.flash_attn_varlen_func`` (the
  ``flash-attn`` package), Ampere or newer (sm80+). Its ``block_table`` path
  needs a page size divisible by 256 ("Paged KV cache block size must be
  divisible by 256", ``mha_varlen_fwd`` in csrc/flash_attn/flash_api.cpp);
  with other block sizes the step's K/V are gathered into packed runs.
- ``torch``: PyTorch's own FlashAttention-2 build,
  ``torch.nn.attention.varlen.varlen_attn`` (sm80+). Its ``block_table`` path
  goes through the same ``mha_varlen_fwd`` (aten/src/ATen/native/transformers/
  cuda/flash_attn/flash_api.cpp): page size divisible by 256, else gathered.

All three: float16 / bfloat16 only, head size a multiple of 8 up to 256, GQA
native (``enable_gqa`` for torch), causal masks aligned bottom-right when the
query run is shorter than the key run (FA2 since 2.1; FA4; torch's build
enables causal as window (-1, 0), which is the same alignment) -- exactly
decoder self-attention after cached tokens.

The cache layout is the default ``[2, num_blocks, block_size, H_kv, D]``:
``kv_cache[0]`` / ``kv_cache[1]`` are FlashAttention's paged
``[num_blocks, page_size, H_kv, D]`` key and value caches as they are.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
from dataclasses import dataclass

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
from tandem.core.kv.cache_ops import packed_slots

logger = logging.getLogger(__name__)

MAX_HEAD_SIZE = 256
HEAD_ALIGN = 8  # 16 bytes of a 16-bit dtype: what every FlashAttention build asks of the head dim
FA2_PAGE_MULTIPLE = 256  # mha_varlen_fwd's rule for block_table, in flash-attn 2 and in torch's build


# -- the kernels, each behind the library's own call (tests replace the library
# functions with references of the same contract) --------------------------


def _fa4(q, k, v, *, cu_q, max_q, cu_k, max_k, seqused_k, block_table, scale, causal):
    from flash_attn.cute import flash_attn_varlen_func

    if block_table is not None:  # page_table and cu_seqlens_k are exclusive: lengths come from seqused_k
        out = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=None, max_seqlen_q=max_q,
                                     seqused_k=seqused_k, page_table=block_table, softmax_scale=scale,
                                     causal=causal)
    else:
        out = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q,
                                     max_seqlen_k=max_k, softmax_scale=scale, causal=causal)
    return out[0] if isinstance(out, tuple) else out


def _fa2(q, k, v, *, cu_q, max_q, cu_k, max_k, seqused_k, block_table, scale, causal):
    from flash_attn import flash_attn_varlen_func

    # Paged or not, FA2 takes each sequence's key count from cu_seqlens_k.
    return flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=scale, causal=causal,
                                  block_table=block_table)


def _torch(q, k, v, *, cu_q, max_q, cu_k, max_k, seqused_k, block_table, scale, causal):
    from torch.nn.attention.varlen import varlen_attn

    gqa = q.shape[1] != k.shape[-2]
    return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=(-1, 0) if causal else (-1, -1),
                       enable_gqa=gqa, seqused_k=seqused_k if block_table is not None else None,
                       block_table=block_table)


@dataclass(frozen=True)
class Kernel:
    name: str
    module: str  # what must import for it to be there
    call: str  # the adapter's name in this module
    any_page_size: bool  # reads the paged cache in place at any block size
    min_capability: tuple[int, int]
    max_major: int | None  # highest compute-capability major it builds for
    install: str


KERNELS = (
    Kernel("fa4", "flash_attn.cute", "_fa4", True, (9, 0), 10, "pip install flash-attn-4"),
    Kernel("fa2", "flash_attn", "_fa2", False, (8, 0), None, "pip install flash-attn"),
    Kernel("torch", "torch.nn.attention.varlen", "_torch", False, (8, 0), None, "torch >= 2.10 with CUDA"),
)


# Installed distributions stand for the kernel packages: asking importlib for
# ``flash_attn.cute`` would import ``flash_attn`` (CUDA libraries and all) just
# to answer a capability check.
_DISTRIBUTIONS = {"flash_attn.cute": "flash-attn-4", "flash_attn": "flash-attn"}


def _importable(module: str) -> bool:
    dist = _DISTRIBUTIONS.get(module)
    if dist is not None:
        try:
            importlib.metadata.distribution(dist)
            return True
        except importlib.metadata.PackageNotFoundError:
            return False
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that is missing or broken
        return False


def _capability(device: torch.device) -> tuple[int, int] | None:
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(device)


def pick_kernel(device: torch.device) -> Kernel | None:
    """The first kernel in ``KERNELS`` that imports and builds for ``device``'s GPU
    (when the GPU can't be asked, e.g. no CUDA here, only the import decides)."""
    cap = _capability(device)
    for kernel in KERNELS:
        if not _importable(kernel.module):
            continue
        if cap is not None and (cap < kernel.min_capability or
                                (kernel.max_major is not None and cap[0] > kernel.max_major)):
            continue
        return kernel
    return None


def pages_in_place(kernel: Kernel, block_size: int) -> bool:
    """Whether ``kernel`` reads the paged cache in place at this block size (else the
    step's K/V are gathered into packed runs first)."""
    return kernel.any_page_size or block_size % FA2_PAGE_MULTIPLE == 0


@dataclass
class FlashAttnMetadata(AttentionMetadata):
    kernel: Kernel
    paged: bool  # read the cache through block tables; else gather into packed runs
    cu_q: torch.Tensor  # [S + 1] int32
    # Decoder self-attention keys (cached + new) and cross-attention keys, per sequence.
    self_lens: torch.Tensor  # [S] int32
    cu_self: torch.Tensor  # [S + 1] int32
    cross_lens: torch.Tensor
    cu_cross: torch.Tensor
    page_tables: torch.Tensor | None  # [S, max_blocks] int32 block tables when paged
    cross_page_tables: torch.Tensor | None
    self_slots: torch.Tensor | None  # [sum(self_lens)] cache slots to gather when not paged
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
        self.kernel = pick_kernel(torch.device(device))
        if self.kernel is None:
            raise RuntimeError("flash_attn: no FlashAttention kernel is available (see unsupported_reasons)")
        self.paged = pages_in_place(self.kernel, block_size)
        logger.info("flash_attn backend: %s kernel, %s", self.kernel.name,
                    "paged cache read in place" if self.paged else
                    f"K/V gathered per step (block size {block_size} is not a multiple of {FA2_PAGE_MULTIPLE})")

    def build(self, inputs) -> FlashAttnMetadata:
        dev = self.device
        seq_lens = torch.tensor(inputs.seq_lens, dtype=torch.int32)
        cross_lens = torch.tensor(inputs.cross_seq_lens, dtype=torch.int32)
        if self.paged:
            tables = inputs.block_tables.to(torch.int32)
            cross_tables = inputs.cross_block_tables.to(torch.int32)
            self_slots = cross_slots = None
        else:
            tables = cross_tables = None
            self_slots = packed_slots(inputs.block_tables, seq_lens.long(), self.block_size)
            cross_slots = packed_slots(inputs.cross_block_tables, cross_lens.long(), self.block_size)
        return FlashAttnMetadata.from_inputs(
            inputs,
            kernel=self.kernel,
            paged=self.paged,
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
        call = globals()[md.kernel.call]
        if attn_type is AttentionType.ENCODER:
            return call(query, key, value, cu_q=md.cu_encoder, max_q=md.max_encoder_seq_len, cu_k=md.cu_encoder,
                        max_k=md.max_encoder_seq_len, seqused_k=None, block_table=None, scale=self.scale,
                        causal=False)
        cross = attn_type is AttentionType.ENCODER_DECODER
        lens, cu_k, max_k = (md.cross_lens, md.cu_cross, md.max_cross_seq_len) if cross else \
            (md.self_lens, md.cu_self, md.max_seq_len)
        if md.paged:
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
        block_sizes=SizeRule(note=f"read in place with FA4 (any) and FA2 / torch (multiples of "
                             f"{FA2_PAGE_MULTIPLE}), gathered per step otherwise"),
        head_sizes=SizeRule(multiple_of=HEAD_ALIGN, max=MAX_HEAD_SIZE),
        requires=("flash-attn-4 (sm90/sm100)", "or flash-attn (sm80+)", "or torch's varlen_attn (sm80+)"),
        notes="kernel chosen in that order; float32 is not served (FlashAttention is 16-bit only)",
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
        reasons = []
        cap = _capability(device)
        if cap is not None and cap < (8, 0):
            reasons.append(f"GPU compute capability {cap[0]}.{cap[1]} is below 8.0 (Ampere), "
                           "the oldest FlashAttention supports")
        if pick_kernel(device) is None and (cap is None or cap >= (8, 0)):
            reasons.append("no FlashAttention kernel is installed: "
                           + "; ".join(f"{k.name}: {k.install}" for k in KERNELS))
        return reasons
