"""Unit tests of the page allocator and the cache managers (no model): matching at page
granularity, pinning, duplicate pages on insert, node splits, LRU eviction, reset, and a
randomised simulation of the scheduler's use that checks page conservation and that every
matched page really holds the tokens it is matched for."""

from __future__ import annotations

import random
from typing import Dict, List, Tuple

import pytest

from minisgl.kvcache import NaiveCacheManager, PageAllocator, RadixCacheManager, create_cache_manager


def _ids(n: int, seed: int, vocab: int = 50) -> List[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


# ---------------------------------------------------------------------------------------------
# PageAllocator
# ---------------------------------------------------------------------------------------------


def test_page_allocator_alloc_free_and_errors():
    alloc = PageAllocator(8)
    assert alloc.num_pages == 8 and alloc.num_free == 8
    assert alloc.alloc(0) == []
    a = alloc.alloc(3)
    b = alloc.alloc(5)
    assert sorted(a + b) == list(range(8)) and alloc.num_free == 0
    with pytest.raises(MemoryError, match="asked for 1 KV pages, 0 free"):
        alloc.alloc(1)
    alloc.free(a)
    assert alloc.num_free == 3
    again = alloc.alloc(3)
    assert sorted(again) == sorted(a)  # recently freed pages are reused first
    with pytest.raises(MemoryError):
        alloc.alloc(1)
    alloc.free(again + b)
    assert sorted(alloc.alloc(8)) == list(range(8))


def test_registry_and_naive_manager():
    assert isinstance(create_cache_manager("radix", 2), RadixCacheManager)
    naive = create_cache_manager("naive", 1)
    assert isinstance(naive, NaiveCacheManager)
    m = naive.match_prefix([1, 2, 3])
    assert m.handle is None and m.pages == [] and m.num_pages == 0
    naive.unlock(m.handle)
    assert naive.insert([1, 2, 3], [7, 8, 9]) == ([7, 8, 9], 0)
    assert naive.evict(5) == [] and naive.reset() == []
    assert naive.cached_pages == naive.evictable_pages == 0
    with pytest.raises(ValueError):
        create_cache_manager("nope", 1)


# ---------------------------------------------------------------------------------------------
# RadixCacheManager
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 4])
def test_radix_match_is_page_aligned_and_pins(page_size):
    ps = page_size
    cache = RadixCacheManager(ps)
    ids = _ids(8 * ps, seed=1)
    pages = list(range(100, 108))
    assert cache.insert(ids, pages) == ([], 8)
    assert cache.cached_pages == cache.evictable_pages == 8

    # a partial trailing page never matches; a prefix that ends mid-page matches the full pages
    m = cache.match_prefix(ids[: 5 * ps + ps - 1] if ps > 1 else ids[:5])
    assert m.pages == pages[:5]
    assert cache.evictable_pages == 3  # the matched 5 pages are pinned
    assert cache.evict(8) == pages[5:]  # only the unpinned tail can go
    assert cache.cached_pages == 5 and cache.evictable_pages == 0
    cache.unlock(m.handle)
    assert cache.evictable_pages == 5
    assert sorted(cache.reset()) == pages[:5]
    assert cache.cached_pages == 0 and cache.match_prefix(ids).pages == []

    # a divergent token inside the first page: no match at all
    cache.insert(ids, pages)
    other = list(ids)
    other[ps - 1] += 1
    m = cache.match_prefix(other)
    assert m.handle is None and m.pages == []
    cache.unlock(m.handle)


@pytest.mark.parametrize("page_size", [1, 2])
def test_radix_insert_returns_duplicates_and_splits(page_size):
    ps = page_size
    cache = RadixCacheManager(ps)
    a = _ids(6 * ps, seed=2)
    b = a[: 3 * ps] + _ids(4 * ps, seed=3, vocab=1000)  # shares 3 pages with a, then diverges
    assert cache.insert(a, [0, 1, 2, 3, 4, 5]) == ([], 6)
    # b's first 3 pages were computed again in other pages (10, 11, 12): those are duplicates
    dup, new = cache.insert(b, [10, 11, 12, 13, 14, 15, 16])
    assert sorted(dup) == [10, 11, 12] and new == 4
    assert cache.cached_pages == 10 and cache.evictable_pages == 10
    assert cache.match_prefix(a).pages == [0, 1, 2, 3, 4, 5]
    assert cache.match_prefix(b).pages == [0, 1, 2, 13, 14, 15, 16]
    # the same pages inserted again: nothing is a duplicate, nothing new
    assert cache.insert(a, [0, 1, 2, 3, 4, 5]) == ([], 0)
    # a sub-prefix match splits a node; counts are unchanged and both branches still match
    m = cache.match_prefix(a[: 2 * ps])
    assert m.pages == [0, 1]
    assert cache.cached_pages == 10
    cache.unlock(m.handle)
    cache2 = RadixCacheManager(ps)
    cache2.insert(a, list(range(6)))
    h1 = cache2.match_prefix(a)
    h2 = cache2.match_prefix(a[: 3 * ps])  # splits the pinned node: refs must carry over
    assert cache2.evictable_pages == 0
    cache2.unlock(h1.handle)
    assert cache2.evictable_pages == 3  # the lower half is free, the upper still pinned by h2
    assert sorted(cache2.evict(6)) == [3, 4, 5]
    cache2.unlock(h2.handle)
    assert sorted(cache2.reset()) == [0, 1, 2]


