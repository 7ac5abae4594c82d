"""KV blocks: refcounted pools per device and the manager of block tables.

The names load on first use, so that importing ``tandem.core.kv.cache_ops`` (as
the attention interface does) does not import the block manager and the
scheduler state it works on.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tandem.core.kv.block_manager import AllocStatus, BlockManager
    from tandem.core.kv.block_pool import BlockPool, Device, blocks_for

_LAZY = {
    "AllocStatus": "tandem.core.kv.block_manager",
    "BlockManager": "tandem.core.kv.block_manager",
    "BlockPool": "tandem.core.kv.block_pool",
    "Device": "tandem.core.kv.block_pool",
    "blocks_for": "tandem.core.kv.block_pool",
}

__all__ = ["AllocStatus", "BlockManager", "BlockPool", "Device", "blocks_for"]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
