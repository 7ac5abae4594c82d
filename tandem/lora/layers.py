"""The low-rank update of one linear layer, for every resident adapter at once.

A layer's adapters live in stacked buffers, one pair per checkpoint shard of the
layer (``q``/``k``/``v`` of a fused ``QKVParallelLinear``, the halves of a
``MergedColumnParallelLinear``, or the whole layer), with ``max_loras`` slots of
``max_lora_rank`` rows each, zero where a slot's adapter is of lower rank or does
not adapt that shard:

    a[k]: [slots * R, in]      b[k]: [slots * R, out_k]     (scaling folded into b)

One step's update of ``y = x W^T`` (the base GEMM, whatever its kernel) is, per
shard, two GEMMs over the slots in use (``hi``: the highest slot used + 1)::

    t = (x @ a[k][:hi*R]^T) * mask       # [N, hi*R]; mask[i] = 1 on the columns of token i's slot
    y[:, shard k] += t @ b[k][:hi*R]

``mask`` is built once per step and side (encoder or decoder tokens) by
:class:`LoRAStep`; a token without an adapter has a zero row. There is no loop
over rows or adapters: the cost is two GEMMs of width ``hi * R`` per shard, so
with adapters in the low slots it grows with the adapters in the batch (the
manager fills the lowest free slot first), and a step with none costs nothing.

Tensor parallelism: a column-parallel layer keeps all of ``A`` and its rows of
``B``; a row-parallel one its columns of ``A`` and all of ``B``, so each rank's
``(x_r A_r^T) B^T`` is its partial sum, which the layer's all-reduce adds up with
the base GEMM's (``tandem.lora.mapping`` shards them with the layer's own weight loaders).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

ENCODER, DECODER = "encoder", "decoder"


class LoRAStep:
    """What every adapted layer reads during one forward pass: per side (encoder /
    decoder tokens) the ``[N, hi * R]`` slot mask, or None when no token of that side
    has an adapter. Set only inside :meth:`active`, which does not nest."""

    def __init__(self, max_rank: int, dtype: torch.dtype, device: torch.device) -> None:
        self.rank = max_rank
        self.dtype, self.device = dtype, device
        self.hi = 0
        self.masks: dict[str, torch.Tensor | None] = {ENCODER: None, DECODER: None}
        self._open = False

    def _mask(self, slots: torch.Tensor, hi: int) -> torch.Tensor | None:
        """``slots``: ``[N]`` slot per token (-1: none)."""
        if hi == 0 or slots.numel() == 0 or not bool((slots >= 0).any()):
            return None
        cols = torch.arange(hi, device=slots.device).repeat_interleave(self.rank)  # [hi * R]
        return (slots.unsqueeze(1) == cols.unsqueeze(0)).to(device=self.device, dtype=self.dtype)

    @contextmanager
    def active(self, decoder_slots: torch.Tensor, encoder_slots: torch.Tensor):
        if self._open:
            raise RuntimeError("LoRAStep.active does not nest: one forward pass at a time")
        used = torch.cat([decoder_slots, encoder_slots])
        self.hi = int(used.max()) + 1 if used.numel() else 0
        self.masks = {DECODER: self._mask(decoder_slots, self.hi), ENCODER: self._mask(encoder_slots, self.hi)}
        self._open = True
        try:
            yield self
        finally:
            self._open = False
            self.hi = 0
            self.masks = {ENCODER: None, DECODER: None}


class LinearLoRA:
    """The adapters of one linear layer (see the module docstring). ``shards``:
    ``(offset, size)`` of each checkpoint shard in this rank's output."""

    def __init__(self, step: LoRAStep, side: str, shards: list[tuple[int, int]], in_features: int,
                 max_loras: int, dtype: torch.dtype, device: torch.device) -> None:
        self.step, self.side, self.shards = step, side, shards
        rows = max_loras * step.rank
        self.a = [torch.zeros(rows, in_features, dtype=dtype, device=device) for _ in shards]
        self.b = [torch.zeros(rows, size, dtype=dtype, device=device) for _, size in shards]
        # Per shard, the slots whose adapter adapts it: a shard no resident adapter adapts is skipped.
        self.users: list[set[int]] = [set() for _ in shards]

    def set_slot(self, slot: int, shard: int, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        """Put ``a`` ``[r, in]`` and ``b`` ``[size, r]`` (scaled) into ``slot``; None clears it."""
        rank = self.step.rank
        rows = slice(slot * rank, (slot + 1) * rank)
        self.a[shard][rows].zero_()
        self.b[shard][rows].zero_()
        if a is None:
            self.users[shard].discard(slot)
            return
        r = a.shape[0]
        self.a[shard][slot * rank: slot * rank + r].copy_(a)
        self.b[shard][slot * rank: slot * rank + r].copy_(b.t())
        self.users[shard].add(slot)

    @property
    def active(self) -> bool:
        """Whether this step has tokens with an adapter on this layer's side."""
        return self.step.masks[self.side] is not None

    def apply(self, y: torch.Tensor, x: torch.Tensor) -> None:
        """Add the step's low-rank updates to ``y`` (the base output of ``x``), in place."""
        mask = self.step.masks[self.side]
        if mask is None:
            return
        width = mask.shape[1]
        x2 = x.reshape(-1, x.shape[-1])
        y2 = y.view(-1, y.shape[-1])
        hi = self.step.hi
        for k, (offset, size) in enumerate(self.shards):
            if not any(s < hi for s in self.users[k]):
                continue
            t = torch.mm(x2, self.a[k][:width].t()).mul_(mask)  # [N, hi * R]
            out = y2.narrow(1, offset, size)
            if len(self.shards) == 1:
                out.addmm_(t, self.b[k][:width])
            else:  # a strided view: addmm_ would copy it in and out anyway
                out += torch.mm(t, self.b[k][:width])

