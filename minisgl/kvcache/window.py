"""Window-aware KV pages for models with sliding-window layers (Gemma 2/3, GPT-OSS).

A sliding layer's query at position p reads keys at positions > p - window only, so its K/V of a
token is dead once the request's end is `window` tokens further. The hybrid pool keeps the
global layers' K/V per token in the main pool, as every model does, and the sliding layers' K/V
in a second, smaller pool of *window pages*. Each main page that has sliding K/V owns one window
page of the same size; the *translation* (main slot -> window slot, one device tensor:
`HybridKVCachePool.translation`) is what every reader of a sliding layer goes through (the page
table still maps positions to main slots).

Who owns what:
- `HybridPageAllocator` (the scheduler's, host only) hands out main pages, each with a window page,
  records the (main page, window page) pairs the device's translation must learn (the plan carries
  them, the runner writes them), and frees a main page's window page with it, or alone
  (`drop_window`) once its tokens fell out of the window of the request that computed them.
- The policy drops those windows at planning time (`Policy._drop_windows`), truncates a prefix
  cache match to the last point whose preceding window still has K/V (`window_match_pages`), and,
  when the window pool runs short, frees the window pages of cached pages that no admitted
  request reads (`Policy._reclaim_windows`: those prefixes then match shorter).
- Dropping never rewrites the device translation: a dropped main slot keeps pointing at its old
  window slot, which a later owner overwrites. Only masked (out-of-window) reads ever go through
  such a stale entry, and their weight is exactly zero; and a step in flight that still reads a
  dropped page finishes before the next step (same stream) writes into it.

Sizing (`window_pool_pages`, `split_kv_budget`): the window pool holds what the admitted
requests can read at once, so a window page is never missing: per table row a window's pages
plus the pages a decode step allocates ahead, and one step's prompt tokens. The main pool takes
the rest of the budget at the global layers' cost per token; where that would leave it smaller
than the window pool, both get the same number of pages (today's sizing: every token keeps every
layer's K/V).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence, Tuple

import torch

from minisgl.kvcache.allocator import PageAllocator
from minisgl.kvcache.pool import model_kv_bytes_per_slot
from minisgl.models.config import ModelConfig
from minisgl.utils.misc import div_ceil

# A decode step allocates pages up to this many tokens ahead of need (scheduler/policy.py), so the
# window pool counts them.
DECODE_AHEAD_TOKENS = 16

# (main page, window page): one translation entry per slot of the page, written by the runner
WindowWrite = Tuple[int, int]


def window_pool_pages(window: int, page_size: int, max_running_req: int, step_tokens: int, ahead_tokens: int) -> int:
    """Window pages the admitted requests may read at once (a bound, not an estimate).

    A request reads the window pages of positions [b - window + 1, allocated end), b its last
    page boundary at or before cached_len (`Policy._window_dead`), its own pages or cached ones
    it matched: at most div_ceil(window - 1, ps) + 2 pages of tail, plus those allocated ahead
    of its decode (or, for a prompt chunk, the chunk's; the step's chunks total `step_tokens` at
    most). Every other window page (a cached prefix's tail, pinned or not) may be reclaimed."""
    tail = div_ceil(window - 1, page_size) + 2
    ahead = div_ceil(ahead_tokens, page_size) + 1
    step = div_ceil(step_tokens, page_size) + max_running_req  # (each chunk may start mid-page)
    return max_running_req * (tail + ahead) + step


def split_kv_budget(budget_bytes: int, main_page_bytes: int, window_page_bytes: int, window_need_pages: int) -> Tuple[int, int]:
    """(main pages, window pages) within `budget_bytes`: the window pool gets `window_need_pages`
    and the main pool the rest, unless the main pool would then be the smaller one; then both get
    budget / (main + window page bytes) pages (no gain: every page keeps its window)."""
    even = budget_bytes // (main_page_bytes + window_page_bytes)
    if even <= window_need_pages:
        return even, even
    return (budget_bytes - window_need_pages * window_page_bytes) // main_page_bytes, window_need_pages


@dataclass(frozen=True)
class KVPageSizing:
    """What one page costs, and how a byte budget becomes pages (the engine's page budget)."""

    page_bytes: int  # a page of every layer (the pool without window pages)
    main_page_bytes: int  # a page of the global layers (the main pool of a hybrid one)
    window_page_bytes: int  # a page of the sliding layers (a window page)
    window_need: int | None  # window_pool_pages; None: no sliding layer, no window pool

    def pages(self, budget_bytes: int) -> Tuple[int, int | None]:
        """(main pages, window pages or None) that `budget_bytes` buys."""
        if self.window_need is None:
            return budget_bytes // self.page_bytes, None
        return split_kv_budget(budget_bytes, self.main_page_bytes, self.window_page_bytes, self.window_need)


def kv_page_sizing(
    model_config: ModelConfig, kv_cache_dtype: str, dtype: torch.dtype, tp_size: int, page_size: int,
    max_running_req: int, step_tokens: int, ahead_tokens: int,
) -> KVPageSizing:  # fmt: skip
    """The page costs of `model_config`'s pool; a window pool where it has sliding layers (and a
    K/V pool: MLA models have none)."""
    windows = model_config.layer_windows
    sliding = sum(w is not None for w in windows)
    per_layers = lambda n: page_size * model_kv_bytes_per_slot(model_config, kv_cache_dtype, dtype, tp_size, n)  # noqa: E731
    page = per_layers(model_config.num_layers)
    if not sliding or model_config.latent_attention is not None:
        return KVPageSizing(page, page, 0, None)
    window = max(w for w in windows if w is not None)
    need = window_pool_pages(window, page_size, max_running_req, step_tokens, ahead_tokens)
    return KVPageSizing(page, per_layers(model_config.num_layers - sliding), per_layers(sliding), need)


def window_match_pages(has_window: Sequence[bool], window: int, page_size: int) -> int:
    """The longest usable prefix (in pages) of a cached match whose pages have a window page
    where `has_window` says: a request resuming at token P computes its first query at P, whose
    sliding layers read keys [P - window + 1, P); those positions' pages must all have K/V."""
    k = len(has_window)
    while k > 0:
        first = max(0, k * page_size - window + 1) // page_size
        missing = [i for i in range(first, k) if not has_window[i]]
        if not missing:
            return k
        k = missing[-1]  # a match ending at or before the last missing page may still fit
    return 0


class HybridPageAllocator(PageAllocator):
    """Main pages, each allocated with a window page; `win_of[main page]` is its window page
    (-1: none), the host's copy of the device translation for the pages that hold one."""

    def __init__(self, num_pages: int, num_window_pages: int) -> None:
        super().__init__(num_pages)
        self.window = PageAllocator(num_window_pages)
        self.win_of: List[int] = [-1] * num_pages
        # when each main page got its window page (an allocation count): reclaiming cached
        # windows takes the oldest first
        self.win_age: List[int] = [0] * num_pages
        self._allocs = 0
        self._writes: List[WindowWrite] = []

    @property
    def num_window_free(self) -> int:
        return self.window.num_free

    def alloc(self, n: int) -> List[int]:
        if n > self.window.num_free:  # (the pool is sized so that the running set never gets here)
            raise MemoryError(f"asked for {n} window KV pages, {self.window.num_free} free")
        pages = super().alloc(n)
        self._allocs += 1
        for p, w in zip(pages, self.window.alloc(n)):
            self.win_of[p] = w
            self.win_age[p] = self._allocs
            self._writes.append((p, w))
        return pages

    def free(self, pages: List[int]) -> None:
        self.drop_window(pages)
        super().free(pages)

    def drop_window(self, pages: Sequence[int]) -> None:
        """Free the window pages of these main pages (their sliding K/V is no longer read)."""
        freed = [self.win_of[p] for p in pages if self.win_of[p] >= 0]
        for p in pages:
            self.win_of[p] = -1
        self.window.free(freed)

    def has_window(self, pages: Sequence[int]) -> List[bool]:
        return [self.win_of[p] >= 0 for p in pages]

    def take_writes(self) -> List[WindowWrite]:
        """The translation entries allocated since the last call, for the next plan (one per
        main page, the latest: a page freed and allocated again in between, as after a failed
        plan, must not reach the device's scatter twice, whose order is undefined)."""
        writes, self._writes = self._writes, []
        return list(dict(writes).items())
