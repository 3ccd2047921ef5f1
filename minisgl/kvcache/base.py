"""The cache-manager interface: which KV pages may be shared between requests.

A manager holds pages of finished requests keyed by their token ids. `match_prefix` finds the
longest cached page-aligned prefix of a prompt and returns a handle that pins those pages while a
request uses them; `insert` hands a finished request's pages to the cache (returning the pages it
did not need: duplicates of pages already cached); `evict` gives unpinned pages back.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, List, Sequence, Tuple

from minisgl.utils.registry import Registry


@dataclass
class MatchResult:
    handle: Any  # pass back to unlock(); None when nothing matched
    pages: List[int]  # cached pages holding the matched prefix, in order

    @property
    def num_pages(self) -> int:
        return len(self.pages)


class BaseCacheManager(ABC):
    def __init__(self, page_size: int) -> None:
        self.page_size = page_size

    @abstractmethod
    def match_prefix(self, token_ids: Sequence[int]) -> MatchResult: ...

    @abstractmethod
    def unlock(self, handle: Any) -> None: ...

    @abstractmethod
    def insert(self, token_ids: Sequence[int], pages: List[int]) -> Tuple[List[int], int]:
        """Cache full pages of `token_ids` (len == len(pages) * page_size). Returns (pages the
        cache did not take and the caller must free, number of pages newly cached)."""

    @abstractmethod
    def evict(self, num_pages: int) -> List[int]:
        """Release up to `num_pages` unpinned cached pages (least recently used first)."""

    @property
    @abstractmethod
    def evictable_pages(self) -> int: ...

    @property
    @abstractmethod
    def cached_pages(self) -> int: ...

    def reset(self) -> List[int]:
        """Drop everything unpinned; returns the released pages."""
        return self.evict(self.evictable_pages)


CACHE_MANAGERS: Registry[type] = Registry("cache manager")
