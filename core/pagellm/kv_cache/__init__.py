from pagellm.kv_cache.block_pool import BlockPool, KVCacheBlock
from pagellm.kv_cache.hashing import make_block_hasher
from pagellm.kv_cache.manager import KVCacheManager
from pagellm.kv_cache.spec import KVCacheSpec

__all__ = ["BlockPool", "KVCacheBlock", "KVCacheManager", "KVCacheSpec", "make_block_hasher"]
