"""Where the engine and tests import the block manager from; it lives in
``tandem.core.kv`` (``block_pool.py``: refcounted pools, ``block_manager.py``:
tables, sharing, copy-on-write, swapping)."""

from tandem.core.kv.block_manager import AllocStatus, BlockManager
from tandem.core.kv.block_pool import BlockPool, Device, blocks_for

__all__ = ["AllocStatus", "BlockManager", "BlockPool", "Device", "blocks_for"]
