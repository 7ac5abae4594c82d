"""Executors: what runs the model for the engine core (``base.Executor``), picked by
``distributed_executor_backend``: None (in-process), ``"mp"`` (worker processes),
``"ray"`` (Ray actors)."""

from __future__ import annotations

import importlib

from tandem.core.executor.base import Executor, KVPools, WorkerSpec

# name -> "module:class", imported when chosen (Ray is an optional dependency).
EXECUTORS: dict[str | None, str] = {
    None: "tandem.core.executor.uniproc:UniProcExecutor",
    "mp": "tandem.core.executor.multiproc:MultiprocExecutor",
    "ray": "tandem.core.executor.ray_executor:RayExecutor",
}


def executor_class(name: str | None) -> type[Executor]:
    """The executor class for a ``distributed_executor_backend`` value."""
    if name not in EXECUTORS:
        known = ", ".join(repr(k) for k in EXECUTORS)
        raise ValueError(f"distributed_executor_backend={name!r}: must be one of {known}")
    module, cls = EXECUTORS[name].split(":")
    return getattr(importlib.import_module(module), cls)


__all__ = ["EXECUTORS", "Executor", "KVPools", "WorkerSpec", "executor_class"]
