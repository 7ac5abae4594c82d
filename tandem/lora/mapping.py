"""PEFT module names onto a model's (fused, tensor-parallel) linear layers.

An adapter names its modules as the HF checkpoint does (``...self_attn.q_proj``,
T5's ``...SelfAttention.q``); the model's own weight mapping
(``hf_to_tandem_name`` + ``packed_modules_mapping``, through
:func:`resolve_checkpoint_name`) says which layer and which shard of it each one
is, so there is no second table. This rank's part of ``A`` and ``B`` is cut by
the layer's own ``weight_loader``, as the base weight's is.

Which tokens a layer reads: encoder tokens for the encoder's layers and for a
cross-attention's K/V projection (``kv_proj``, fed the encoder output), decoder
tokens otherwise. A model whose layers differ declares ``lora_encoder_side(name)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tandem.core.layers.linear import LinearBase, MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from tandem.core.weight_loading import WeightShapeError, resolve_checkpoint_name
from tandem.lora.adapter import AdapterError, PeftLoRA
from tandem.lora.layers import DECODER, ENCODER


def shards_of(layer: LinearBase) -> list[tuple[int, int]]:
    """``(offset, size)`` in this rank's output of each checkpoint shard of ``layer``."""
    if isinstance(layer, QKVParallelLinear):
        q, kv = layer.q_size, layer.kv_size
        return [(0, q), (q, kv), (q + kv, kv)]
    if isinstance(layer, MergedColumnParallelLinear):
        sizes, out, offset = layer.output_partition_sizes, [], 0
        for size in sizes:
            out.append((offset, size))
            offset += size
        return out
    return [(0, layer.output_size)]


def side_of(model: nn.Module, name: str) -> str:
    declared = getattr(model, "lora_encoder_side", None)
    if declared is not None:
        return ENCODER if declared(name) else DECODER
    parts = name.split(".")
    return ENCODER if "encoder" in parts or parts[-1] == "kv_proj" else DECODER


@dataclass
class LayerLoRA:
    """One shard of one layer's adapter, this rank's part: ``a`` ``[r, in]``, ``b``
    ``[size, r]`` with the scaling folded in, in the serving dtype."""

    layer: str
    shard: int
    a: torch.Tensor
    b: torch.Tensor


def map_adapter(model: nn.Module, adapter: PeftLoRA, dtype: torch.dtype,
                params: dict | None = None) -> list[LayerLoRA]:
    """The adapter's modules as this rank's parts of the model's layers; an
    :class:`AdapterError` for a module the model has no linear layer for, or one whose
    shapes do not fit."""
    params = params if params is not None else dict(model.named_parameters())
    modules = dict(model.named_modules())
    out = []
    for hf_module, m in adapter.modules.items():
        name, shard = resolve_checkpoint_name(model, hf_module + ".weight", params)
        layer_name = name[: -len(".weight")] if name is not None and name.endswith(".weight") else None
        layer = modules.get(layer_name) if layer_name is not None else None
        if not isinstance(layer, LinearBase):
            raise AdapterError(f"target module {hf_module!r}: the model has no linear layer of that name "
                               f"({type(model).__name__} adapts {_examples(modules)} ...)")
        shard_index = 0 if shard is None else _index(shard)
        try:
            a, b = _this_rank(layer, m.a, m.b * m.scaling, shard)
        except WeightShapeError as e:
            raise AdapterError(f"module {hf_module!r} does not fit the model's layer {layer_name}: lora_A "
                               f"{tuple(m.a.shape)}, lora_B {tuple(m.b.shape)} ({e})") from None
        out.append(LayerLoRA(layer_name, shard_index, a.to(dtype), b.to(dtype)))
    return out


def _examples(modules: dict) -> str:
    names = [n for n, mod in modules.items() if isinstance(mod, LinearBase)]
    return ", ".join(names[:3])


def _this_rank(layer: LinearBase, a: torch.Tensor, b: torch.Tensor, shard) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's ``a`` ``[r, in_local]`` and ``b`` ``[size_local, r]``, cut (and checked)
    by the layer's weight loader as its weight would be."""
    r = a.shape[0]
    if isinstance(layer, RowParallelLinear):
        a_local = torch.empty(r, layer.input_size, dtype=a.dtype)
        layer.weight_loader(a_local, a)  # this rank's input columns
        if tuple(b.shape) != (layer.output_size, r):
            raise WeightShapeError(tuple(b.shape), (layer.output_size, r))
        return a_local, b
    if tuple(a.shape) != (r, layer.input_size):
        raise WeightShapeError(tuple(a.shape), (r, layer.input_size))
    full = torch.zeros(layer.output_size, r, dtype=b.dtype)
    if shard is None:
        layer.weight_loader(full, b)
    else:
        layer.weight_loader(full, b, shard)
    offset, size = shards_of(layer)[0 if shard is None else _index(shard)]
    return a, full[offset: offset + size]


def _index(shard) -> int:
    return QKVParallelLinear.SHARDS.index(shard) if isinstance(shard, str) else shard
