"""KV blocks: refcounted pools per device and the manager of block tables."""

from tandem.core.kv.block_manager import AllocStatus, BlockManager
from tandem.core.kv.block_pool import BlockPool, Device, blocks_for

__all__ = ["AllocStatus", "BlockManager", "BlockPool", "Device", "blocks_for"]
