"""One loader for every model: checkpoint ``(name, tensor)`` pairs into parameters.

Each parameter carries a ``weight_loader(param, loaded_weight, shard_id=None)``
that knows its layout (which rows or columns this tensor-parallel rank keeps,
where a packed projection's shards go); parameters and buffers without one get
:func:`default_weight_loader`. The model says how checkpoint names map onto its
own with two class attributes, read by :func:`load_checkpoint`:

- ``packed_modules_mapping``: ``{"qkv_proj": ["q_proj", "k_proj", "v_proj"]}``:
  a checkpoint tensor of module ``q_proj`` goes into shard 0 of the sibling
  module ``qkv_proj`` (when the model has one there), ``k_proj`` into shard 1...
- ``hf_to_tandem_name(name) -> str | None``: renames (prefixes, tied weights)
  applied first; None drops the tensor.

Before a tensor is copied, :func:`check_weight_values` refuses one the copy would
change silently: an integer or bool tensor for a floating-point parameter (or the
reverse), a value beyond the range of the parameter's dtype (a float32 70000
into float16 would become inf), and NaN or inf. The value scan is one
``torch.aminmax`` per tensor (about 50 ms for a bart-base-sized checkpoint on
two CPU cores); ``TANDEM_SKIP_WEIGHT_CHECKS=1`` skips it, keeping the dtype check.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable

import torch
from torch import nn

logger = logging.getLogger(__name__)

WeightLoader = Callable[..., None]

# Set to 1 to skip the NaN / inf / range scan of every checkpoint tensor (the dtype check stays).
SKIP_CHECKS_ENV = "TANDEM_SKIP_WEIGHT_CHECKS"


def _skip_value_checks() -> bool:
    return os.environ.get(SKIP_CHECKS_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def _kind(dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "bool"
    if dtype.is_complex:
        return "complex"
    return "float" if dtype.is_floating_point else "int"


def _range(dtype: torch.dtype) -> tuple[float, float]:
    info = torch.finfo(dtype) if dtype.is_floating_point else torch.iinfo(dtype)
    return float(info.min), float(info.max)


def check_weight_values(loaded_weight: torch.Tensor, dtype: torch.dtype) -> None:
    """Raise ``ValueError`` unless ``loaded_weight`` can be copied into a ``dtype`` tensor
    without a silent change: its kind must match (float into float, integer into integer;
    an integer or bool tensor where floats are expected is a broken checkpoint), and,
    unless ``$TANDEM_SKIP_WEIGHT_CHECKS`` is set, it must hold no NaN or inf and no value
    beyond ``dtype``'s range. One pass over the tensor (``torch.aminmax``, NaN propagates)."""
    src = loaded_weight.dtype
    if _kind(src) != _kind(dtype) and not (_kind(src) == "bool" and dtype == torch.bool):
        raise ValueError(
            f"has dtype {str(src).removeprefix('torch.')}, which cannot be cast exactly to the "
            f"parameter's {str(dtype).removeprefix('torch.')}"
        )
    if _kind(src) not in ("float", "int") or loaded_weight.numel() == 0 or _skip_value_checks():
        return
    t = loaded_weight
    if src.is_floating_point and src.itemsize == 1:  # float8: aminmax has no kernel for it
        t = t.float()
    lo, hi = (float(v) for v in torch.aminmax(t))
    if src.is_floating_point and not (abs(lo) < float("inf") and abs(hi) < float("inf")):
        bad = "NaN" if lo != lo or hi != hi else "inf"
        raise ValueError(f"holds {bad} values (set {SKIP_CHECKS_ENV}=1 to skip this check)")
    low, high = _range(dtype)
    if lo < low or hi > high:
        value = hi if hi > high else lo
        raise ValueError(
            f"holds {value:g}, beyond the range of the parameter's {str(dtype).removeprefix('torch.')} "
            f"([{low:g}, {high:g}]): load the model in a wider dtype (e.g. dtype='float32')"
        )


class WeightShapeError(ValueError):
    """A checkpoint tensor whose shape is not the one the parameter expects."""

    def __init__(self, got: tuple[int, ...], expected: tuple[int, ...]) -> None:
        super().__init__(f"has shape {got}, expected {expected}")
        self.got, self.expected = got, expected


def check_shape(loaded_weight: torch.Tensor, expected: tuple[int, ...] | torch.Size) -> None:
    """Raise :class:`WeightShapeError` unless ``loaded_weight`` has the full checkpoint shape
    ``expected`` (the unsharded one: ranks slice after checking)."""
    if tuple(loaded_weight.shape) != tuple(expected):
        raise WeightShapeError(tuple(loaded_weight.shape), tuple(expected))


