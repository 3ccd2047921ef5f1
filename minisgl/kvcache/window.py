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

Sizing (`WindowPoolSizing`): an admitted request reads at most `window_row_pages` window pages
at once (its window's tail plus what is allocated ahead of its decode), and a step's prompt
chunks a few more; the policy admits a request only while those claims fit the window pool
(`Policy._window_admits`), and retracts a decoder that cannot get one (`Policy.must_retract`).
The pool itself is a share of the KV budget: as many rows' claims as the main pool holds rows of
`TYPICAL_CONTEXT_TOKENS` (at least one row, at most max_running_req), plus one step's chunks; the
main pool takes the rest at the global layers' cost per token. Where that would leave the main
pool no larger than the window pool, both get the same number of pages (every page keeps its
window: no gain, and the window pool never runs short).
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

# The context (prompt + output tokens) a request is expected to reach, for sizing the window pool
# against the main pool: the rows whose windows the pool holds are those the main pool holds at
# this context. Shorter requests hold less than a whole window (and are capped by their length),
# so more of them run; longer ones are bounded by the main pool, whose share grows the larger
# this is. 8192 sits between chat turns (a few thousand tokens) and long documents; a model's
# shorter context (max_seq_len) replaces it.
TYPICAL_CONTEXT_TOKENS = 8192

# (main page, window page): one translation entry per slot of the page, written by the runner
WindowWrite = Tuple[int, int]


def window_row_pages(window: int, page_size: int, ahead_tokens: int) -> int:
    """The most window pages one request reads in a decode step (a bound, not an estimate).

    It reads the window pages of positions [b - window + 1, allocated end), b its last page
    boundary at or before cached_len (`Policy._window_dead`), its own pages or cached ones it
    matched: at most div_ceil(window - 1, ps) + 2 pages of tail, plus those allocated ahead of
    its decode (`ahead_tokens`: the decode-ahead pages and a verify step's drafts). A prompt
    chunk reads at most div_ceil(chunk, ps) - 2 pages more than this, so a step's chunks need
    div_ceil(step tokens, ps) beyond the rows' claims. Every other window page (a cached
    prefix's tail, pinned or not) may be reclaimed."""
    return div_ceil(window - 1, page_size) + 2 + div_ceil(ahead_tokens, page_size) + 1


@dataclass(frozen=True)
class WindowPoolSizing:
    """How many window pages a pool gets (the module docstring's rule)."""

    row_pages: int  # window_row_pages: what the policy claims per admitted request
    step_pages: int  # one step's prompt chunks, beyond the rows' claims
    max_rows: int  # max_running_req: more rows never run at once
    context_pages: int  # a row's typical context in the main pool (TYPICAL_CONTEXT_TOKENS)

    @property
    def floor(self) -> int:
        """One request of any length and a step's chunks: admission never deadlocks."""
        return self.row_pages + self.step_pages

    @property
    def cap(self) -> int:
        """Every row's claim and a step's chunks: a larger window pool is never used."""
        return self.max_rows * self.row_pages + self.step_pages

    def pages_for(self, rows: int) -> int:
        return min(self.max_rows, max(1, rows)) * self.row_pages + self.step_pages

    def for_main(self, main_pages: int) -> int:
        """The window pool beside a main pool of `main_pages` (a fixed page count)."""
        return self.pages_for(main_pages // self.context_pages)

    def split(self, budget_bytes: int, main_page_bytes: int, window_page_bytes: int) -> Tuple[int, int]:
        """(main pages, window pages) within `budget_bytes`: the rows for which a typical
        context in the main pool and a claim in the window pool fill the budget get their
        claims; the main pool the rest. Unless the main pool would then be no larger: both get
        budget / (main + window page bytes) pages (no gain, never short of window pages)."""
        per_row = self.context_pages * main_page_bytes + self.row_pages * window_page_bytes
        window = self.pages_for((budget_bytes - self.step_pages * window_page_bytes) // per_row)
        main = (budget_bytes - window * window_page_bytes) // main_page_bytes
        if main <= window:
            even = budget_bytes // (main_page_bytes + window_page_bytes)
            return even, even
        return main, window


@dataclass(frozen=True)
class KVPageSizing:
    """What one page costs, and how a byte budget becomes pages (the engine's page budget)."""

    page_bytes: int  # a page of every layer (the pool without window pages)
    main_page_bytes: int  # a page of the global layers (the main pool of a hybrid one)
    window_page_bytes: int  # a page of the sliding layers (a window page)
    window: WindowPoolSizing | None  # None: no sliding layer, no window pool

    def pages(self, budget_bytes: int) -> Tuple[int, int | None]:
        """(main pages, window pages or None) that `budget_bytes` buys."""
        if self.window is None:
            return budget_bytes // self.page_bytes, None
        return self.window.split(budget_bytes, self.main_page_bytes, self.window_page_bytes)


def kv_page_sizing(
    model_config: ModelConfig, kv_cache_dtype: str, dtype: torch.dtype, tp_size: int, page_size: int,
    max_running_req: int, step_tokens: int, ahead_tokens: int, max_seq_len: int,
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
    context = div_ceil(min(TYPICAL_CONTEXT_TOKENS, max_seq_len), page_size)
    rows = WindowPoolSizing(window_row_pages(window, page_size, ahead_tokens), div_ceil(step_tokens, page_size), max_running_req, context)
    return KVPageSizing(page, per_layers(model_config.num_layers - sliding), per_layers(sliding), rows)


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
