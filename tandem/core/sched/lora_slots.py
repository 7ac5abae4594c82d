"""How many LoRA adapters one step may hold: ``max_loras`` distinct adapters.

The worker keeps ``max_loras`` adapters resident and gathers each row's low-rank
update from them, so a step whose groups name more adapters than that cannot run.
The scheduler asks this policy before a swapped or waiting group joins the step.

Fairness: a group refused for want of an adapter slot waits at its place in the
queue (first come, first served). Groups behind it may still join, but only those
that run on the base weights: they take no adapter slot, so they never keep an
adapter resident longer. A later group with an adapter (even one already in the
step) waits behind it; otherwise a stream of requests for the running adapters
could keep the refused group's adapter out forever.

A group whose adapter is still being read from disk (``tandem/lora/loader.py``) is
not refused a slot: it is not ready, as a group whose grammar still compiles, so
it is passed over without blocking anyone (it holds no blocks and no slot, and
the groups behind it, with adapters or not, go past it). Once its adapter is in
the CPU cache it is considered again at its place in the queue, ahead of the
groups that arrived after it.
"""

from __future__ import annotations

from collections.abc import Iterable

from tandem.core.sequence import SequenceGroup


class LoRASlots:
    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self.active: set[int] = set()  # adapter ids in the step being scheduled
        self.blocked = False  # a group waited for a slot this step

    def start_step(self, running: Iterable[SequenceGroup]) -> None:
        """The adapters of the groups already in the step (the running ones)."""
        # lora_id, read without its property call (every running group, every step).
        self.active = {lid for g in running if g.lora_request is not None and (lid := g.lora_request.lora_int_id)}
        self.blocked = False

    def admits(self, group: SequenceGroup) -> bool:
        """Whether ``group`` may join the step; if so its adapter counts from now on
        (call :meth:`add` once it has joined). False for a group with an adapter once
        an earlier one was refused, so that one keeps its place."""
        lora = group.lora_id
        if not lora:
            return True
        if self.blocked:
            return False
        if lora in self.active or len(self.active) < self.max_loras:
            return True
        self.blocked = True
        return False

    def add(self, group: SequenceGroup) -> None:
        if group.lora_id:
            self.active.add(group.lora_id)