@torch.no_grad()
def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor, shard_id=None) -> None:
    """Copy a whole, replicated tensor (norms, position tables, buffers)."""
    if shard_id is not None:
        raise ValueError(f"shard_id={shard_id!r} given for a parameter that is not packed")
    check_shape(loaded_weight, param.shape)
    param.data.copy_(loaded_weight)


class WeightLoaderModule(nn.Module):
    """Base of layers whose parameters carry their ``weight_loader`` method.

    ``Module.to_empty`` (how the loader leaves the meta device) and device moves make
    new ``Parameter`` objects, dropping attributes; ``_apply`` binds them again, so
    ``param.weight_loader`` is there whenever the checkpoint is streamed in.
    """

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        raise NotImplementedError

    def bind_weight_loaders(self) -> None:
        for param in self.parameters(recurse=False):
            param.weight_loader = self.weight_loader

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        self.bind_weight_loaders()
        return out


def load_checkpoint(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """Stream ``weights`` into ``model``'s parameters and buffers; return the names filled.

    Tensors whose name maps to nothing are skipped (heads of other task variants).
    Raises ``ValueError`` naming the checkpoint tensor on a shape mismatch, on a dtype or
    value the copy would change silently (:func:`check_weight_values`), and naming
    the weights still missing at the end (each packed shard by its checkpoint name, so a
    missing ``v_proj`` is reported rather than leaving a third of ``qkv_proj`` unset).
    Buffers are optional: the model fills the absent ones before calling this.
    """
    packed: dict[str, list[str]] = dict(getattr(model, "packed_modules_mapping", {}) or {})
    rename = getattr(model, "hf_to_tandem_name", None) or (lambda name: name)
    params = dict(model.named_parameters())
    targets = {**dict(model.named_buffers()), **params}
    loaded: set[str] = set()
    for hf_name, tensor in weights:
        name = rename(hf_name)
        if name is None:
            continue
        name, shard_id = _resolve(name, targets, packed)
        target = targets.get(name)
        if target is None:
            logger.debug("checkpoint tensor %r has no target in the model; skipped", hf_name)
            continue
        loader: WeightLoader = getattr(target, "weight_loader", default_weight_loader)
        try:
            check_weight_values(tensor, target.dtype)
            if shard_id is None:
                loader(target, tensor)
            else:
                loader(target, tensor, shard_id)
        except WeightShapeError as e:
            raise ValueError(
                f"checkpoint tensor {hf_name!r} has shape {e.got}, expected {e.expected}"
            ) from None
        except ValueError as e:
            raise ValueError(f"checkpoint tensor {hf_name!r}: {e}") from e
        loaded.add(name if shard_id is None else f"{name}#{shard_id}")
    missing = []
    for name in params:
        subs = packed.get(_module_of(name))
        if subs is None:
            if name not in loaded:
                missing.append(name)
            continue
        missing.extend(_rename_module(name, sub) for i, sub in enumerate(subs) if f"{name}#{i}" not in loaded)
    if missing:
        missing.sort()
        shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
        raise ValueError(f"checkpoint is missing {len(missing)} weights: {shown}")
    return {name.partition("#")[0] for name in loaded}


def resolve_checkpoint_name(model: nn.Module, hf_name: str, params: dict | None = None) -> tuple[str | None, int | None]:
    """Where :func:`load_checkpoint` puts checkpoint tensor ``hf_name``: (the model's
    parameter name, its shard of a packed module or None); (None, None) when the model
    drops the name. LoRA adapters name their modules as checkpoints do and map this way.
    ``params``: ``dict(model.named_parameters())``, when the caller has it."""
    rename = getattr(model, "hf_to_tandem_name", None) or (lambda name: name)
    name = rename(hf_name)
    if name is None:
        return None, None
    packed = dict(getattr(model, "packed_modules_mapping", {}) or {})
    return _resolve(name, params if params is not None else dict(model.named_parameters()), packed)


def _module_of(name: str) -> str:
    """``a.b.qkv_proj.weight`` -> ``qkv_proj``."""
    parts = name.rsplit(".", 2)
    return parts[-2] if len(parts) > 1 else ""


def _rename_module(name: str, module: str) -> str:
    head, _, leaf = name.rpartition(".")
    return f"{head.rpartition('.')[0]}.{module}.{leaf}".lstrip(".")


def _resolve(name: str, targets: dict, packed: dict[str, list[str]]) -> tuple[str, int | None]:
    """The target name and shard index of a checkpoint name: a packed module's sibling
    when the model has one (``self_attn.k_proj.weight`` -> ``self_attn.qkv_proj.weight``,
    shard 1), else the name itself."""
    module = _module_of(name)
    for packed_name, subs in packed.items():
        if module in subs:
            candidate = _rename_module(name, packed_name)
            if candidate in targets:
                return candidate, subs.index(module)
    return name, None
