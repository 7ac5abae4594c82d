"""The low-rank update of one linear layer, for every resident adapter at once.

A layer's adapters live in two stacked buffers with ``max_loras`` slots. A layer
has ``S`` checkpoint shards (``q``/``k``/``v`` of a fused ``QKVParallelLinear``, the
halves of a ``MergedColumnParallelLinear``, or the whole layer: ``S = 1``); slot
``s``, shard ``k`` owns rows ``(s S + k) R ... + R`` (``R = max_lora_rank``; an
adapter of rank ``r`` fills the first ``r``, zeros after):

    a: [slots * S * R, in]     its A
    b: [slots * S * R, out]    its (scaled) B^T, in the shard's output columns only

so a slot's rows of both are contiguous: ``w = S R`` rows, ``a_s`` and ``b_s``.

**Each row meets its own adapter only.** :class:`LoRAStep` sorts a step's tokens
that have an adapter by slot, once per step and side (encoder or decoder tokens):
``rows`` (their indices, slot by slot) and ``segments`` (``(slot, start, end)`` in
that order). A layer gathers those rows of ``x`` once, and per segment runs GEMMs
with that slot's own rows of ``a`` and ``b`` only::

    t[start:end] = xs[start:end] @ a_s^T             # [n, S R]: every shard's x A^T
    d[start:end] = t[start:end] @ b_s                # [n, out] (block-diagonal b_s)
    y[rows] += d                                      # one index_add_

With at most ``FEW_ROWS`` rows (decode steps) the segments run at once: padded to
the longest into ``G`` groups of ``L`` rows (padding rows zero, not another request's
row times zero), two batched GEMMs with each group's own ``a_s`` and ``b_s`` (views
when the step's slots are consecutive), one ``index_add_``: a handful of ops whatever
the number of adapters or shards. With more rows, one GEMM per segment (per shard and
segment for a fused layer, so a large step multiplies no zeros); rows already in slot
order are added into ``y`` directly, with no gather or scatter.

No token is ever multiplied by another slot's weights, so whatever an adapter
holds (even values that overflow to inf) reaches only its own rows; a masked
product of every row with every adapter (``inf * 0 = NaN``) would not give that.
The work is each token's own rank, whatever the number of adapters in the step;
tokens without an adapter cost nothing, and a step with none runs the base GEMM alone.

**An update that would overflow fails its adapter's requests.** Each layer looks at
``t = x A^T`` (a few columns per row): a row with a value above ``sqrt(M)`` (``M``:
the dtype's largest finite value) or NaN is set to zero, so its update is zero, and
marked in a per-step flag of the side's rows. ``tandem.lora.mapping`` refuses an
adapter whose scaled ``B`` has a row sum of magnitudes above ``sqrt(M) / 2``, so
``|t B^T| <= M / 2``: no update a layer adds is ever NaN or inf, and a NaN never
reaches a per-tensor quantized GEMM downstream (``quantization="int8"``, the LM
head's int8 screen), which reads every row's range at once. After the forward pass
the slots with a marked row are reported to ``LoRAStep.on_faults``
(``tandem.lora.manager`` fails those adapters' requests with the reason); the step,
and every other request in it, goes on. So does an exception in a layer's update:
only the adapters' rows of its output can have been written, and every slot of that
side in the step is reported with the cause.

Tensor parallelism: a column-parallel layer keeps all of ``A`` and its rows of
``B``; a row-parallel one its columns of ``A`` and all of ``B``, so each rank's
``(x_r A_r^T) B^T`` is its partial sum, which the layer's all-reduce adds up with
the base GEMM's (``tandem.lora.mapping`` shards them with the layer's own weight loaders).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

ENCODER, DECODER = "encoder", "decoder"


@dataclass
class SideRows:
    """One side's tokens that have an adapter this step, sorted by slot.

    ``rows``: ``[M]`` their indices in the side's tokens (None: all of them, in order,
    so no gather or scatter is needed); ``segments``: ``(slot, start, end)`` ranges of
    the sorted rows; ``bad``: ``[M]`` bool, the rows whose update was zeroed so far
    (None until the guard finds one, or first looks on a GPU); ``errors``: why per
    slot whose update raised."""

    rows: torch.Tensor | None
    segments: list[tuple[int, int, int]]
    bad: torch.Tensor | None = None
    errors: dict[int, str] = field(default_factory=dict)  # slot -> why, for an exception in a layer
    # Few rows (at most FEW_ROWS): the segments as G groups of L rows, padded, for batched
    # GEMMs. ``index``: [G * L] each position's row of x (a padding position names a row of
    # its own group and is zeroed by ``pad``, [G * L, 1], None without padding); ``slots``:
    # [G] the groups' slots, or None when they are consecutive (a view of the buffers).
    groups: int = 0
    length: int = 0
    index: torch.Tensor | None = None
    pad: torch.Tensor | None = None
    slots: torch.Tensor | None = None
    # (slot, start, end) of each segment in the layout ``bad`` is kept in.
    spans: list[tuple[int, int, int]] = field(default_factory=list)


class LoRAStep:
    """What every adapted layer reads during one forward pass: per side (encoder /
    decoder tokens) a :class:`SideRows`, or None when no token of that side has an
    adapter. Set only inside :meth:`active`, which does not nest. ``on_faults``, when
    set, is called after a forward pass with ``{slot: why}`` for the slots some of
    whose tokens' updates the guard zeroed (never with an empty dict)."""

    def __init__(self, max_rank: int, dtype: torch.dtype, device: torch.device) -> None:
        self.rank = max_rank
        self.dtype, self.device = dtype, device
        self.sides: dict[str, SideRows | None] = {ENCODER: None, DECODER: None}
        # |x A^T| above this is an overflow in waiting (module docstring).
        self.limit = torch.finfo(dtype).max ** 0.5
        self.on_faults: Callable[[dict[int, str]], None] | None = None
        self._open = False

    def _side(self, slots: torch.Tensor) -> SideRows | None:
        """``slots``: ``[N]`` slot per token (-1: none), on the CPU."""
        n = slots.numel()
        if n == 0:
            return None
        if n <= 4096:  # a decode step's few rows: plain Python beats a dozen small tensor ops
            slot_list = slots.tolist()
            order = sorted((i for i, slot in enumerate(slot_list) if slot >= 0), key=slot_list.__getitem__)
            if not order:
                return None
            sorted_slots = [slot_list[i] for i in order]
            identity = len(order) == n and all(a <= b for a, b in zip(slot_list, slot_list[1:]))
        else:
            slots = slots.cpu()
            m = int((slots >= 0).sum())
            if m == 0:
                return None
            order = torch.argsort(slots, stable=True)[n - m:]  # the -1s sort first
            sorted_slots = slots[order].tolist()
            identity = m == n and bool((order == torch.arange(m)).all())
        segments, start = [], 0
        for i in range(1, len(sorted_slots) + 1):
            if i == len(sorted_slots) or sorted_slots[i] != sorted_slots[start]:
                segments.append((sorted_slots[start], start, i))
                start = i
        rows = None if identity else torch.as_tensor(order, dtype=torch.long).to(self.device)
        side = SideRows(rows, segments, spans=segments)
        if len(sorted_slots) <= FEW_ROWS and not (identity and len(segments) == 1):
            order = order.tolist() if isinstance(order, torch.Tensor) else order
            g, length = len(segments), max(end - start for _, start, end in segments)
            index, pad, spans = [], [], []
            for k, (slot, start, end) in enumerate(segments):
                index += order[start:end] + [order[start]] * (length - (end - start))
                pad += [False] * (end - start) + [True] * (length - (end - start))
                spans.append((slot, k * length, k * length + end - start))
            side.groups, side.length, side.spans = g, length, spans
            side.index = torch.tensor(index, dtype=torch.long).to(self.device)
            side.pad = torch.tensor(pad).unsqueeze(1).to(self.device) if any(pad) else None
            first = segments[0][0]
            if [slot for slot, _, _ in segments] != list(range(first, first + g)):
                side.slots = torch.tensor([slot for slot, _, _ in segments], dtype=torch.long).to(self.device)
        return side

    @contextmanager
    def active(self, decoder_slots: torch.Tensor, encoder_slots: torch.Tensor):
        if self._open:
            raise RuntimeError("LoRAStep.active does not nest: one forward pass at a time")
        self.sides = {DECODER: self._side(decoder_slots), ENCODER: self._side(encoder_slots)}
        self._open = True
        try:
            yield self
            faults = self._faults()
            if faults and self.on_faults is not None:
                self.on_faults(faults)
        finally:
            self._open = False
            self.sides = {ENCODER: None, DECODER: None}

    def guard(self, t: torch.Tensor, side: SideRows) -> None:
        """Zero and mark the rows of ``t = x A^T`` (``[M, w]``) with a value above
        ``limit`` or NaN (the module docstring)."""
        limit = self.limit
        if t.device.type == "cpu":
            # One reduction and a comparison (no sync to speak of on the CPU); the rows only when it fails.
            lo, hi = torch.aminmax(t)
            if -limit <= float(lo) and float(hi) <= limit:  # NaN compares False
                return
        bad = ~(t.abs().amax(dim=1) <= limit)  # [M]; on a GPU without a sync
        if side.bad is None:
            side.bad = bad
        else:
            side.bad.logical_or_(bad)
        t.masked_fill_(bad.unsqueeze(1), 0.0)

    def _faults(self) -> dict[int, str]:
        """The slots some of whose rows' updates were zeroed (one check per side)."""
        faults = {}
        for side, rows in self.sides.items():
            if rows is not None:
                faults.update(rows.errors)
            if rows is None or rows.bad is None or not bool(rows.bad.any()):
                continue
            bad = rows.bad.cpu()
            for slot, start, end in rows.spans:
                if bool(bad[start:end].any()) and slot not in faults:
                    faults[slot] = (f"its low-rank update of the {side} tokens overflows "
                                    f"{str(self.dtype).removeprefix('torch.')} on this input (x A^T above "
                                    f"{self.limit:.3g}, or NaN)")
        return faults


