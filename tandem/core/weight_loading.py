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
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import torch
from torch import nn

logger = logging.getLogger(__name__)

WeightLoader = Callable[..., None]


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
    Raises ``ValueError`` naming the checkpoint tensor on a shape mismatch, and naming
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
