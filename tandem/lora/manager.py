"""The worker's adapters: ``max_loras`` resident slots and a CPU cache of loaded ones.

Each step :meth:`LoRAManager.assign` gives every scheduled request with a
``lora_request`` the slot its adapter sits in, copying it from the CPU cache first
when it is not resident. The engine fills the CPU cache off the step
(``tandem.lora.loader``: it reads the adapter in the background, then
:meth:`LoRAManager.add` maps it and cuts this rank's part) and evicts from it
(:meth:`LoRAManager.drop`); only an adapter the cache lacks, when a worker is
driven without the engine, is read from its directory inside the step. A new
adapter takes the lowest free slot, else the least recently used slot that this
step does not use. An adapter that
cannot be served fails only the requests naming it
("LoRA adapter 'NAME' (PATH): reason"); the others run. So does an adapter whose
update turns out not finite in a step (``tandem.lora.layers``): the forward pass
reports its slot, and the failures :meth:`LoRAManager.assign` returned for the step
gain its requests, which the worker reads after the forward pass.

Adapters are keyed by ``lora_int_id`` (as vLLM does): two requests with the same
id share the loaded adapter.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable

import torch
from torch import nn

from tandem.core.layers.linear import LinearBase
from tandem.lora.adapter import AdapterError, PeftLoRA, read_adapter, why_failed
from tandem.lora.layers import LinearLoRA, LoRAStep
from tandem.lora.mapping import LayerLoRA, map_adapter, model_fits, shards_of, side_of
from tandem.lora.source import resolve_adapter

logger = logging.getLogger(__name__)


class LoRAManager:
    def __init__(self, model: nn.Module, *, max_loras: int, max_rank: int, max_cpu_loras: int | None,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.model = model
        self.max_loras, self.max_rank = max_loras, max_rank
        self.max_cpu_loras = max(max_cpu_loras or max_loras, 1)
        self.dtype = dtype
        self.step = LoRAStep(max_rank, dtype, device)
        self.step.on_faults = self._on_faults
        # The step's assignment, for _on_faults: the failures assign returned (filled
        # further when a slot's update is not finite) and the requests of each slot.
        self._step_failed: dict[str, str] = {}
        self._step_slots: dict[int, list[tuple[str, object]]] = {}
        self.layers: dict[str, LinearLoRA] = {}
        for name, module in model.named_modules():
            if isinstance(module, LinearBase):
                module.lora = self.layers[name] = LinearLoRA(
                    self.step, side_of(model, name), shards_of(module), module.input_size, max_loras, dtype, device
                )
        # Checks an adapter's shapes against this model from its safetensors header (read_adapter).
        self.fits = model_fits(model)
        self.slots: list[int | None] = [None] * max_loras  # lora_int_id per slot
        self._slot_parts: list[list[tuple[str, int]]] = [[] for _ in range(max_loras)]
        self._last_used = [0] * max_loras
        self._clock = 0
        self.cpu: OrderedDict[int, list[LayerLoRA]] = OrderedDict()
        self.loads = 0  # adapters read from disk inside the step (without the engine's loader)

    def assign(self, groups: Iterable) -> tuple[dict[str, int], dict[str, str]]:
        """For the step's groups (``ScheduledGroup``s): the slot of each request that
        has an adapter, and why for each request whose adapter cannot be served. The
        second dict is the step's: the forward pass adds to it the requests whose
        adapter's update was not finite, so read it after the forward pass."""
        self._clock += 1
        wanted: dict[int, object] = {}
        for g in groups:
            if g.lora_request is not None:
                wanted.setdefault(g.lora_request.lora_int_id, g.lora_request)
        busy = {i for i in wanted if i in self.slots}  # resident already: never evicted this step
        slot_of_id, why_of_id = {}, {}
        for lora_id, req in wanted.items():
            try:
                slot_of_id[lora_id] = self._resident(req, busy)
                busy.add(lora_id)
            except Exception as e:  # one adapter's fault is its requests', never the step's
                why_of_id[lora_id] = why_failed(req, e)
                logger.warning("%s", why_of_id[lora_id])
        slots, failed = {}, {}
        by_slot: dict[int, list[tuple[str, object]]] = {}
        for g in groups:
            if g.lora_request is None:
                continue
            lora_id = g.lora_request.lora_int_id
            if lora_id in slot_of_id:
                slots[g.request_id] = slot_of_id[lora_id]
                by_slot.setdefault(slot_of_id[lora_id], []).append((g.request_id, g.lora_request))
            else:
                failed[g.request_id] = why_of_id[lora_id]
        self._step_failed, self._step_slots = failed, by_slot
        return slots, failed

    def _on_faults(self, faults: dict[int, str]) -> None:
        """A forward pass's slots whose update was not finite: their requests fail
        (the other requests of the step are served; the engine's health is untouched)."""
        for slot, why in faults.items():
            for request_id, req in self._step_slots.get(slot, []):
                self._step_failed[request_id] = why_failed(req, why)
            if self._step_slots.get(slot):
                logger.warning("%s", why_failed(self._step_slots[slot][0][1], why))

    def _resident(self, req, busy: set[int]) -> int:
        lora_id = req.lora_int_id
        if lora_id in self.slots:
            slot = self.slots.index(lora_id)
            self._last_used[slot] = self._clock
            return slot
        parts = self._loaded(req)
        free = [i for i, held in enumerate(self.slots) if held is None]
        if free:
            slot = free[0]
        else:
            candidates = [i for i, held in enumerate(self.slots) if held not in busy]
            if not candidates:
                raise AdapterError(f"this step already uses max_loras={self.max_loras} other adapters")
            slot = min(candidates, key=lambda i: self._last_used[i])
        self._fill(slot, lora_id, parts)
        self._last_used[slot] = self._clock
        return slot

    def _loaded(self, req) -> list[LayerLoRA]:
        lora_id = req.lora_int_id
        if lora_id in self.cpu:
            self.cpu.move_to_end(lora_id)
            return self.cpu[lora_id]
        folder = resolve_adapter(req.lora_path)
        parts = self.prepare(read_adapter(folder, self.max_rank, self.fits))
        self.loads += 1
        self.cpu[lora_id] = parts
        while len(self.cpu) > self.max_cpu_loras:
            self.cpu.popitem(last=False)
        return parts

    def prepare(self, adapter: PeftLoRA) -> list[LayerLoRA]:
        """The adapter, as read, mapped onto this model's layers and cut to this rank
        (``AdapterError`` when it does not fit the model). Touches no slot and no cache,
        so the engine's loader thread may call it while a step runs."""
        return map_adapter(self.model, adapter, self.dtype)

    def add(self, req, adapter: PeftLoRA | list[LayerLoRA]) -> None:
        """Put ``req``'s adapter into the CPU cache: as read (mapped here), or as
        :meth:`prepare` gave it. The engine evicts (:meth:`drop`); nothing is evicted here."""
        self.cpu[req.lora_int_id] = adapter if isinstance(adapter, list) else self.prepare(adapter)
        self.cpu.move_to_end(req.lora_int_id)

    def drop(self, lora_id: int) -> None:
        """Evict adapter ``lora_id`` from the CPU cache (a slot holding it keeps its copy)."""
        self.cpu.pop(lora_id, None)

    def _fill(self, slot: int, lora_id: int, parts: list[LayerLoRA]) -> None:
        for layer, shard in self._slot_parts[slot]:
            self.layers[layer].set_slot(slot, shard, None, None)
        for p in parts:
            self.layers[p.layer].set_slot(slot, p.shard, p.a, p.b)
        self._slot_parts[slot] = [(p.layer, p.shard) for p in parts]
        self.slots[slot] = lora_id

    def remove(self, lora_id: int) -> bool:
        """Forget adapter ``lora_id`` (its slot and its CPU copy); whether it was loaded."""
        found = self.cpu.pop(lora_id, None) is not None
        if lora_id in self.slots:
            slot = self.slots.index(lora_id)
            self._fill(slot, lora_id, [])
            self.slots[slot] = None
            found = True
        return found