# Up to this many rows with an adapter (a decode step's), the update runs as batched
# GEMMs over padded groups, with each slot's block-diagonal B (zeros off the shard
# blocks cost little at few rows; the op count is what costs there); above it, one
# GEMM per segment and shard, so large steps do no work on zeros or padding.
FEW_ROWS = 256


class LinearLoRA:
    """The adapters of one linear layer (see the module docstring). ``shards``:
    ``(offset, size)`` of each checkpoint shard in this rank's output, which they cover."""

    def __init__(self, step: LoRAStep, side: str, shards: list[tuple[int, int]], in_features: int,
                 max_loras: int, dtype: torch.dtype, device: torch.device) -> None:
        self.step, self.side, self.shards = step, side, shards
        rank, n = step.rank, len(shards)
        out_features = sum(size for _, size in shards)
        # Slot s, shard k owns rows (s n + k) R ... + R of both: in a, its A; in b, its
        # B^T in the shard's columns (zero elsewhere). A slot's rows are contiguous, so
        # one GEMM per slot gives x A^T for every shard.
        self.a = torch.zeros(max_loras * n * rank, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(max_loras * n * rank, out_features, dtype=dtype, device=device)
        # Per shard and slot, the rank of the slot's adapter there (0: it does not adapt the shard).
        self.ranks: list[list[int]] = [[0] * max_loras for _ in shards]
        self.adapted = [False] * max_loras  # per slot: whether it adapts any shard of this layer

    def set_slot(self, slot: int, shard: int, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        """Put ``a`` ``[r, in]`` and ``b`` ``[size, r]`` (scaled) into ``slot``; None clears it."""
        rank = self.step.rank
        first = (slot * len(self.shards) + shard) * rank
        offset, size = self.shards[shard]
        self.a[first: first + rank].zero_()
        self.b[first: first + rank].zero_()
        if a is None:
            self.ranks[shard][slot] = 0
            self.adapted[slot] = any(r[slot] for r in self.ranks)
            return
        r = a.shape[0]
        self.a[first: first + r].copy_(a)
        self.b[first: first + r, offset: offset + size].copy_(b.t())
        self.ranks[shard][slot] = r
        self.adapted[slot] = True

    @property
    def active(self) -> bool:
        """Whether this step has tokens with an adapter on this layer's side."""
        return self.step.sides[self.side] is not None

    def apply(self, y: torch.Tensor, x: torch.Tensor) -> None:
        """Add the step's low-rank updates to ``y`` (the base output of ``x``), in place."""
        side = self.step.sides[self.side]
        if side is None:
            return
        try:
            self._apply(y, x, side)
        except Exception as e:  # noqa: BLE001 - the adapters' fault: their requests fail, the step goes on
            # Only the adapters' rows of y can have been written; they fail with the cause.
            why = f"its low-rank update failed: {type(e).__name__}: {e}"
            for slot, _, _ in side.segments:
                side.errors.setdefault(slot, why)

    def _apply_batched(self, y2: torch.Tensor, x2: torch.Tensor, side: SideRows) -> None:
        """Few rows: every segment at once, as G padded groups of L rows, in two batched
        GEMMs with each group's own slot (a handful of ops whatever the adapters)."""
        g, length, w = side.groups, side.length, len(self.shards) * self.step.rank
        xs = x2.index_select(0, side.index)  # [G * L, in]
        if side.pad is not None:
            xs.masked_fill_(side.pad, 0.0)  # zero rows, not another request's row times zero
        a3 = self.a.view(-1, w, self.a.shape[1])  # [slots, w, in]
        b3 = self.b.view(-1, w, self.b.shape[1])  # [slots, w, out]
        if side.slots is None:
            first = side.segments[0][0]
            a_g, b_g = a3[first: first + g], b3[first: first + g]
        else:
            a_g, b_g = a3.index_select(0, side.slots), b3.index_select(0, side.slots)
        t = torch.bmm(xs.view(g, length, -1), a_g.transpose(1, 2))  # [G, L, w]
        self.step.guard(t.view(g * length, w), side)
        d = torch.bmm(t, b_g)  # [G, L, out]; a padding row's is zero
        y2.index_add_(0, side.index, d.view(g * length, -1))

    def _apply(self, y: torch.Tensor, x: torch.Tensor, side: SideRows) -> None:
        adapted = self.adapted
        segments = [seg for seg in side.segments if adapted[seg[0]]]
        if not segments:
            return
        x2 = x.reshape(-1, x.shape[-1])
        y2 = y.view(-1, y.shape[-1])
        if side.index is not None:
            self._apply_batched(y2, x2, side)
            return
        rows = side.rows
        xs = x2 if rows is None else x2.index_select(0, rows)  # [M, in], slot by slot
        m, w = xs.shape[0], len(self.shards) * self.step.rank
        every = len(segments) == len(side.segments)  # else segments not adapted here keep zero rows
        t = (torch.empty if every else torch.zeros)(m, w, dtype=y.dtype, device=y.device)  # [M, shards * R]
        a, b = self.a, self.b
        for slot, start, end in segments:
            torch.mm(xs[start:end], a[slot * w: (slot + 1) * w].t(), out=t[start:end])
        self.step.guard(t, side)
        n_shards = len(self.shards)
        if m <= FEW_ROWS or n_shards == 1:  # one GEMM per segment over every shard (block-diagonal b)
            if rows is None:  # in order: each segment adds into its own rows of y
                for slot, start, end in segments:
                    y2[start:end].addmm_(t[start:end], b[slot * w: (slot + 1) * w])
                return
            d = (torch.empty if every else torch.zeros)(m, y2.shape[1], dtype=y.dtype, device=y.device)
            for slot, start, end in segments:
                torch.mm(t[start:end], b[slot * w: (slot + 1) * w], out=d[start:end])
            y2.index_add_(0, rows, d)
            return
        rank = self.step.rank
        for k, (offset, size) in enumerate(self.shards):
            own = [seg for seg in segments if self.ranks[k][seg[0]]]
            if not own:
                continue
            out = y2.narrow(1, offset, size)
            if rows is None:
                for slot, start, end in own:
                    first = (slot * n_shards + k) * rank
                    out[start:end] += torch.mm(t[start:end, k * rank: (k + 1) * rank],
                                               b[first: first + rank, offset: offset + size])
                continue
            d = (torch.empty if len(own) == len(side.segments) else torch.zeros)(
                m, size, dtype=y.dtype, device=y.device)  # [M, size]
            for slot, start, end in own:
                first = (slot * n_shards + k) * rank
                torch.mm(t[start:end, k * rank: (k + 1) * rank], b[first: first + rank, offset: offset + size],
                         out=d[start:end])
            out.index_add_(0, rows, d)
