"""The paged KV pool and the cache managers that decide which pages hold which tokens."""

from minisgl.kvcache.pool import KVCachePool, create_kvcache_pool

__all__ = ["KVCachePool", "create_kvcache_pool"]
