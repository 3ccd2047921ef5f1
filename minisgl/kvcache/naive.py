"""No reuse: every request computes its whole prompt; finished pages go straight back."""

from __future__ import annotations

from typing import Any, List, Sequence, Tuple

from minisgl.kvcache.base import CACHE_MANAGERS, BaseCacheManager, MatchResult


@CACHE_MANAGERS.register("naive")
class NaiveCacheManager(BaseCacheManager):
    def match_prefix(self, token_ids: Sequence[int]) -> MatchResult:
        return MatchResult(None, [])

    def unlock(self, handle: Any) -> None:
        pass

    def insert(self, token_ids: Sequence[int], pages: List[int]) -> Tuple[List[int], int]:
        return list(pages), 0

    def evict(self, num_pages: int) -> List[int]:
        return []

    @property
    def evictable_pages(self) -> int:
        return 0

    @property
    def cached_pages(self) -> int:
        return 0
