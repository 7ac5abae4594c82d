"""Abstract attention-backend interfaces.

A backend is a small bundle: an ``AttentionImpl`` that computes attention, a
typed ``AttentionMetadata`` dataclass, and the builder that packs the model
runner's per-step tensors into that metadata. Models never branch on which
backend is active; they only call the :class:`tandem.core.layers.Attention`
layer.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from tandem.core.kv.cache_ops import write_to_paged_cache


class AttentionType(str, enum.Enum):
    """Which of the three attention kinds a layer computes."""

    DECODER = "decoder"  # causal self-attention over the decoder, self KV table
    ENCODER = "encoder"  # non-causal self-attention over the encoder, no cache
    ENCODER_DECODER = "encoder_decoder"  # decoder queries over the cross KV table


@dataclass
class AttentionMetadata:
    """Fields every backend's metadata carries.

    Decoder tokens are packed without padding: ``num_decoder_tokens`` rows, one
    run per decoder sequence. Encoder tokens (only for groups whose encoder runs
    this step) are packed the same way.
    """

    num_decoder_tokens: int
    # [num_decoder_tokens] flat slot of each new decoder token in the self table
    slot_mapping: torch.Tensor
    # [num_encoder_tokens] flat slot of each encoder token in the cross table
    cross_slot_mapping: torch.Tensor
    num_encoder_tokens: int


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape of the decoder's KV cache: one tensor per decoder layer."""

    num_layers: int
    num_kv_heads: int
    head_size: int


@dataclass
class StepInputs:
    """One step's inputs, before a backend packs them into its metadata.

    Decoder sequences are packed without padding, ``S`` of them, ``T`` tokens.
    ``E`` encoder tokens belong to the ``G`` groups whose encoder runs now.
    """

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T]
    query_lens: list[int]  # [S] new tokens per sequence
    seq_lens: list[int]  # [S] cached + new tokens per sequence
    query_start_loc: torch.Tensor  # [S + 1]
    block_tables: torch.Tensor  # [S, max_blocks], padded with block 0
    # [E] token ids; for models whose encoder inputs are features, the G groups'
    # features stacked ([G, ...], float), or a list of them when their shapes differ
    encoder_input_ids: torch.Tensor | list[torch.Tensor]
    encoder_positions: torch.Tensor  # [E]: E counts encoder positions (use this for sizes)
    encoder_seq_lens: list[int]  # [G]
    cross_slot_mapping: torch.Tensor  # [E]
    cross_seq_lens: list[int]  # [S] encoder length seen by each decoder sequence
    cross_block_tables: torch.Tensor  # [S, max_cross_blocks]
    logits_indices: torch.Tensor  # [S] last token of each sequence in the packed batch


class AttentionMetadataBuilder(ABC):
    """Packs one step's inputs into a backend's own metadata dataclass."""

    def __init__(self, block_size: int, device: torch.device, kv_spec: KVCacheSpec) -> None:
        self.block_size = block_size
        self.device = device
        self.kv_spec = kv_spec

    @abstractmethod
    def build(self, inputs: StepInputs) -> AttentionMetadata: ...


class AttentionImpl(ABC):
    """Computes attention for one layer, and owns writing that layer's new K/V.

    ``forward`` receives queries ``[num_tokens, num_heads, head_size]`` and the
    new keys/values ``[num_kv_tokens, num_kv_heads, head_size]`` (for
    ``ENCODER_DECODER``, ``None`` on steps where no encoder ran: the cache is
    then the only source). It must write the new K/V into ``kv_cache`` (the
    layer's cache, in the backend's own layout; ``None`` for ``ENCODER``, which
    has no cache) before it reads the cache, and return
    ``[num_tokens, num_heads, head_size]``. :meth:`write_new_kv` does the write
    in one line; it stores through :meth:`write_kv_cache`, which serves the
    default layout and is what a backend with its own layout overrides.
    """

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int) -> None:
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads

    def write_kv_cache(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """Put ``key``/``value`` rows at flat slots ``block * block_size + offset``.
        The default serves the default layout; a backend with its own overrides it."""
        write_to_paged_cache(key, value, kv_cache, slot_mapping)

    def write_new_kv(
        self,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor | None,
        attn_metadata: AttentionMetadata,
        attn_type: AttentionType,
    ) -> None:
        """The write every ``forward`` starts with: decoder K/V at ``slot_mapping``,
        encoder K/V (when the encoder ran) at ``cross_slot_mapping``, nothing for
        encoder self-attention."""
        if attn_type is AttentionType.DECODER:
            self.write_kv_cache(key, value, kv_cache, attn_metadata.slot_mapping)
        elif attn_type is AttentionType.ENCODER_DECODER and key is not None:
            self.write_kv_cache(key, value, kv_cache, attn_metadata.cross_slot_mapping)

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor | None,
        attn_metadata: AttentionMetadata,
        attn_type: AttentionType,
    ) -> torch.Tensor: ...