def test_radix_unlock_without_lock_is_caught():
    cache = RadixCacheManager(1)
    cache.insert([1, 2, 3], [0, 1, 2])
    m = cache.match_prefix([1, 2, 3])
    cache.unlock(m.handle)
    with pytest.raises(AssertionError):
        cache.unlock(m.handle)


def test_radix_lru_eviction_order_and_cascade():
    cache = RadixCacheManager(1)
    shared = [9, 9, 9]
    x, y, z = shared + [1, 1], shared + [2, 2], [5, 5, 5]
    cache.insert(x, [0, 1, 2, 3, 4])
    cache.insert(y, [10, 11, 12, 5, 6])  # shares [9, 9, 9] with x: pages 10-12 are duplicates
    cache.insert(z, [7, 8, 13])
    cache.unlock(cache.match_prefix(x).handle)  # touch x, then z: y is the least recently used
    cache.unlock(cache.match_prefix(z).handle)
    assert cache.evict(1) == [5, 6]  # y's leaf (least recently used) goes first, whole node
    m = cache.match_prefix(y)
    assert m.pages == [0, 1, 2]  # y's own pages are gone, the shared prefix stays
    cache.unlock(m.handle)
    cache.unlock(cache.match_prefix(z).handle)  # z is now more recent than the shared node
    freed = cache.evict(3)  # x's leaf, then the shared node once it became a leaf (older than z)
    assert freed == [3, 4, 0, 1, 2]
    assert cache.cached_pages == 3 and cache.match_prefix(z).pages == [7, 8, 13]


def test_radix_randomised_against_page_contents():
    """Simulate the scheduler: requests match, allocate the rest, 'write' their tokens into the
    pages, insert on finish, unlock, evict under pressure. Invariants at every step:
    free + cached + held == all pages; every matched page holds exactly the matched tokens;
    evictable == cached when nothing is pinned."""
    rng = random.Random(0)
    for page_size in (1, 3):
        num_pages = 40
        alloc = PageAllocator(num_pages)
        cache = RadixCacheManager(page_size)
        content: Dict[int, Tuple[int, ...]] = {}  # page -> the tokens written into it
        prefixes = [_ids(rng.randint(0, 30), seed=100 + i, vocab=4) for i in range(5)]
        running: List[Tuple[List[int], List[int], object]] = []  # (ids, pages, handle)

        for step in range(400):
            if running and (rng.random() < 0.45 or len(running) > 5):
                ids, pages, handle = running.pop(rng.randrange(len(running)))
                full = len(ids) // page_size
                dup, _ = cache.insert(ids[: full * page_size], pages[:full])
                cache.unlock(handle)
                alloc.free(dup + pages[full:])
            else:
                base = rng.choice(prefixes)
                ids = base + _ids(rng.randint(1, 25), seed=rng.randrange(10**9), vocab=4)
                m = cache.match_prefix(ids[:-1])
                for i, pg in enumerate(m.pages):
                    assert content[pg] == tuple(ids[i * page_size : (i + 1) * page_size]), "matched a page with other tokens"
                need = -(-len(ids) // page_size) - m.num_pages
                if need > alloc.num_free:
                    alloc.free(cache.evict(need - alloc.num_free))
                if need > alloc.num_free:
                    cache.unlock(m.handle)  # no room: the request waits (dropped here)
                    continue
                new = alloc.alloc(need)
                pages = m.pages + new
                for i, pg in enumerate(new, start=m.num_pages):
                    content[pg] = tuple(ids[i * page_size : (i + 1) * page_size])
                running.append((ids, pages, m.handle))
            # conservation: every page is free, cached, or privately held by a running request
            private = [pg for ids_, p, h in running for pg in p[_matched_pages(h) :]]
            everything = list(alloc._free) + private + _tree_pages(cache)
            assert sorted(everything) == list(range(num_pages)), f"page leak or double use at step {step}"
        for _ids_unused, pages, handle in running:
            cache.unlock(handle)
            alloc.free(pages[_matched_pages(handle) :])
        running.clear()
        assert cache.evictable_pages == cache.cached_pages
        alloc.free(cache.reset())
        assert alloc.num_free == num_pages and cache.cached_pages == 0


def _tree_pages(cache: RadixCacheManager) -> List[int]:
    out, stack = [], [cache.root]
    while stack:
        node = stack.pop()
        out += node.pages
        stack.extend(node.children.values())
    return out


def _matched_pages(handle) -> int:
    n = 0
    while handle is not None and handle.parent is not None:
        n += len(handle.pages)
        handle = handle.parent
    return n
