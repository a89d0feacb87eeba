"""The paged KV cache: block accounting (BlockManager) and the tensors (KVCache)."""

from lmserve.kv.block_manager import BlockManager, BlockStats
from lmserve.kv.cache import KVCache

__all__ = ["BlockManager", "BlockStats", "KVCache"]
