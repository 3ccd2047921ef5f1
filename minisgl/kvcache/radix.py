"""A radix tree over token ids at page granularity: shared prompt prefixes reuse KV pages.

Each edge holds a run of whole pages (its key is their token ids). A request pins the path it
matched (reference counts propagate to the root), so pinned pages are never evicted; unpinned
leaves are evicted least-recently-used first when the pool runs out.

With a KVEventRecorder attached (`events`, for --kv-events-endpoint), every node also keeps the
chained hashes of its pages (kvcache/events.py), and inserts, evictions and resets are recorded as
KV events; without one, no hash is computed.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Any, Dict, List, Sequence, Tuple

from minisgl.kvcache.base import CACHE_MANAGERS, BaseCacheManager, MatchResult
from minisgl.kvcache.events import KVEventRecorder


class _Node:
    __slots__ = ("key", "pages", "children", "parent", "ref", "last_access", "hashes")

    def __init__(self, key: Tuple[int, ...], pages: List[int], parent: "_Node | None", ref: int = 0) -> None:
        self.key = key
        self.pages = pages
        self.children: Dict[Tuple[int, ...], _Node] = {}
        self.parent = parent
        self.ref = ref
        self.last_access = 0
        self.hashes: List[int] = []  # one per page, only while KV events are recorded


@CACHE_MANAGERS.register("radix")
class RadixCacheManager(BaseCacheManager):
    def __init__(self, page_size: int) -> None:
        super().__init__(page_size)
        self.root = _Node((), [], None, ref=1)  # the root is never evictable
        self._evictable = 0
        self._total = 0
        self._clock = itertools.count(1)
        self.events: KVEventRecorder | None = None  # set before the first insert

    # ---- helpers -------------------------------------------------------------------------------
    def _page_key(self, ids: Sequence[int], page: int) -> Tuple[int, ...]:
        ps = self.page_size
        return tuple(ids[page * ps : (page + 1) * ps])

    def _common_pages(self, node: _Node, ids: Sequence[int], start_page: int, max_pages: int) -> int:
        ps = self.page_size
        n = min(len(node.pages), max_pages - start_page)
        m = 0
        while m < n and tuple(node.key[m * ps : (m + 1) * ps]) == self._page_key(ids, start_page + m):
            m += 1
        return m

    def _split(self, node: _Node, m: int) -> _Node:
        """Split `node` after its first m pages; returns the new upper node."""
        ps = self.page_size
        assert node.parent is not None and 0 < m < len(node.pages)
        upper = _Node(node.key[: m * ps], node.pages[:m], node.parent, ref=node.ref)
        upper.last_access = node.last_access
        node.parent.children[node.key[:ps]] = upper
        node.key, node.pages, node.parent = node.key[m * ps :], node.pages[m:], upper
        if node.hashes:  # (only with KV events)
            upper.hashes, node.hashes = node.hashes[:m], node.hashes[m:]
        upper.children[node.key[:ps]] = node
        return upper

    def _walk(self, ids: Sequence[int]) -> Tuple[_Node, List[int], int]:
        """Deepest node fully matching a page-aligned prefix of ids; its pages; matched page count."""
        num_pages = len(ids) // self.page_size
        node, pages, i = self.root, [], 0
        stamp = next(self._clock)
        while i < num_pages:
            child = node.children.get(self._page_key(ids, i))
            if child is None:
                break
            m = self._common_pages(child, ids, i, num_pages)
            if m < len(child.pages):
                child = self._split(child, m)
            child.last_access = stamp
            pages.extend(child.pages)
            node, i = child, i + m
        return node, pages, i

    def _add_ref(self, node: _Node, delta: int) -> None:
        while node is not self.root:
            if node.ref == 0 and delta > 0:
                self._evictable -= len(node.pages)
            node.ref += delta
            if node.ref == 0:
                self._evictable += len(node.pages)
            assert node.ref >= 0, "radix cache: unlock without lock"
            node = node.parent  # type: ignore[assignment]

    # ---- interface -----------------------------------------------------------------------------
    def match_prefix(self, token_ids: Sequence[int]) -> MatchResult:
        node, pages, _ = self._walk(token_ids)
        if node is self.root:
            return MatchResult(None, [])
        self._add_ref(node, +1)
        return MatchResult(node, pages)

    def unlock(self, handle: Any) -> None:
        if handle is not None:
            self._add_ref(handle, -1)

    def insert(self, token_ids: Sequence[int], pages: List[int]) -> Tuple[List[int], int]:
        assert len(token_ids) == len(pages) * self.page_size
        node, cached, i = self._walk(token_ids)
        duplicates = [p for p, c in zip(pages[:i], cached) if p != c]
        if i == len(pages):
            return duplicates, 0
        leaf = _Node(tuple(token_ids[i * self.page_size :]), list(pages[i:]), node)
        leaf.last_access = next(self._clock)
        node.children[leaf.key[: self.page_size]] = leaf
        if self.events is not None:
            leaf.hashes = self.events.stored(node.hashes[-1] if node.hashes else None, leaf.key)
        self._evictable += len(leaf.pages)
        self._total += len(leaf.pages)
        return duplicates, len(leaf.pages)

    def evict(self, num_pages: int) -> List[int]:
        if num_pages <= 0:
            return []
        heap = [(n.last_access, id(n), n) for n in self._leaves() if n.ref == 0]
        heapq.heapify(heap)
        freed: List[int] = []
        while heap and len(freed) < num_pages:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            assert parent is not None
            del parent.children[node.key[: self.page_size]]
            freed.extend(node.pages)
            if self.events is not None:
                self.events.removed(node.hashes)
            self._evictable -= len(node.pages)
            self._total -= len(node.pages)
            if parent is not self.root and not parent.children and parent.ref == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def reset(self) -> List[int]:
        events = self.events
        if events is None or self._evictable != self._total:
            return self.evict(self._evictable)  # (some pages pinned: each dropped node is named)
        self.events = None  # everything goes: one AllBlocksCleared instead of a BlockRemoved per node
        try:
            freed = self.evict(self._evictable)
        finally:
            self.events = events
        events.cleared()
        return freed

    def _leaves(self) -> List[_Node]:
        out, stack = [], [self.root]
        while stack:
            n = stack.pop()
            if n.children:
                stack.extend(n.children.values())
            elif n is not self.root:
                out.append(n)
        return out

    @property
    def evictable_pages(self) -> int:
        return self._evictable

    @property
    def cached_pages(self) -> int:
        return self._total
