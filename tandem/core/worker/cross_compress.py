"""kv_compress, the worker's half: observe the decoder's attention to the encoder over
the observation window, then choose the positions each (layer, KV head) keeps
(``CrossKVCompressor.kept_positions``) and re-pack the request's cross K/V into its
new, smaller table.

Importance of encoder position ``p`` for (layer ``l``, KV head ``h``): the softmax
attention probability of every observed decoder query to ``p``, summed over the
query heads that share KV head ``h`` (GQA), the observed positions and the request's
sequences (beams, ``n > 1``). Each observed (sequence, position) is stored apart and
overwritten when computed again, so a recompute after preemption, or verified draft
tokens computed twice, count once.

Cross attention has no positional term over keys (positions are in the encoder
output; T5 uses no bias there), so the kept positions of one head may sit in any
slot order, and heads of one slot need not keep the same position. Per head (the
backend declares ``cross_kv_compress_per_head``): each (layer, head) keeps its own
count, in its range of the table's flat single-head slots
(``tandem/core/kv/cross_per_head.py``, :meth:`CrossKVCompressor.kept_per_head`).
Otherwise every (layer, head) keeps the request's ``dst_positions``, slot ``j`` of
head ``h`` holding that head's ``j``-th kept position (ascending); see
``docs/kv_compress.md``.

Reads the default cache layout ``[2, num_blocks, block_size, num_kv_heads, head_size]``,
which every backend declaring the ``cross_kv_compress`` feature keeps.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from tandem.core.kv import cross_per_head
from tandem.core.scheduler_output import CrossRepack

logger = logging.getLogger(__name__)


# A head keeps its most attended positions when they hold at least this share of its
# attention in the window (else evenly spaced ones).
CONCENTRATED = 0.95


def _static(seen: dict[tuple[int, int], torch.Tensor]) -> torch.Tensor:
    """``[num_layers, Hkv]``: heads whose most attended position stays within 2 positions
    over every observed decoder position (of the request's first sequence). Not an
    alignment head, which follows the input (Whisper's follow the audio) and reads next
    what it has not read yet."""
    seq = min(s for s, _ in seen)
    steps = [seen[key] for key in sorted(key for key in seen if key[0] == seq)]  # by position
    peaks = torch.stack([t.argmax(-1) for t in steps])  # [P, num_layers, Hkv]
    return (peaks.amax(0) - peaks.amin(0)) <= 2


def _even(length: int, n: int) -> torch.Tensor:
    """``n`` evenly spaced positions of ``length`` (distinct: spacing >= 1 as n <= length)."""
    return torch.linspace(0, length - 1, n).round().long()


def _judge(seen: dict[tuple[int, int], torch.Tensor], k: int):
    """The window's attention summed per (layer, KV head) ``[num_layers, Hkv, L]``, its
    ``k`` most attended positions (``topk``), and which heads keep positions by it
    ``[num_layers, Hkv]``: concentrated (their ``k``
    most attended positions hold at least ``CONCENTRATED`` of it) and static
    (:func:`_static`)."""
    importance = torch.stack(list(seen.values())).sum(0)
    top = importance.topk(k, dim=-1)
    share = top.values.sum(-1) / importance.sum(-1).clamp_min(1e-30)
    return importance, top, (share >= CONCENTRATED) & _static(seen)


def _flat(kv_cache: torch.Tensor) -> torch.Tensor:
    """``[2, num_blocks * block_size, H, D]``: the cache by flat slot."""
    return kv_cache.view(2, -1, kv_cache.shape[-2], kv_cache.shape[-1])


def _slots(blocks: list[int] | torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    table = torch.as_tensor(blocks, dtype=torch.long, device=positions.device)
    return table[positions // block_size] * block_size + positions % block_size


@dataclass
class _Observed:
    request_id: str
    seq_id: int
    rows: torch.Tensor  # [n] packed query rows
    positions: list[int]  # [n] their decoder positions
    slots: torch.Tensor  # [L] flat cache slot of each encoder position
    scores: torch.Tensor  # [num_layers, n, Hkv, L] float32, filled layer by layer


class CrossObserver:
    """One step's observation: the model's cross-attention layers call :meth:`observe` in
    layer order (each decoder layer has one); :meth:`commit` stores the step's scores."""

    def __init__(self, entries: list[_Observed], store: "CrossKVCompressor") -> None:
        self.entries = entries
        self.store = store
        self._layer = 0

    def observe(self, query: torch.Tensor, kv_cache: torch.Tensor, scale: float) -> None:
        """``query`` ``[T, Hq, D]``: this layer's queries; the cross K/V are in ``kv_cache``
        (written before this call when the encoder ran this step)."""
        layer, self._layer = self._layer, self._layer + 1
        keys = _flat(kv_cache)[0]  # [slots, Hkv, D]
        hkv, d = keys.shape[1], keys.shape[2]
        for e in self.entries:
            q = query.index_select(0, e.rows).float()  # [n, Hq, D]
            k = keys.index_select(0, e.slots).float()  # [L, Hkv, D]
            q = q.view(q.shape[0], hkv, -1, d)  # [n, Hkv, group, D]
            probs = torch.softmax(torch.einsum("nhgd,lhd->nhgl", q, k) * scale, dim=-1)
            e.scores[layer] = probs.sum(2)

    def commit(self) -> None:
        if self._layer != self.store.num_layers:  # a model whose cross layers did not all run once
            raise RuntimeError(f"kv_compress observed {self._layer} cross-attention layers, the cache has "
                               f"{self.store.num_layers}")
        for e in self.entries:
            seen = self.store.scores.setdefault(e.request_id, {})
            for i, pos in enumerate(e.positions):
                seen[(e.seq_id, pos)] = e.scores[:, i]


class CrossKVCompressor:
    """The worker's kv_compress state: observed scores by request, and the re-pack.
    ``per_head``: re-pack into the per-head layout (``tandem/core/kv/cross_per_head.py``:
    the backend declares ``cross_kv_compress_per_head``), else one count per request."""

    def __init__(self, num_layers: int, num_kv_heads: int, block_size: int, per_head: bool = False,
                 min_keep: int = 1) -> None:
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.block_size = block_size
        self.per_head = per_head
        self.min_keep = min_keep
        # request id -> (seq id, decoder position) -> [num_layers, Hkv, L] probabilities
        self.scores: dict[str, dict[tuple[int, int], torch.Tensor]] = {}
        # per_head: request id -> (offsets, lens) [num_layers, Hkv] int64 (CPU) of its re-packed table
        self.layouts: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def forget(self, request_id: str) -> None:
        self.scores.pop(request_id, None)
        self.layouts.pop(request_id, None)

    def observer(self, groups, seqs_rows, device: torch.device) -> CrossObserver | None:
        """The step's observer. ``groups``: the scheduled groups; ``seqs_rows``: per group,
        per sequence, ``(first packed row, first position)``. None when nothing is observed."""
        entries = []
        for g, seq_rows in zip(groups, seqs_rows):
            until = g.cross_observe_until
            if not until:
                continue
            slots = None
            for seq, (row, start) in zip(g.seqs, seq_rows):
                n = min(len(seq.token_ids), until - start)
                if n <= 0:
                    continue
                if slots is None:
                    slots = _slots(g.cross_block_table, torch.arange(g.num_encoder_positions), self.block_size)
                    slots = slots.to(device)
                entries.append(_Observed(
                    g.request_id, seq.seq_id, torch.arange(row, row + n, device=device), list(range(start, start + n)),
                    slots, torch.zeros(self.num_layers, n, self.num_kv_heads, g.num_encoder_positions, device=device),
                ))
        return CrossObserver(entries, self) if entries else None

    def kept_positions(self, repack: CrossRepack, device: torch.device) -> torch.Tensor:
        """``[num_layers, Hkv, dst_positions]``: the encoder positions each (layer, KV head)
        keeps, ascending. A head whose window attention is concentrated (its
        ``dst_positions`` most attended positions hold at least ``CONCENTRATED`` of it) and
        static (:func:`_static`) keeps its most attended positions;
        any other head keeps evenly spaced positions: a diffuse head reads an average,
        which an even sample keeps and a top-k set skews, and an alignment head reads next
        what it has not read yet, which past attention cannot rank."""
        seen = self.scores.pop(repack.request_id, None)
        k, length = repack.dst_positions, repack.src_positions
        even = _even(length, k).expand(self.num_layers, self.num_kv_heads, k)
        if not seen:  # nothing observed (cannot happen for a request the scheduler compressed)
            logger.warning("request %r: kv_compress found no observed attention; keeping evenly spaced positions",
                           repack.request_id)
            return even.to(device)
        _, top, by_attention = _judge(seen, k)
        kept = torch.where(by_attention[..., None], top.indices, even)
        return kept.sort(dim=-1).values.to(device)

    def repack(self, repack: CrossRepack, kv_caches: list[torch.Tensor]):
        """Move each (layer, KV head)'s kept K/V into the new blocks; returns the kept
        positions (per head: a list per layer of a list per head)."""
        device = kv_caches[0].device
        if self.per_head:
            per_head = self.kept_per_head(repack)
            if any(len(p) != repack.dst_positions for heads in per_head for p in heads):
                return self._repack_per_head(repack, kv_caches, per_head)
            # Every head keeps the one count (no head was concentrated below it, as on the
            # Whisper demo): the ordinary layout, which every read serves (cpu_paged's C++
            # op, not the per-head gather); the positions are the same either way.
            kept = torch.stack([torch.stack(heads) for heads in per_head]).to(device)
        else:
            kept = self.kept_positions(repack, device)
        src = _slots(repack.src_blocks, kept, self.block_size)  # [num_layers, Hkv, K]
        dst = _slots(repack.dst_blocks, torch.arange(repack.dst_positions, device=device), self.block_size)  # [K]
        heads = torch.arange(self.num_kv_heads, device=device)
        for layer, cache in enumerate(kv_caches):
            flat = _flat(cache)
            # The gather copies every kept K/V before the write: dst may be src's own first blocks.
            flat[:, dst] = flat[:, src[layer].T, heads]  # [2, K, Hkv, D]: head h from its own positions
        return kept

    def kept_per_head(self, repack: CrossRepack) -> list[list[torch.Tensor]]:
        """Per layer, per KV head, the encoder positions it keeps (ascending, CPU int64):
        each layer's budget is ``Hkv x dst_positions`` single-head slots. A concentrated-
        and-static head (as :meth:`kept_positions` judges it over its ``dst_positions``
        most attended positions) keeps the fewest most attended positions that hold
        ``CONCENTRATED`` of its window attention (at least ``min_keep``); the layer's other
        heads share what is left, evenly spaced, each at most the encoder's length. The
        table then needs the largest layer's slots, rounded up to whole blocks; the other
        layers' heads fill their spare slots there (more positions at no cost: a
        concentrated head more of its most attended ones)."""
        seen = self.scores.pop(repack.request_id, None)
        k, length, hkv = repack.dst_positions, repack.src_positions, self.num_kv_heads
        if not seen:
            logger.warning("request %r: kv_compress found no observed attention; keeping evenly spaced positions",
                           repack.request_id)
            return [[_even(length, k)] * hkv for _ in range(self.num_layers)]
        importance, _, by_attention = _judge(seen, k)
        importance, by_attention = importance.cpu(), by_attention.cpu()
        order = importance.sort(dim=-1, descending=True)
        total = importance.sum(-1).clamp_min(1e-30)
        # the fewest top positions holding CONCENTRATED of the mass
        covering = (order.values.cumsum(-1) < CONCENTRATED * total[..., None]).sum(-1) + 1
        small = covering.clamp(min=min(self.min_keep, k), max=k)
        counts = torch.zeros(self.num_layers, hkv, dtype=torch.long)
        for layer in range(self.num_layers):
            conc = by_attention[layer].tolist()
            others = [h for h in range(hkv) if not conc[h]]
            left = hkv * k - sum(int(small[layer, h]) for h in range(hkv) if conc[h])
            per, extra = divmod(left, len(others)) if others else (0, 0)
            for h in range(hkv):
                counts[layer, h] = small[layer, h] if conc[h] else min(length, per + (others.index(h) < extra))
        # Every layer shares the table's blocks, which the largest layer sizes: a smaller
        # layer's heads fill its spare slots (more positions at no cost).
        per_block = self.block_size * hkv
        capacity = -(-int(counts.sum(-1).max()) // per_block) * per_block
        for layer in range(self.num_layers):
            spare = capacity - int(counts[layer].sum())
            while spare > 0:
                room = [h for h in range(hkv) if int(counts[layer, h]) < length]
                if not room:
                    break
                step = max(1, spare // len(room))
                for h in room[:spare]:
                    grow = min(step, length - int(counts[layer, h]), spare)
                    counts[layer, h] += grow
                    spare -= grow
        return [[order.indices[layer, h, : int(counts[layer, h])].sort().values if by_attention[layer, h]
                 else _even(length, int(counts[layer, h])) for h in range(hkv)] for layer in range(self.num_layers)]

    def _repack_per_head(self, repack: CrossRepack, kv_caches: list[torch.Tensor],
                         kept: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
        """Write head ``h`` of layer ``l``'s kept K/V (``kept[l][h]``) at flat single-head
        slots ``[offset[l, h], offset[l, h] + len[l, h])`` of the new table, heads in order."""
        device = kv_caches[0].device
        hkv, bs = self.num_kv_heads, self.block_size
        lens = torch.tensor([[len(p) for p in heads] for heads in kept], dtype=torch.long)  # [num_layers, Hkv]
        offsets = lens.cumsum(-1) - lens
        src_table = torch.as_tensor(repack.src_blocks, dtype=torch.long)
        dst_table = torch.as_tensor(repack.dst_blocks, dtype=torch.long)
        if int(lens.sum(-1).max()) > len(repack.dst_blocks) * bs * hkv:
            raise RuntimeError(f"request {repack.request_id!r}: kept K/V exceed the compressed table")
        for layer, cache in enumerate(kv_caches):
            positions = torch.cat(kept[layer])
            heads = torch.cat([torch.full((len(p),), h, dtype=torch.long) for h, p in enumerate(kept[layer])])
            src = _slots(src_table, positions, bs) * hkv + heads  # the cache's single-head slots
            dst = cross_per_head.table_slots(dst_table, torch.arange(len(positions)), bs, hkv)
            flat = cross_per_head.flat_heads(cache)
            # The gather copies every kept K/V before the write: dst may be src's own first blocks.
            flat[:, dst.to(device)] = flat[:, src.to(device)]
        self.layouts[repack.request_id] = (offsets, lens)
        return kept

    def blocks_needed(self, request_id: str) -> int | None:
        """Blocks the request's per-head table needs: its largest layer's kept K/V."""
        layout = self.layouts.get(request_id)
        if layout is None:
            return None
        per_block = self.block_size * self.num_kv_heads
        return -(-int(layout[1].sum(-1).max()) // per_block)
