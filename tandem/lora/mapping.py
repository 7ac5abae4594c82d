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

**Magnitudes.** An adapter is refused when its values could overflow the serving
dtype on inputs of ordinary size (:func:`check_magnitudes`): with ``M`` the dtype's
largest finite value, each module's gains ``gA = max_i sum_j |A_ij|`` and
``gB = max_k sum_i |s B_ki|`` (``s`` its scaling; computed in float64) and their product
must each be at most ``sqrt(M) / 2``. Then for every input with entries up to
``sqrt(M)`` in magnitude (float32 / bfloat16: 1.8e19; float16: 256), every entry of
``x A^T`` is at most ``sqrt(M) gA <= M / 2`` and every entry of the update
``s (x A^T) B^T`` at most ``sqrt(M) gA gB <= M / 2``, the factor 2 covering rounding,
and A and ``s B`` themselves are finite in the dtype. What that cannot promise (inputs
beyond it, or an update that overflows a later layer) is caught per row in the step
(``tandem.lora.layers``).
"""

from __future__ import annotations

import math
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


def check_magnitudes(module: str, a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    """An :class:`AdapterError` unless ``a`` ``[r, in]`` and the scaled ``b`` ``[out, r]``
    pass the module docstring's bound for ``dtype``."""
    limit = math.sqrt(torch.finfo(dtype).max) / 2
    g_a = float(a.double().abs().sum(dim=1).max()) if a.numel() else 0.0
    g_b = float(b.double().abs().sum(dim=1).max()) if b.numel() else 0.0
    name = str(dtype).removeprefix("torch.")
    for what, value in (("lora_A's largest row sum of |values|", g_a),
                        ("the scaled lora_B's largest row sum of |values|", g_b),
                        ("their product (the update's gain)", g_a * g_b)):
        if not value <= limit:  # also NaN
            raise AdapterError(f"module {module!r}: {what} is {value:.3g}, above {limit:.3g} = sqrt(largest "
                               f"{name}) / 2: inputs of ordinary size could overflow {name} in this adapter")


def _layer_of(model: nn.Module, hf_module: str, params: dict, modules: dict):
    """``(layer name, layer, shard)`` of an adapter's module; an :class:`AdapterError`
    when the model has no linear layer of that name."""
    name, shard = resolve_checkpoint_name(model, hf_module + ".weight", params)
    layer_name = name[: -len(".weight")] if name is not None and name.endswith(".weight") else None
    layer = modules.get(layer_name) if layer_name is not None else None
    if not isinstance(layer, LinearBase):
        raise AdapterError(f"target module {hf_module!r}: the model has no linear layer of that name "
                           f"({type(model).__name__} adapts {_examples(modules)} ...)")
    return layer_name, layer, shard


def _full_shape(layer: LinearBase, shard) -> tuple[int, int]:
    """``(out, in)`` of the checkpoint's weight for ``shard`` of ``layer`` (all ranks together)."""
    tp = layer.tp.size
    if isinstance(layer, RowParallelLinear):
        return layer.output_size, layer.input_size * tp
    if isinstance(layer, QKVParallelLinear):
        heads = layer.total_num_heads if _index(shard) == 0 else layer.total_num_kv_heads
        return heads * layer.head_size, layer.input_size
    if isinstance(layer, MergedColumnParallelLinear):
        return layer.output_sizes[_index(shard)], layer.input_size
    return layer.output_size * tp, layer.input_size


def model_fits(model: nn.Module):
    """``fits(module, a_shape, b_shape)`` for ``tandem.lora.adapter.read_adapter``: an
    :class:`AdapterError` for a module the model has no linear layer for, or whose
    shapes are not ``A [r, in]`` and ``B [out, r]`` of that layer's checkpoint weight."""
    params, modules = dict(model.named_parameters()), dict(model.named_modules())

    def fits(hf_module: str, a_shape: tuple[int, int], b_shape: tuple[int, int]) -> None:
        layer_name, layer, shard = _layer_of(model, hf_module, params, modules)
        out, n_in = _full_shape(layer, shard)
        if a_shape[1] != n_in or b_shape[0] != out:
            raise AdapterError(f"module {hf_module!r} does not fit the model's layer {layer_name}: lora_A "
                               f"{tuple(a_shape)}, lora_B {tuple(b_shape)}; its weight is [{out}, {n_in}]")

    return fits


def map_adapter(model: nn.Module, adapter: PeftLoRA, dtype: torch.dtype,
                params: dict | None = None) -> list[LayerLoRA]:
    """The adapter's modules as this rank's parts of the model's layers; an
    :class:`AdapterError` for a module the model has no linear layer for, one whose
    shapes do not fit, or one whose magnitudes could overflow ``dtype``."""
    params = params if params is not None else dict(model.named_parameters())
    modules = dict(model.named_modules())
    out = []
    for hf_module, m in adapter.modules.items():
        layer_name, layer, shard = _layer_of(model, hf_module, params, modules)
        check_magnitudes(hf_module, m.a, m.b * m.scaling, dtype)
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
