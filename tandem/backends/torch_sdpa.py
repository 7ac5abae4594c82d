"""Reference backend on ``torch.nn.functional.scaled_dot_product_attention``.

Runs on CPU and CUDA. Sequences with several new tokens (prefills) run one
SDPA call each over 4-D views; single-token sequences (decodes) run batched,
their keys gathered from the paged cache and padded under a length mask.
On a CPU with avx512_bf16, bfloat16 encoder runs without a bias take tandem's
flash op instead (``tandem/backends/cpu_flash``; ``cpu_paged`` shares this path).

An fp8 cache (``kv_cache_dtype="fp8"``, ``tandem/core/kv/fp8.py``) is read by
dequantizing what each SDPA call reads (a sequence's cross view, its gathered blocks,
the decode batch's gathered blocks) into the query's dtype: one more pass and
a temporary of that size per layer, on top of the gathers (cpu_paged's decodes
convert in their inner loop instead).

Serves the ``"relative_position_bias"`` feature (T5): the bias of each encoder run,
prefill and the decode batch becomes SDPA's additive mask, computed from positions
once per stack (:meth:`RelativePositionBias.memo`) and read by every layer.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tandem.backends.cpu_flash import encoder as bf16_flash
from tandem.backends.sdpa_groups import RunPlan, attend_runs, can_group, plan_runs
from tandem.core.attention import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadata,
    AttentionMetadataBuilder,
    AttentionType,
    BackendCapabilities,
)
from tandem.core.kv import cross_per_head, fp8
from tandem.core.kv.cache_ops import GatherWorkspace, gather_from_paged_cache
from tandem.core.relative_position import FEATURE as RELATIVE_POSITION_BIAS
from tandem.core.kv_compress_config import FEATURE as CROSS_KV_COMPRESS
from tandem.core.kv_compress_config import PER_HEAD_FEATURE as CROSS_KV_COMPRESS_PER_HEAD
from tandem.core.relative_position import RelativePositionBias


@dataclass
class SDPAMetadata(AttentionMetadata):
    """What the SDPA paths for encoders and prefills read, and which sequences decode.
    Backends that keep these paths and replace only the decode path extend it."""

    # Decoder sequences with more than one new token: (row start, q_len, seq_len, index).
    prefills: list[tuple[int, int, int, int]]
    # Cross K/V of a sequence whose cross table is one contiguous run of blocks
    # is read through a view of the cache instead of a gather: the first slot
    # (or -1) of every sequence (filled only on steps with prefills).
    cross_view_start: list[int]
    # Encoder runs this step: (row start, length).
    encoder_runs: list[tuple[int, int]]
    # Decoder sequences with exactly one new token.
    decode_rows: torch.Tensor  # [D] packed row of each decode token
    decode_seqs: torch.Tensor  # [D] sequence index
    num_decodes: int
    workspace: GatherWorkspace  # the builder's, reused by every layer and step
    # kv_compress per head: sequence index -> its row in ``cross_head_offsets``/``lens``, and
    # the (query row, that row) of decodes whose cross table is read per head (the
    # backend's own cross decode path passes them over).
    cross_head_index: dict[int, int]
    cross_head_decodes: list[tuple[int, int]]
    # This step's sdpa_groups plans, made by the first layer that needs one and read by
    # the rest (they depend only on the runs, which every layer of a stack shares).
    run_plans: dict[tuple, RunPlan]
    # This step's prefills split by ``_prefills_grouped`` (is_cross -> the runs it attends
    # grouped, the prefills left to its per-sequence loop), found by the first layer.
    prefill_split: dict[bool, tuple[list[tuple[int, int, int, int]], list[tuple[int, int, int, int]]]]

    def run_plan(self, kind: tuple, runs, query: torch.Tensor, key: torch.Tensor, causal: bool) -> RunPlan:
        """The plan of ``runs`` for this step (see ``run_plans``); ``kind`` names the runs."""
        per_key = key.shape[1] * key.shape[2]
        plan = self.run_plans.get((kind, per_key))
        if plan is None:
            plan = self.run_plans[(kind, per_key)] = plan_runs(
                runs, num_queries=query.shape[0], per_key=per_key, max_gather=VIEW_MIN_CROSS_ELEMENTS,
                causal=causal, device=query.device)
        return plan


@dataclass
class TorchSDPAMetadata(SDPAMetadata):
    # Decodes run batched over gathered, padded K/V.
    decode_mask: torch.Tensor  # [D, 1, 1, decode_blocks * block_size] self keys to attend
    decode_lens: torch.Tensor  # [D] cached + new tokens of each decoding sequence
    decode_blocks: int  # block-table columns the decodes need (gathers stop there)
    # (query row, first slot, encoder length) of decodes whose cross K/V is read
    # through a view of the cache; the rest gather.
    decode_cross_views: list[tuple[int, int, int]]
    decode_cross_gather: torch.Tensor  # [Dg] positions in the decode batch that gather
    decode_cross_gather_rows: torch.Tensor  # [Dg] their packed query rows
    decode_cross_mask: torch.Tensor  # [Dg, 1, 1, decode_cross_blocks * block_size]
    decode_cross_blocks: int


def _length_mask(lens: torch.Tensor, width: int) -> torch.Tensor:
    return (torch.arange(width, device=lens.device)[None, :] < lens[:, None])[:, None, None, :]


# Below this many cross K elements per sequence (encoder tokens x kv heads x
# head size) a batched gather is cheaper than one SDPA call per sequence (a
# CPU SDPA call costs ~50 us): 64K elements is ~85 tokens of bart-base. Tuned
# on the summarization and translation benchmarks (16K to 256K tried) for
# decodes; encoder runs and prefills gather below it too (sdpa_groups).
VIEW_MIN_CROSS_ELEMENTS = 65536


def contiguous_starts(tables: torch.Tensor, lens: torch.Tensor, block_size: int) -> torch.Tensor:
    """First slot of each row whose blocks are consecutive ids, else -1."""
    width = tables.shape[1]
    n_blocks = (lens + block_size - 1) // block_size
    cols = torch.arange(width, device=tables.device)
    consecutive = (tables == tables[:, :1] + cols) | (cols >= n_blocks[:, None])
    return torch.where(consecutive.all(dim=1), tables[:, 0] * block_size, -1)


class SDPAMetadataBuilderBase(AttentionMetadataBuilder):
    """Splits a step into encoder runs, prefills and decodes (:class:`SDPAMetadata`)."""

    def __init__(self, block_size, device, kv_spec) -> None:
        super().__init__(block_size, device, kv_spec)
        self.workspace = GatherWorkspace()

    def common_fields(self, inputs, view_starts: bool) -> tuple[dict, list[int], list[int]]:
        """The :class:`SDPAMetadata` fields beyond the base ones, the decoding sequences'
        indices and every sequence's first packed row (None in a decode step that neither
        finds views nor reads per head); ``view_starts``: find contiguous cross tables
        for every sequence (else only when a prefill needs them)."""
        prefills, decodes = [], []
        head_index = {i: j for j, i in enumerate(inputs.cross_per_head_seqs)}
        if inputs.max_query_len == 1:  # a decode step: every sequence decodes (no loop per row)
            decodes = list(range(len(inputs.query_lens)))
            # Only the views and kv_compress per head read each sequence's first row.
            starts = inputs.query_start_loc.tolist() if view_starts or head_index else None
        else:
            starts = inputs.query_start_loc.tolist()
            for i, (q, s) in enumerate(zip(inputs.query_lens, inputs.seq_lens)):
                if q == 1:
                    decodes.append(i)
                else:
                    prefills.append((starts[i], q, s, i))
        enc_runs, row = [], 0
        for n in inputs.encoder_seq_lens:
            enc_runs.append((row, n))
            row += n
        view_start = []
        if view_starts or prefills:
            cross_lens = torch.tensor(inputs.cross_seq_lens, dtype=torch.long)
            view_start = contiguous_starts(inputs.cross_block_tables.cpu(), cross_lens, self.block_size).tolist()
        decode_seqs = torch.tensor(decodes, dtype=torch.long, device=self.device)
        fields = dict(
            prefills=prefills,
            cross_view_start=view_start,
            encoder_runs=enc_runs,
            decode_rows=inputs.query_start_loc.index_select(0, decode_seqs),
            decode_seqs=decode_seqs,
            num_decodes=len(decodes),
            workspace=self.workspace,
            cross_head_index=head_index,
            cross_head_decodes=[(starts[i], head_index[i]) for i in decodes if i in head_index] if head_index else [],
            run_plans={},
            prefill_split={},
        )
        return fields, decodes, starts


class TorchSDPAMetadataBuilder(SDPAMetadataBuilderBase):
    def build(self, inputs) -> TorchSDPAMetadata:
        common, decodes, starts = self.common_fields(inputs, view_starts=True)
        view_start = common["cross_view_start"]
        dev, bs = self.device, self.block_size
        seq_lens = torch.tensor(inputs.seq_lens, dtype=torch.long, device=dev)
        cross_lens = torch.tensor(inputs.cross_seq_lens, dtype=torch.long, device=dev)
        views, gather = [], []
        min_tokens = VIEW_MIN_CROSS_ELEMENTS / (self.kv_spec.num_kv_heads * self.kv_spec.head_size)
        per_head = common["cross_head_index"]
        for j, i in enumerate(decodes):
            n = inputs.cross_seq_lens[i]
            if i in per_head:  # read per head (SDPAImplBase.forward)
                continue
            if view_start[i] >= 0 and n >= min_tokens:
                views.append((starts[i], view_start[i], n))
            else:
                gather.append(j)
        gather_t = torch.tensor(gather, dtype=torch.long, device=dev)
        decode_seqs = common["decode_seqs"]
        # Gather only as many block columns as the longest sequence gathered needs.
        decode_blocks = -(-max((inputs.seq_lens[i] for i in decodes), default=0) // bs)
        cross_blocks = -(-max((inputs.cross_seq_lens[decodes[j]] for j in gather), default=0) // bs)
        decode_lens = seq_lens.index_select(0, decode_seqs)
        gather_cross_lens = cross_lens.index_select(0, decode_seqs).index_select(0, gather_t)
        return TorchSDPAMetadata.from_inputs(
            inputs,
            **common,
            decode_mask=_length_mask(decode_lens, decode_blocks * bs),
            decode_lens=decode_lens,
            decode_blocks=decode_blocks,
            decode_cross_views=views,
            decode_cross_gather=gather_t,
            decode_cross_gather_rows=inputs.query_start_loc.index_select(0, decode_seqs.index_select(0, gather_t)),
            decode_cross_mask=_length_mask(gather_cross_lens, cross_blocks * bs),
            decode_cross_blocks=cross_blocks,
        )


def _with_causal(bias: torch.Tensor, query_pos: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
    """``bias`` ``[H, q, k]`` with ``-inf`` where a key comes after its query."""
    return bias.masked_fill(key_pos[None, None, :] > query_pos[None, :, None], float("-inf"))


def _equal_runs(runs: list[tuple[int, int]], num_tokens: int) -> bool:
    """Whether the encoder runs are back to back, of one length, covering all tokens."""
    return bool(runs) and all(start == i * runs[0][1] and n == runs[0][1] for i, (start, n) in enumerate(runs)) \
        and len(runs) * runs[0][1] == num_tokens


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """``[L, H, D] -> [1, H, L, D]`` as a view."""
    return x.transpose(0, 1).unsqueeze(0)


class SDPAImplBase(AttentionImpl):
    """Encoder runs and prefills through SDPA (one call per sequence); decodes are
    left to :meth:`forward_decodes`, which each backend built on this provides."""

    def forward(
        self,
        query: torch.Tensor,  # [T, H, D]
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor | None,  # None for ENCODER
        attn_metadata: SDPAMetadata,
        attn_type: AttentionType,
        position_bias: RelativePositionBias | None = None,
    ) -> torch.Tensor:
        md = attn_metadata
        pb = position_bias
        self.write_new_kv(key, value, kv_cache, md, attn_type)
        if attn_type is AttentionType.DECODER and fp8.is_fp8(kv_cache.dtype) and key.shape[0]:
            # Prefills attend to the new K/V as the cache holds them, as decodes and a cached
            # prefix do: a request's tokens then do not depend on a prefix-cache hit or a
            # recompute (one quantize-dequantize pass over the new tokens).
            s, dt = self.kv_scales, kv_cache.dtype
            key, value = self.dequantized(fp8.quantize(key, s.k_scale, dt), fp8.quantize(value, s.v_scale, dt),
                                          key.dtype)
        gqa = self.num_kv_heads != self.num_heads
        if attn_type is AttentionType.ENCODER and pb is None and not gqa:
            # bfloat16 on an avx512_bf16 CPU: a flash kernel on bf16 dot products (SDPA's CPU
            # kernel runs bf16 at its float32 rate there); None where it does not apply.
            o = bf16_flash.attend(query, key, value, md.encoder_runs, self.scale)
            if o is not None:
                return o
        if attn_type is AttentionType.ENCODER and pb is None and _equal_runs(md.encoder_runs, query.shape[0]):
            return self._encoder_batched(query, key, value, len(md.encoder_runs), gqa)
        out = torch.empty_like(query)
        grouped = pb is None and can_group(query.device)
        if attn_type is AttentionType.ENCODER and grouped:
            runs = [(s, n, s, n) for s, n in md.encoder_runs]
            attend_runs(query, key, value, runs, out, scale=self.scale, causal=False, gqa=gqa,
                        max_gather=VIEW_MIN_CROSS_ELEMENTS, plan=md.run_plan(("encoder",), runs, query, key, False))
            return out
        if attn_type is AttentionType.ENCODER:
            for start, n in md.encoder_runs:
                q, k, v = (_heads_first(t[start : start + n]) for t in (query, key, value))
                mask = None
                if pb is not None:  # positions 0..n-1 on both sides
                    pos = torch.arange(n, device=query.device)
                    mask = pb.memo(("encoder", start), lambda: pb.bias(pos, pos).to(query.dtype)[None])
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=gqa)
                out[start : start + n] = o[0].transpose(0, 1)
            return out

        is_cross = attn_type is AttentionType.ENCODER_DECODER
        tables = md.cross_block_tables if is_cross else md.block_tables
        block_size = kv_cache.shape[2]
        quantized = fp8.is_fp8(kv_cache.dtype)
        prefills = self._prefills_grouped(query, key, value, kv_cache, md, is_cross, gqa, out) if grouped \
            else md.prefills
        for start, q_len, seq_len, i in prefills:
            q = _heads_first(query[start : start + q_len])
            if is_cross and i in md.cross_head_index:
                out[start : start + q_len] = self._per_head(query[start : start + q_len], kv_cache, md,
                                                            md.cross_head_index[i], tables[i])
                continue
            if is_cross:
                first = md.cross_view_start[i]
                if first >= 0:
                    k, v = self._view(kv_cache, first, md.cross_seq_lens[i])
                else:
                    k, v = self._cached(kv_cache, tables[i], md.cross_seq_lens[i], block_size)
                if quantized:
                    k, v = self.dequantized(k, v, query.dtype)
                mask, causal = None, False
            elif seq_len == q_len:
                # Nothing cached before these tokens: top-left causal is bottom-right.
                k, v = key[start : start + q_len], value[start : start + q_len]
                mask, causal = None, True
            else:
                k, v = self._cached(kv_cache, tables[i], seq_len, block_size)
                if quantized:
                    k, v = self.dequantized(k, v, query.dtype)
                # Bottom-right causal: query j sits at position seq_len - q_len + j.
                key_pos = torch.arange(seq_len, device=query.device)
                q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
                mask, causal = key_pos[None, :] <= q_pos[:, None], False
            if pb is not None and not is_cross:  # the bias, -inf above the diagonal, as one float mask
                key_pos = torch.arange(seq_len, device=query.device)
                q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
                mask = pb.memo(("prefill", i), lambda: _with_causal(pb.bias(q_pos, key_pos), q_pos, key_pos)
                               .to(query.dtype)[None])
                causal = False
            o = F.scaled_dot_product_attention(
                q, _heads_first(k), _heads_first(v), attn_mask=mask, is_causal=causal,
                scale=self.scale, enable_gqa=gqa,
            )
            out[start : start + q_len] = o[0].transpose(0, 1)

        if md.num_decodes:
            if pb is not None and not is_cross:
                self.forward_decodes(query, kv_cache, md, is_cross, out, position_bias=pb)
            else:
                self.forward_decodes(query, kv_cache, md, is_cross, out)
        if is_cross:
            for row, j in md.cross_head_decodes:
                out[row : row + 1] = self._per_head(query[row : row + 1], kv_cache, md, j, None)
        return out

    def _prefills_grouped(self, query, key, value, kv_cache, md: SDPAMetadata, is_cross: bool, gqa: bool,
                          out: torch.Tensor) -> list[tuple[int, int, int, int]]:
        """Attend the prefills that read keys in place (self: nothing cached before them;
        cross: a contiguous cross table) through :func:`attend_runs`, runs of one shape
        in one call; returns the prefills left for the per-sequence loop."""
        split = md.prefill_split.get(is_cross)  # the same for every layer (one cache dtype)
        if split is None:
            runs, rest = [], []
            # An fp8 cache: cross prefills read it dequantized, in the per-sequence loop.
            cross_in_place = is_cross and not fp8.is_fp8(kv_cache.dtype)
            for p in md.prefills:
                start, q_len, seq_len, i = p
                if cross_in_place and i not in md.cross_head_index and md.cross_view_start[i] >= 0:
                    runs.append((start, q_len, md.cross_view_start[i], md.cross_seq_lens[i]))
                elif not is_cross and seq_len == q_len:
                    runs.append((start, q_len, start, q_len))
                else:
                    rest.append(p)
            split = md.prefill_split[is_cross] = (runs, rest)
        runs, rest = split
        if runs:
            if is_cross:
                flat = kv_cache.flatten(1, 2)  # [2, num_blocks * block_size, H, Dh]: slots as rows
                key, value = flat[0], flat[1]
            attend_runs(query, key, value, runs, out, scale=self.scale, causal=not is_cross, gqa=gqa,
                        max_gather=VIEW_MIN_CROSS_ELEMENTS,
                        plan=md.run_plan(("prefill", is_cross), runs, query, key, not is_cross))
        return rest

    def _per_head(self, query, kv_cache, md: SDPAMetadata, j: int, table) -> torch.Tensor:
        """kv_compress per head: ``query`` ``[q, H, D]`` of per-head sequence ``j`` over
        its kept K/V in this layer (``tandem/core/kv/cross_per_head.py``)."""
        if self.layer_index is None:
            raise RuntimeError("a cross table compressed per head reached a layer without its layer_index")
        if table is None:
            table = md.cross_block_tables[md.cross_per_head_seqs[j]]
        slots, valid = cross_per_head.head_slots(table, md.cross_head_offsets[j, self.layer_index],
                                                 md.cross_head_lens[j, self.layer_index], kv_cache.shape[2])
        return cross_per_head.attend(query, kv_cache, slots, valid, self.scale)

    def _encoder_batched(self, query, key, value, runs: int, gqa: bool) -> torch.Tensor:
        """Encoder runs of one length (Whisper's 1500 positions, a batch of equal
        prompts) as one SDPA call over ``[runs, H, n, D]`` views. CPU's flash kernel
        returns its output laid out ``[runs, n, H, D]``, so the packed result is a view:
        no per-run copy into a fresh tensor (12 copies of ``[1500, 8, 64]`` per
        whisper-base clip before)."""
        def batched(t: torch.Tensor) -> torch.Tensor:  # [runs * n, H, D] -> [runs, H, n, D], a view
            return t.view(runs, -1, *t.shape[1:]).transpose(1, 2)

        o = F.scaled_dot_product_attention(batched(query), batched(key), batched(value), scale=self.scale,
                                           enable_gqa=gqa)
        return o.transpose(1, 2).reshape(query.shape)  # a view where o is [runs, n, H, D] in memory

    @abstractmethod
    def forward_decodes(
        self, query: torch.Tensor, kv_cache: torch.Tensor, md: SDPAMetadata, is_cross: bool, out: torch.Tensor
    ) -> None:
        """Write ``out`` rows ``md.decode_rows``: single-token queries over the self
        (or, ``is_cross``, the cross) cache, whose new K/V is already written."""

    def dequantized(self, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """fp8 ``k``/``v`` read from the cache, in ``dtype`` with this impl's scales."""
        s = self.kv_scales
        return fp8.dequantize(k, s.k_scale, dtype), fp8.dequantize(v, s.v_scale, dtype)

    @staticmethod
    def _view(kv_cache, first_slot, length):
        """K and V ``[length, H, Dh]`` of a contiguous run of slots, without a copy."""
        flat = kv_cache.flatten(1, 2)  # [2, num_blocks * block_size, H, Dh]
        return flat[0, first_slot : first_slot + length], flat[1, first_slot : first_slot + length]

    @staticmethod
    def _cached(kv_cache, table, length, block_size):
        n_blocks = -(-length // block_size)
        k, v = gather_from_paged_cache(kv_cache, table[:n_blocks].unsqueeze(0))
        return k[0, :length], v[0, :length]


class TorchSDPAImpl(SDPAImplBase):
    def forward_decodes(self, query, kv_cache, md: TorchSDPAMetadata, is_cross, out, position_bias=None) -> None:
        gqa = self.num_kv_heads != self.num_heads
        if is_cross:
            for row, first, n in md.decode_cross_views:
                k, v = self._view(kv_cache, first, n)
                if fp8.is_fp8(kv_cache.dtype):
                    k, v = self.dequantized(k, v, query.dtype)
                o = F.scaled_dot_product_attention(
                    _heads_first(query[row : row + 1]), _heads_first(k), _heads_first(v),
                    scale=self.scale, enable_gqa=gqa,
                )
                out[row] = o[0, :, 0]
            if md.decode_cross_gather.numel():
                seqs = md.decode_seqs.index_select(0, md.decode_cross_gather)
                tables = md.cross_block_tables.index_select(0, seqs)[:, : md.decode_cross_blocks]
                self._batched_decode(query, kv_cache, tables, md.decode_cross_mask, md.decode_cross_gather_rows,
                                     out, gqa, md.workspace)
            return
        tables = md.block_tables.index_select(0, md.decode_seqs)[:, : md.decode_blocks]
        mask = md.decode_mask
        if position_bias is not None:
            mask = position_bias.memo(("decode",), lambda: self._decode_bias(position_bias, md, query.dtype))
        self._batched_decode(query, kv_cache, tables, mask, md.decode_rows, out, gqa, md.workspace)

    @staticmethod
    def _decode_bias(pb: RelativePositionBias, md: TorchSDPAMetadata, dtype: torch.dtype) -> torch.Tensor:
        """``[D, H, 1, L]``: each decode's query at ``seq_len - 1`` over keys ``0..L-1``,
        ``-inf`` past its length."""
        width = md.decode_mask.shape[-1]
        key_pos = torch.arange(width, device=md.decode_lens.device).expand(md.num_decodes, width)
        bias = pb.bias((md.decode_lens - 1)[:, None], key_pos)  # [D, H, 1, L]
        return bias.to(dtype).masked_fill(~md.decode_mask, float("-inf"))

    def _batched_decode(self, query, kv_cache, tables, mask, rows, out, gqa, workspace) -> None:
        """One SDPA call for single-token queries over keys gathered and padded."""
        k, v = gather_from_paged_cache(kv_cache, tables, workspace)  # [B, L, H, Dh]
        if fp8.is_fp8(kv_cache.dtype):
            k, v = self.dequantized(k, v, query.dtype)
        q = query.index_select(0, rows).unsqueeze(2)  # [B, H, 1, Dh]
        o = F.scaled_dot_product_attention(
            q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=self.scale, enable_gqa=gqa
        )
        out.index_copy_(0, rows, o.squeeze(2))


class TorchSDPABackend(AttentionBackend):
    name = "torch_sdpa"
    priority = 10  # runs everywhere; faster specialised backends rank above it
    capabilities = BackendCapabilities(
        devices=("cpu", "cuda"),
        dtypes=(torch.float32, torch.float16, torch.bfloat16),
        attn_features=frozenset({RELATIVE_POSITION_BIAS, CROSS_KV_COMPRESS, CROSS_KV_COMPRESS_PER_HEAD}),
        notes="prefills one SDPA call per sequence; decodes batched over gathered, padded K/V; an fp8 cache "
        "is dequantized as it is read",
        fp8_kv_dtypes=(torch.float8_e4m3fn, torch.float8_e5m2),
    )

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return TorchSDPAImpl

    @staticmethod
    def get_metadata_builder_cls() -> type[AttentionMetadataBuilder]:
        return TorchSDPAMetadataBuilder
