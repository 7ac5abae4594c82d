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
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from tandem.core.kv import fp8
from tandem.core.kv.cache_ops import write_to_paged_cache

if TYPE_CHECKING:
    from typing import Self  # Python 3.11+


class AttentionType(str, enum.Enum):
    """Which of the three attention kinds a layer computes."""

    DECODER = "decoder"  # causal self-attention over the decoder, self KV table
    ENCODER = "encoder"  # non-causal self-attention over the encoder, no cache
    ENCODER_DECODER = "encoder_decoder"  # decoder queries over the cross KV table


@dataclass(kw_only=True)
class AttentionMetadata:
    """Fields every backend's metadata carries: the model runner builds them once per
    step (:class:`StepInputs`); a backend's metadata extends this class with its own
    fields only, and its builder makes it with :meth:`from_inputs`.

    Decoder tokens are packed without padding: ``T = num_decoder_tokens`` rows,
    one run per decoder sequence (``S`` of them). Encoder tokens (only for the
    ``G`` groups whose encoder runs this step) are packed the same way, ``E`` rows.
    """

    num_decoder_tokens: int  # T
    # [T] flat slot of each new decoder token in the self table
    slot_mapping: torch.Tensor
    # [E] flat slot of each encoder token in the cross table
    cross_slot_mapping: torch.Tensor
    num_encoder_tokens: int  # E
    query_start_loc: torch.Tensor  # [S + 1] int64, first packed row of each sequence
    query_lens: list[int]  # [S] new tokens per sequence
    seq_lens: list[int]  # [S] cached + new tokens per sequence
    block_tables: torch.Tensor  # [S, max_blocks] self tables, padded with block 0
    encoder_seq_lens: list[int]  # [G] encoder positions of each group whose encoder runs
    cross_seq_lens: list[int]  # [S] encoder positions each sequence reads
    cross_block_tables: torch.Tensor  # [S, max_cross_blocks]
    max_query_len: int
    max_seq_len: int
    max_encoder_seq_len: int
    max_cross_seq_len: int
    # kv_compress: the step's observer of decoder-to-encoder attention (the Attention
    # layer hands it each cross-attention layer's queries); None: nothing observed.
    cross_observer: Any = None
    # kv_compress per head (the ``cross_kv_compress_per_head`` feature): the sequences
    # whose cross table is compressed per head (``tandem/core/kv/cross_per_head.py``), and
    # for each of them the flat single-head slot range of every (decoder layer, KV head)
    # in its cross table: ``cross_head_offsets[j, l, h]`` the first, ``cross_head_lens[j,
    # l, h]`` (>= 1) how many. Such a sequence's ``cross_seq_lens`` entry is not a length to
    # read: a backend reads it per head (``cross_per_head.head_slots`` and ``attend``) in
    # the layer ``AttentionImpl.layer_index`` names. Empty and None when none is.
    cross_per_head_seqs: list[int] = field(default_factory=list)  # [P] sequence indices
    cross_head_offsets: torch.Tensor | None = None  # [P, num_layers, Hkv] int64
    cross_head_lens: torch.Tensor | None = None  # [P, num_layers, Hkv] int64

    @classmethod
    def from_inputs(cls, inputs: StepInputs, **fields: Any) -> Self:
        """This metadata class with the common fields taken from ``inputs`` (references,
        no copies) and the subclass's own ``fields``."""
        return cls(
            num_decoder_tokens=inputs.input_ids.shape[0],
            slot_mapping=inputs.slot_mapping,
            cross_slot_mapping=inputs.cross_slot_mapping,
            num_encoder_tokens=inputs.encoder_positions.shape[0],
            query_start_loc=inputs.query_start_loc,
            query_lens=inputs.query_lens,
            seq_lens=inputs.seq_lens,
            block_tables=inputs.block_tables,
            encoder_seq_lens=inputs.encoder_seq_lens,
            cross_seq_lens=inputs.cross_seq_lens,
            cross_block_tables=inputs.cross_block_tables,
            max_query_len=inputs.max_query_len,
            max_seq_len=inputs.max_seq_len,
            max_encoder_seq_len=inputs.max_encoder_seq_len,
            max_cross_seq_len=inputs.max_cross_seq_len,
            cross_observer=inputs.cross_observer,
            cross_per_head_seqs=inputs.cross_per_head_seqs,
            cross_head_offsets=inputs.cross_head_offsets,
            cross_head_lens=inputs.cross_head_lens,
            **fields,
        )


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
    # The longest of each: the runner passes them (it has them); None computes them.
    max_query_len: int | None = None
    max_seq_len: int | None = None
    max_encoder_seq_len: int | None = None
    max_cross_seq_len: int | None = None
    cross_observer: Any = None  # kv_compress (tandem.core.worker.cross_compress.CrossObserver)
    # kv_compress per head: as ``AttentionMetadata``'s fields of these names.
    cross_per_head_seqs: list[int] = field(default_factory=list)
    cross_head_offsets: torch.Tensor | None = None
    cross_head_lens: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.max_query_len is None:
            self.max_query_len = max(self.query_lens, default=0)
        if self.max_seq_len is None:
            self.max_seq_len = max(self.seq_lens, default=0)
        if self.max_encoder_seq_len is None:
            self.max_encoder_seq_len = max(self.encoder_seq_lens, default=0)
        if self.max_cross_seq_len is None:
            self.max_cross_seq_len = max(self.cross_seq_lens, default=0)


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

    A backend that declares the ``"relative_position_bias"`` feature also takes a
    ``position_bias`` keyword (:class:`tandem.core.relative_position.RelativePositionBias`)
    for self-attention layers, and adds its ``bias(query_pos, key_pos)`` to the scores.
    """

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int) -> None:
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        # An ENCODER_DECODER layer's decoder layer index (its cache's index), which the
        # worker sets where kv_compress reads cross tables per head
        # (``AttentionMetadata.cross_head_offsets``); None elsewhere.
        self.layer_index: int | None = None
        # An fp8 cache's per-tensor k_scale / v_scale for what this impl writes and reads
        # (``tandem/core/kv/fp8.py``); unused by a cache in the model's dtype.
        self.kv_scales = fp8.KVScales()

    def write_kv_cache(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """Put ``key``/``value`` rows at flat slots ``block * block_size + offset``
        (an fp8 cache: quantized with :attr:`kv_scales`, calibrated on the first write).
        The default serves the default layout; a backend with its own overrides it."""
        if fp8.is_fp8(kv_cache.dtype):
            fp8.write_fp8(key, value, kv_cache, slot_mapping, self.kv_scales)
        else:
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


def _dtype_name(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


def _one_of(items: Iterable[str]) -> str:
    """``a``, ``a or b``, ``a, b or c``."""
    items = list(items)
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " or " + items[-1]


def _plural(noun: str, names: list[str]) -> str:
    """``kind x is`` / ``kinds x, y are``."""
    return f"{noun} {names[0]} is" if len(names) == 1 else f"{noun}s {', '.join(names)} are"


@dataclass(frozen=True)
class SizeRule:
    """Which sizes (head sizes, KV block sizes) a backend takes: exactly ``values``
    when given, else ``min``..``max`` (``max`` None: unbounded) in multiples of
    ``multiple_of``. ``note`` is free text shown after the rule (``tandem plugins``)."""

    min: int = 1
    max: int | None = None
    multiple_of: int = 1
    values: frozenset[int] = frozenset()
    note: str = ""

    def __contains__(self, n: int) -> bool:
        if self.values:
            return n in self.values
        return self.min <= n and (self.max is None or n <= self.max) and n % self.multiple_of == 0

    def _lowest(self) -> int:
        m = self.multiple_of
        return -(-self.min // m) * m if m > 1 else self.min

    def rule(self) -> str:
        """The rule as the end of "head size 12 is not ...": ``a multiple of 8 in 8..256``."""
        if self.values:
            return "one of " + ", ".join(map(str, sorted(self.values)))
        lo, hi, m = self._lowest(), self.max, self.multiple_of
        if m > 1:
            if hi is not None:
                return f"a multiple of {m} in {lo}..{hi}"
            return f"a multiple of {m}" + (f" >= {lo}" if lo != m else "")
        return f"in {lo}..{hi}" if hi is not None else f">= {lo}"

    def describe(self) -> str:
        """The rule in words, for listings: ``multiples of 8 up to 256``."""
        lo, hi, m = self._lowest(), self.max, self.multiple_of
        if self.values:
            text = ", ".join(map(str, sorted(self.values)))
        elif m > 1:
            text = f"multiples of {m}" if lo == m else f"multiples of {m} from {lo}"
            text += f" up to {hi}" if hi is not None else ""
        elif hi is not None:
            text = f"any up to {hi}" if lo <= 1 else f"{lo}..{hi}"
        else:
            text = f"any >= {lo}"
        return f"{text} ({self.note})" if self.note else text


def _size_rule(value: SizeRule | Iterable[int] | str) -> SizeRule | str:
    if isinstance(value, (SizeRule, str)):
        return value
    return SizeRule(values=frozenset(value))


@dataclass(frozen=True)
class BackendCapabilities:
    """What a backend serves. A backend declares it as its ``capabilities`` class
    attribute; :meth:`AttentionBackend.unsupported_reasons` checks a configuration
    against it (:meth:`unsupported_reasons`) and ``tandem plugins`` lists it
    (:meth:`describe`).

    ``block_sizes`` / ``head_sizes`` take a :class:`SizeRule` or a collection of
    sizes; a string there is a description only, not checked (how capabilities
    were declared before the check read them).
    """

    devices: tuple[str, ...]  # torch device types, e.g. ("cuda",)
    dtypes: tuple[torch.dtype, ...]  # model dtypes
    attn_types: frozenset[AttentionType] = frozenset(AttentionType)
    block_sizes: SizeRule | Iterable[int] | str = SizeRule()  # KV-cache block sizes
    head_sizes: SizeRule | Iterable[int] | str = SizeRule()
    requires: tuple[str, ...] = ()  # pip packages the kernels need
    notes: str = ""
    # KV-cache dtypes; None: the model's dtype only.
    kv_cache_dtypes: tuple[torch.dtype, ...] | None = None
    # fp8 KV-cache dtypes (kv_cache_dtype fp8, fp8_e4m3, fp8_e5m2) served with any model dtype:
    # the impl writes through ``AttentionImpl.write_kv_cache`` and reads fp8 * its kv_scales.
    fp8_kv_dtypes: tuple[torch.dtype, ...] = ()
    # Why an fp8 cache is not served, where ``fp8_kv_dtypes`` leaves it out.
    no_fp8_kv_reason: str = "its kernels read the KV cache in the model's dtype only"
    # Attention features beyond scaled dot-product attention over the three kinds,
    # by name, e.g. "relative_position_bias" (T5); a model asks for those it needs.
    attn_features: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        object.__setattr__(self, "block_sizes", _size_rule(self.block_sizes))
        object.__setattr__(self, "head_sizes", _size_rule(self.head_sizes))
        object.__setattr__(self, "attn_features", frozenset(self.attn_features))

    def unsupported_reasons(
        self,
        device: torch.device,
        dtype: torch.dtype,
        head_size: int,
        attn_types: frozenset[AttentionType],
        block_size: int,
        kv_cache_dtype: torch.dtype,
        attn_features: frozenset[str] = frozenset(),
    ) -> list[str]:
        """One reason per value outside these capabilities, naming the value and what
        is supported; empty when all are inside."""
        reasons = []
        if device.type not in self.devices:
            reasons.append(f"device {device.type!r} is not {_one_of(self.devices)}")
        if dtype not in self.dtypes:
            reasons.append(f"dtype {dtype} is not {_one_of(map(_dtype_name, self.dtypes))}")
        if fp8.is_fp8(kv_cache_dtype):
            if kv_cache_dtype not in self.fp8_kv_dtypes and kv_cache_dtype not in (self.kv_cache_dtypes or ()):
                served = (f" (it serves {_one_of(map(_dtype_name, self.fp8_kv_dtypes))})"
                          if self.fp8_kv_dtypes else "")
                reasons.append(f"an fp8 KV cache ({_dtype_name(kv_cache_dtype)}) is not served{served}: "
                               f"{self.no_fp8_kv_reason}")
        elif self.kv_cache_dtypes is not None:
            if kv_cache_dtype not in self.kv_cache_dtypes:
                reasons.append(f"KV-cache dtype {kv_cache_dtype} is not "
                               f"{_one_of(map(_dtype_name, self.kv_cache_dtypes))}")
        elif kv_cache_dtype != dtype:  # (equal to an unsupported dtype: the dtype's reason says it)
            if kv_cache_dtype not in self.dtypes:
                reasons.append(f"KV-cache dtype {kv_cache_dtype} is not {_one_of(map(_dtype_name, self.dtypes))}")
            else:
                reasons.append(f"KV-cache dtype {kv_cache_dtype} differs from the model dtype {dtype}")
        if isinstance(self.head_sizes, SizeRule) and head_size not in self.head_sizes:
            reasons.append(f"head size {head_size} is not {self.head_sizes.rule()}")
        if isinstance(self.block_sizes, SizeRule) and block_size not in self.block_sizes:
            reasons.append(f"block_size {block_size} is not {self.block_sizes.rule()}")
        missing = [t.value for t in AttentionType if t in attn_types and t not in self.attn_types]
        if missing:
            served = [t.value for t in AttentionType if t in self.attn_types]
            reasons.append(f"attention {_plural('kind', missing)} not served (it serves "
                           f"{', '.join(served) or 'none'})")
        return reasons + self.feature_reasons(attn_features)

    def feature_reasons(self, attn_features: Iterable[str]) -> list[str]:
        """One reason naming the ``attn_features`` not declared here; empty when all are."""
        features = sorted(set(attn_features) - self.attn_features)
        if not features:
            return []
        return [f"attention {_plural('feature', features)} not served (it serves "
                f"{', '.join(sorted(self.attn_features)) or 'none'})"]

    def describe(self) -> dict[str, str]:
        """Each field as one line of text."""

        def sizes(rule: SizeRule | str) -> str:
            return rule.describe() if isinstance(rule, SizeRule) else rule

        kv = "the model's dtype" if self.kv_cache_dtypes is None else ", ".join(map(_dtype_name, self.kv_cache_dtypes))
        if self.fp8_kv_dtypes:
            kv += ", " + ", ".join(map(_dtype_name, self.fp8_kv_dtypes)) + " (kv_cache_dtype fp8, per-tensor scales)"
        return {
            "devices": ", ".join(self.devices),
            "dtypes": ", ".join(map(_dtype_name, self.dtypes)),
            "kv dtypes": kv,
            "attention": ", ".join(t.value for t in AttentionType if t in self.attn_types),
            **({"features": ", ".join(sorted(self.attn_features))} if self.attn_features else {}),
            "block sizes": sizes(self.block_sizes),
            "head sizes": sizes(self.head_sizes),
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
    # What it serves: the default ``unsupported_reasons`` checks it, ``tandem plugins``
    # lists it. None: the backend overrides ``unsupported_reasons`` itself.
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
        src, dst = fp8.raw(src), fp8.raw(dst)  # fp8 blocks move as bytes (no float8 index_copy_ on CPU)
        moved = src.index_select(dim, src_ids.to(src.device)).to(dst.device)
        dst.index_copy_(dim, dst_ids.to(dst.device), moved)

    @classmethod
    def copy_blocks(cls, kv_caches: list[torch.Tensor], src_ids: torch.Tensor, dst_ids: torch.Tensor) -> None:
        """Copy-on-write: in every layer, block ``dst_ids[i]`` gets block ``src_ids[i]``'s K/V.
        Reads all sources before writing (a destination may be another pair's source)."""
        dim = cls.kv_cache_block_dim
        for cache in kv_caches:
            cache = fp8.raw(cache)  # fp8 blocks move as bytes
            cache.index_copy_(dim, dst_ids, cache.index_select(dim, src_ids))

    @classmethod
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
        value and what is supported; empty means it can. The default checks
        ``capabilities``, then adds :meth:`extra_unsupported_reasons`."""
        if cls.capabilities is None:
            return [f"{cls.__qualname__} declares no capabilities (set its `capabilities` "
                    "or override unsupported_reasons)"]
        reasons = cls.capabilities.unsupported_reasons(device, dtype, head_size, attn_types, block_size,
                                                       kv_cache_dtype)
        return reasons + cls.extra_unsupported_reasons(device, dtype, head_size, attn_types, block_size,
                                                       kv_cache_dtype)

    @classmethod
    def feature_reasons(cls, attn_features: frozenset[str]) -> list[str]:
        """Why this backend cannot serve a model that needs ``attn_features`` (e.g.
        ``"relative_position_bias"``): one reason naming those it does not declare in
        ``capabilities.attn_features``. Asked apart from :meth:`unsupported_reasons`, so
        backends that override that keep their signature; the registry asks both."""
        if not attn_features:
            return []
        served = cls.capabilities.attn_features if cls.capabilities is not None else frozenset()
        return BackendCapabilities(devices=(), dtypes=(), attn_features=served).feature_reasons(attn_features)

    @classmethod
    def extra_unsupported_reasons(
        cls,
        device: torch.device,
        dtype: torch.dtype,
        head_size: int,
        attn_types: frozenset[AttentionType],
        block_size: int,
        kv_cache_dtype: torch.dtype,
    ) -> list[str]:
        """Reasons ``capabilities`` cannot state (a library that is not installed, a
        GPU too old, a rule joining two values); none by default."""
        return []