@dataclass(frozen=True)
class BackendCapabilities:
    """What a backend serves, as ``tandem plugins`` and docs/backends.md show it.

    Descriptive only: :meth:`AttentionBackend.unsupported_reasons` decides.
    """

    devices: tuple[str, ...]  # torch device types, e.g. ("cuda",)
    dtypes: tuple[torch.dtype, ...]  # model (and KV-cache) dtypes
    attn_types: frozenset[AttentionType] = frozenset(AttentionType)
    block_sizes: str = "any >= 1"  # KV-cache block sizes, in words
    head_sizes: str = "any"
    requires: tuple[str, ...] = ()  # pip packages the kernels need
    notes: str = ""

    def describe(self) -> dict[str, str]:
        """Each field as one line of text."""
        return {
            "devices": ", ".join(self.devices),
            "dtypes": ", ".join(str(d).removeprefix("torch.") for d in self.dtypes),
            "attention": ", ".join(t.value for t in AttentionType if t in self.attn_types),
            "block sizes": self.block_sizes,
            "head sizes": self.head_sizes,
            "requires": ", ".join(self.requires) or "nothing beyond torch",
            **({"notes": self.notes} if self.notes else {}),
        }


class AttentionBackend(ABC):
    """A named attention implementation the engine can select."""

    name: ClassVar[str]
    # When nothing is asked for, the highest-priority backend that can serve the
    # model is chosen (ties by name). torch_sdpa, which runs everywhere, is 10;
    # faster specialised backends sit above it.
    priority: ClassVar[int] = 0
    # What it serves, in words (``tandem plugins``); None: not described.
    capabilities: ClassVar[BackendCapabilities | None] = None

    @classmethod
    def auto_priority(cls, device: torch.device, dtype: torch.dtype) -> int | None:
        """Its priority in the automatic choice on ``device``/``dtype``; ``None`` keeps
        it out of the automatic choice there (it still serves when asked for by
        name, e.g. Triton's interpreter on CPU: right, but for testing only)."""
        return cls.priority

    @staticmethod
    @abstractmethod
    def get_impl_cls() -> type[AttentionImpl]: ...

    @staticmethod
    @abstractmethod
    def get_metadata_builder_cls() -> type[AttentionMetadataBuilder]: ...

    # -- the KV cache: this backend's own layout and the ops that move its blocks.
    # The defaults serve any layout whose block index is ``kv_cache_block_dim``;
    # override them for a layout that is not (or for faster kernels).

    # Which dimension of ``get_kv_cache_shape`` indexes blocks.
    kv_cache_block_dim: ClassVar[int] = 1

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        """One layer's cache; the default is ``[2, num_blocks, block_size, H, D]``."""
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @classmethod
    def kv_cache_block_bytes(cls, block_size: int, num_kv_heads: int, head_size: int, dtype: torch.dtype) -> int:
        """Bytes one block takes in one layer's cache, from this backend's own shape."""
        numel = 1
        for n in cls.get_kv_cache_shape(1, block_size, num_kv_heads, head_size):
            numel *= n
        return numel * torch.empty((), dtype=dtype).element_size()

    @classmethod
    def allocate_kv_cache(
        cls,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        zeroed: bool = True,
    ) -> torch.Tensor:
        """One layer's cache. ``zeroed=False`` leaves memory uncommitted until written
        (the host swap pool: only blocks that were swapped out are ever read back)."""
        shape = cls.get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)
        make = torch.zeros if zeroed else torch.empty
        return make(shape, dtype=dtype, device=device)

    @classmethod
    def swap_blocks(cls, src: torch.Tensor, dst: torch.Tensor, src_ids: torch.Tensor, dst_ids: torch.Tensor) -> None:
        """Copy blocks ``src_ids`` of one layer's cache ``src`` into blocks ``dst_ids``
        of ``dst``, which may be on another device (swap out and swap in)."""
        dim = cls.kv_cache_block_dim
        moved = src.index_select(dim, src_ids.to(src.device)).to(dst.device)
        dst.index_copy_(dim, dst_ids.to(dst.device), moved)

    @classmethod
    def copy_blocks(cls, kv_caches: list[torch.Tensor], src_ids: torch.Tensor, dst_ids: torch.Tensor) -> None:
        """Copy-on-write: in every layer, block ``dst_ids[i]`` gets block ``src_ids[i]``'s K/V.
        Reads all sources before writing (a destination may be another pair's source)."""
        dim = cls.kv_cache_block_dim
        for cache in kv_caches:
            cache.index_copy_(dim, dst_ids, cache.index_select(dim, src_ids))

    @classmethod
    @abstractmethod
    def unsupported_reasons(
        cls,
        device: torch.device,
        dtype: torch.dtype,
        head_size: int,
        attn_types: frozenset[AttentionType],
        block_size: int,
        kv_cache_dtype: torch.dtype,
    ) -> list[str]:
        """Why this backend cannot serve the configuration, each reason naming the
        value; empty means it can."""
        ...
