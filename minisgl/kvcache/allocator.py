"""Free-list allocator over the KV pool's pages (page ids 0..num_pages-1; the dummy page is not here)."""

from __future__ import annotations

from typing import List


class PageAllocator:
    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        # A stack: recently freed (cache-warm) pages are reused first.
        self._free: List[int] = list(range(num_pages - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> List[int]:
        if n > len(self._free):
            raise MemoryError(f"asked for {n} KV pages, {len(self._free)} free")
        if n == 0:
            return []
        out = self._free[-n:]
        del self._free[-n:]
        return out

    def free(self, pages: List[int]) -> None:
        self._free.extend(pages)
