"""The paged KV pool, the page allocator and the cache managers that share pages across requests."""

from minisgl.kvcache.allocator import PageAllocator
from minisgl.kvcache.base import CACHE_MANAGERS, BaseCacheManager, MatchResult
from minisgl.kvcache.naive import NaiveCacheManager
from minisgl.kvcache.pool import KVCachePool, create_kvcache_pool
from minisgl.kvcache.radix import RadixCacheManager


def create_cache_manager(name: str, page_size: int) -> BaseCacheManager:
    return CACHE_MANAGERS.get(name)(page_size)


__all__ = [
    "PageAllocator",
    "BaseCacheManager",
    "MatchResult",
    "NaiveCacheManager",
    "RadixCacheManager",
    "KVCachePool",
    "create_kvcache_pool",
    "create_cache_manager",
    "CACHE_MANAGERS",
]
