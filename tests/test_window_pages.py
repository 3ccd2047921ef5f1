"""Window-aware KV pages (kvcache/window.py): the sliding layers of Gemma 2 / Gemma 3 / GPT-OSS
keep K/V in a window pool whose pages are freed once a request's end is a window past them.

- the sizing rule and the capacity numbers of docs/MODELS.md (Gemma-3-12B, GPT-OSS-20B), from
  the engine's own sizing code;
- the allocator (window pages with their main pages, dropped alone, the translation writes) and
  the prefix-match cut;
- end to end on the tiny random checkpoints of tests/test_gemma.py and tests/test_gpt_oss.py (an
  8-token window; prompts and outputs several windows long; chunked prefill; page sizes 1 and
  16; concurrent requests; a warm prefix-cache hit that continues each conversation): greedy
  tokens identical to the window-unaware pool (every layer keeps every token) and tie-aware equal
  to HF float32; the window pages a decoding request holds stay bounded by its window; aborts and
  retractions leave both pools whole;
- admission under window pressure (a window pool of two long requests' claims, twelve requests
  at once): nobody is admitted without its window pages (checked on the allocator at every
  plan; the mutation that ignores the window pool is caught), decoders that outgrow optimistic
  claims are retracted, and the tokens equal the solo runs' and the window-unaware pool's.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch
from helpers import TEST_DEVICE, HFOracle, random_prompts
from sched_helpers import assert_greedy_consistent, running_llm
from test_gemma import build_gemma
from test_gpt_oss import build_gpt_oss

import minisgl.engine.engine as engine_module
from minisgl.core import SamplingParams
from minisgl.kvcache.window import (
    DECODE_AHEAD_TOKENS,
    TYPICAL_CONTEXT_TOKENS,
    HybridPageAllocator,
    KVPageSizing,
    WindowPoolSizing,
    kv_page_sizing,
    window_match_pages,
    window_row_pages,
)
from minisgl.models import ModelConfig
from minisgl.scheduler.request import UserRequest

WINDOW = 8  # the tiny checkpoints' sliding window
GIB = 1 << 30


# ---- sizing and the documented capacity numbers -------------------------------------------------
def _gemma3_12b() -> ModelConfig:
    from transformers import Gemma3TextConfig

    hf = Gemma3TextConfig(num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=8, head_dim=256, sliding_window=1024,
                          hidden_size=3840, intermediate_size=15360, query_pre_attn_scalar=256)  # fmt: skip
    hf.architectures = ["Gemma3ForCausalLM"]
    return ModelConfig.from_hf(hf)


def _gpt_oss_20b() -> ModelConfig:
    from transformers import GptOssConfig

    hf = GptOssConfig(num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8, head_dim=64, sliding_window=128,
                      hidden_size=2880, num_local_experts=32)  # fmt: skip
    hf.architectures = ["GptOssForCausalLM"]
    return ModelConfig.from_hf(hf)


CONTEXT = 131_072  # both models' context length (the engine passes its max_seq_len)


def capacity(cfg: ModelConfig, budget: int, max_running_req: int, page_size: int = 16) -> Tuple[int, int, int]:
    """(tokens with window pages, tokens without, window pool tokens) of a bf16 pool of `budget`
    bytes as the engine sizes it (the server's 8192-token chunks, 4 draft tokens ahead)."""
    sizing = kv_page_sizing(cfg, "auto", torch.bfloat16, 1, page_size, max_running_req, 8192, DECODE_AHEAD_TOKENS + 4, CONTEXT)
    main, window = sizing.pages(budget)
    assert window is not None
    plain = KVPageSizing(sizing.page_bytes, sizing.page_bytes, 0, None).pages(budget)[0]
    return main * page_size, plain * page_size, window * page_size


def expected_capacity(cfg: ModelConfig, budget: int, max_running_req: int, ps: int = 16) -> Tuple[int, int, int]:
    """`capacity` from the rule as docs/MODELS.md states it, on the layer geometry alone: the
    window pool gets, besides one step's chunks, a claim per row for the rows whose typical
    context (8192 tokens) in the main pool and claim in the window pool fill the budget (1 to
    max_running_req of them); the main pool the rest; both even if the main pool would not be larger."""
    token = 2 * cfg.num_kv_heads * cfg.head_dim * 2  # K and V, bf16, one layer
    sliding = sum(w is not None for w in cfg.layer_windows)
    window = max(w for w in cfg.layer_windows if w is not None)
    main_page, window_page = ps * token * (cfg.num_layers - sliding), ps * token * sliding
    claim = -(-(window - 1) // ps) + 2 + -(-(DECODE_AHEAD_TOKENS + 4) // ps) + 1
    step = 8192 // ps
    rows = (budget - step * window_page) // (8192 // ps * main_page + claim * window_page)
    window_pages = min(max_running_req, max(1, rows)) * claim + step
    main = (budget - window_pages * window_page) // main_page
    if main <= window_pages:
        main = window_pages = budget // (main_page + window_page)
    return main * ps, budget // (main_page + window_page) * ps, window_pages * ps


def test_layer_patterns_of_the_documented_models() -> None:
    g3, oss = _gemma3_12b(), _gpt_oss_20b()
    assert sum(w is None for w in g3.layer_windows) == 8 and set(g3.layer_windows) == {1024, None}
    assert sum(w is None for w in oss.layer_windows) == 12 and set(oss.layer_windows) == {128, None}
    assert TYPICAL_CONTEXT_TOKENS == 8192  # (expected_capacity's)


def documented_capacity() -> Dict[Tuple[str, int, int], Tuple[int, int, float, int | None]]:
    """docs/MODELS.md's capacity table ("Window pages"): (model, KV budget GiB, max running
    requests) -> (tokens with window pages, tokens without, gain, window pool tokens or None:
    = main); 16-token pages."""
    text = (Path(__file__).parent.parent / "docs" / "MODELS.md").read_text()
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 7 and cells[0] in ("Gemma-3-12B", "GPT-OSS-20B") and cells[1].endswith("GiB"):
            name = "gemma3-12b" if cells[0] == "Gemma-3-12B" else "gpt-oss-20b"
            key = (name, int(cells[1].split()[0]), int(cells[2].split()[0]))
            num = lambda c: int(c.replace(",", ""))  # noqa: E731
            rows[key] = (num(cells[3]), num(cells[4]), float(cells[5].rstrip("x")), None if cells[6] == "(= main)" else num(cells[6]))
    return rows


def test_documented_capacity_numbers() -> None:
    """Every row of the table in docs/MODELS.md is what the engine's sizing gives, and what the
    rule computed independently gives; the brief's configurations are all there."""
    table = documented_capacity()
    assert {("gemma3-12b", 100, r) for r in (64, 128, 256)} | {("gpt-oss-20b", 100, 256)} <= set(table), sorted(table)
    for (name, budget, running), (tokens, plain, gain, window) in table.items():
        cfg = _gemma3_12b() if name == "gemma3-12b" else _gpt_oss_20b()
        got = capacity(cfg, budget * GIB, running)
        assert got == expected_capacity(cfg, budget * GIB, running), (name, budget, running)
        assert got == (tokens, plain, tokens if window is None else window), (name, budget, running, got)
        assert gain == round(tokens / plain, 2), (name, budget, running, tokens / plain)
    # the default 256 rows of Gemma-3-12B at 100 GiB gained nothing when the window pool was
    # sized for every row's worst case; now it gains what 116 rows' windows leave
    tokens, plain, _ = capacity(_gemma3_12b(), 100 * GIB, 256)
    assert tokens / plain > 3.5


def test_split_rule() -> None:
    # claim 10 pages a row, a step's chunks 4, 8 rows at most, a typical context of 20 pages
    rule = WindowPoolSizing(row_pages=10, step_pages=4, max_rows=8, context_pages=20)
    assert (rule.floor, rule.cap) == (14, 84)
    # a row costs 20 main pages of 10 bytes and 10 window pages of 5: 250 bytes; 1000 bytes
    # (less the chunks' 20) hold 3 rows: the window pool gets their claims, the main pool the rest
    assert rule.split(1000, 10, 5) == ((1000 - 34 * 5) // 10, 34)
    assert rule.split(100_000, 10, 5) == ((100_000 - 84 * 5) // 10, 84)  # at most every row's (the cap)
    assert rule.split(300, 10, 5)[1] == 14  # one row at least (the floor)
    assert rule.split(200, 10, 50) == (3, 3)  # the main pool would be no larger: both even, no gain
    assert rule.for_main(45) == 2 * 10 + 4 and rule.for_main(5) == 14 and rule.for_main(10_000) == 84
    # per row a window's tail (7 positions back from the last page boundary, +2 pages) and the
    # pages ahead (+1)
    assert window_row_pages(8, 1, 20) == 9 + 21


def test_match_is_cut_where_the_window_has_kv() -> None:
    # page size 4, window 8: a match of k pages needs positions [4k - 7, 4k): pages k-2, k-1
    has = [False, False, True, True, False, True]
    assert window_match_pages(has, 8, 4) == 4  # pages 2, 3 hold it; 5 and 6 pages would need page 4
    assert window_match_pages([True], 8, 4) == 1
    assert window_match_pages([False, True], 8, 4) == 0  # 2 pages need page 0 (position 1..7)
    assert window_match_pages([False, False, True], 5, 4) == 3  # positions [8, 12): page 2 only
    assert window_match_pages([], 8, 4) == 0


def test_hybrid_allocator() -> None:
    a = HybridPageAllocator(6, 3)
    pages = a.alloc(3)
    assert a.num_free == 3 and a.num_window_free == 0 and all(w >= 0 for w in map(a.win_of.__getitem__, pages))
    assert sorted(w for _, w in a.take_writes()) == [0, 1, 2] and a.take_writes() == []
    with pytest.raises(MemoryError):
        a.alloc(1)  # no window page left
    a.drop_window(pages[:2])
    assert a.has_window(pages) == [False, False, True] and a.num_window_free == 2
    more = a.alloc(2)  # window pages reused by other main pages
    assert [p for p, _ in a.take_writes()] == more
    a.free(pages + more)
    assert a.num_free == 6 and a.num_window_free == 3 and a.win_of == [-1] * 6


# ---- end to end on the tiny checkpoints -------------------------------------------------------
MODELS = ("gemma2", "gemma3", "gpt_oss")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    def build(name: str) -> Path:
        out = tmp_path_factory.mktemp(name)
        return build_gpt_oss(out, seed=90) if name == "gpt_oss" else build_gemma(name, out, seed=70 + ("gemma2", "gemma3").index(name))

    return functools.cache(build)


@pytest.fixture(scope="module")
def hf_oracle(model_dir: Callable[[str], Path]) -> Callable[[str], HFOracle]:
    @functools.cache
    def get(name: str) -> HFOracle:
        hf = HFOracle(model_dir(name))
        hf.model.config._attn_implementation = "eager"  # soft-capping and sinks: HF's eager attention
        return hf

    return get


@pytest.fixture
def window_unaware(monkeypatch: pytest.MonkeyPatch) -> Callable[[], None]:
    """Turn the window pool off for the engines built after the call (every layer keeps every
    token, today's pool for models without sliding layers): the reference path."""

    def off() -> None:
        real = engine_module.kv_page_sizing
        monkeypatch.setattr(engine_module, "kv_page_sizing", lambda *a, **k: dataclasses.replace(real(*a, **k), window=None))

    return off


def _window_pool(llm: Any) -> HybridPageAllocator:
    allocator = llm.scheduler.allocator
    assert isinstance(allocator, HybridPageAllocator), "the engine built no window pool"
    return allocator


POISON = 1.0e4  # finite: a masked read of it weighs exactly 0; an unmasked one derails the tokens


def poison_on_drop(sched: Any) -> None:
    """Overwrite each window page the moment it is dropped or freed (at planning time, before
    the step runs): what an immediate reuse by another request would do to a page dropped too
    early. (The scheduler must run without overlap: the write is not ordered after a step in
    flight, which may still read a page dropped for the next one.)"""
    allocator = sched.allocator
    if not isinstance(allocator, HybridPageAllocator):
        return
    ps, drop = sched.page_size, allocator.drop_window
    window_pool = sched.engine.kv_cache.window

    def poisoning_drop(pages: Any) -> None:
        wins = torch.tensor([allocator.win_of[p] for p in pages if allocator.win_of[p] >= 0], dtype=torch.int64)
        drop(pages)
        slots = (wins[:, None] * ps + torch.arange(ps)).flatten()
        window_pool.buffer[:, :, slots.to(window_pool.buffer.device)] = POISON
        if window_pool.buffer.is_cuda:  # (written on the default stream: done before the engine's next step)
            torch.cuda.synchronize()

    allocator.drop_window = poisoning_drop  # type: ignore[method-assign]


Run = Tuple[List[List[int]], List[List[float | None]], List[int]]  # tokens, their logprobs, cached prompt tokens


def _generate(sched: Any, prompts: List[List[int]], max_tokens: int, first_uid: int) -> Run:
    """Every prompt at once, stepping the scheduler by hand. (The tiny random models soon repeat
    a token: the logprobs, compared bit for bit, tell every step apart.)"""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    for i, ids in enumerate(prompts):
        sched.add_request(UserRequest(first_uid + i, ids, params))
    tokens: Dict[int, List[int]] = {}
    logprobs: Dict[int, List[float | None]] = {}
    cached: Dict[int, int] = {}
    while sched.has_work():
        for o in sched.step():
            if o.token_id is not None:
                tokens.setdefault(o.uid, []).append(o.token_id)
                logprobs.setdefault(o.uid, []).append(o.logprob)
                cached.setdefault(o.uid, o.cached_tokens)
    uids = range(first_uid, first_uid + len(prompts))
    return [tokens[u] for u in uids], [logprobs[u] for u in uids], [cached[u] for u in uids]


def _run(path: Path, prompts: List[List[int]], max_tokens: int, **kw: Any) -> Tuple[Run, Run]:
    """Cold: every prompt at once; warm: each conversation continued (prompt + its output + 3
    tokens), which hits the prefix cache where the window's K/V survived."""
    with running_llm(path, enable_overlap=False, **kw) as llm:
        sched = llm.scheduler
        poison_on_drop(sched)
        assert isinstance(sched.allocator, HybridPageAllocator) == (sched.engine.num_window_pages is not None)
        cold = _generate(sched, prompts, max_tokens, 0)
        turns = [p + t + [7, 8, 9] for p, t in zip(prompts, cold[0])]
        warm = _generate(sched, turns, max_tokens, len(prompts))
    return cold, warm


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("name", MODELS)
def test_tokens_equal_the_window_unaware_pool_and_hf(name, page_size, model_dir, hf_oracle, window_unaware):
    """Three concurrent requests (prompts of 2-5 windows, 12-token prefill chunks, 20 tokens
    each), then a warm run that continues each conversation from the prefix cache: greedy tokens
    identical to the pool without window pages, and HF's (tie-aware)."""
    path = model_dir(name)
    prompts = random_prompts([17, 30, 41], seed=500 + MODELS.index(name))
    kw: Dict[str, Any] = dict(page_size=page_size, max_extend_tokens=12, cache_type="radix", max_running_req=4, max_seq_len_override=128)
    cold, warm = _run(path, prompts, 20, **kw)
    window_unaware()
    ref_cold, ref_warm = _run(path, prompts, 20, **kw)
    # the same cache hits (the window before each request's last page boundary is kept for
    # them), the same tokens and bitwise the same logprobs
    assert (cold, warm) == (ref_cold, ref_warm), "tokens, logprobs or cache hits differ from the window-unaware pool"
    assert sum(warm[2]) >= 2 * 16, f"the warm run hit the cache for {warm[2]} tokens"
    hf = hf_oracle(name)
    turns = [p + c + [7, 8, 9] for p, c in zip(prompts, cold[0])]
    for ids, got in zip(prompts + turns, cold[0] + warm[0]):
        assert_greedy_consistent(hf, ids, got, f"{name} ps={page_size}")


def test_cached_windows_are_reclaimed_when_the_window_pool_is_short(model_dir, hf_oracle, monkeypatch):
    """A window pool sized for 2 rows (a main pool far larger): a dozen finished requests leave
    their tails' window pages in the prefix cache until the pool runs short; then those no
    admitted request reads are freed (`Policy._reclaim_windows`) and their prefixes match
    shorter. Every token is still HF's (window pages poisoned the moment they are freed), and
    both pools end whole."""
    from minisgl.scheduler.policy import Policy

    reclaimed: List[int] = []
    real = Policy._reclaim_windows
    monkeypatch.setattr(Policy, "_reclaim_windows", lambda self, a, short: (reclaimed.append(short), real(self, a, short))[1])
    prompts = random_prompts([18, 23, 13, 30, 21, 16, 27, 19, 25, 14, 22, 29], seed=540)
    kw: Dict[str, Any] = dict(page_size=4, max_extend_tokens=16, cache_type="radix", max_running_req=2, max_seq_len_override=96,
                              num_page_override=400)  # fmt: skip
    with running_llm(model_dir("gemma2"), enable_overlap=False, **kw) as llm:
        sched = llm.scheduler
        pool = _window_pool(llm)
        assert pool.window.num_pages < 60, pool.window.num_pages
        poison_on_drop(sched)
        cold = _generate(sched, prompts, 12, 0)
        # (the newest first: the oldest cached windows are the first reclaimed)
        turns = [p + t + [7, 8, 9] for p, t in zip(prompts, cold[0])][::-1]
        warm = _generate(sched, turns, 12, len(prompts))
    assert reclaimed, "the window pool never ran short"
    assert 0 < sum(warm[2]) < sum(len(t) - 3 for t in turns), f"cache hits {warm[2]}: all or none"
    hf = hf_oracle("gemma2")
    for ids, got in zip(prompts + turns, cold[0] + warm[0]):
        assert_greedy_consistent(hf, ids, got, "reclaimed")


def test_reclaim_spares_the_cached_window_a_request_reads(model_dir, hf_oracle, monkeypatch):
    """The oldest cached tail is the first reclaimed, unless an admitted request reads it: A's
    conversation is cached first, five others' tails after it, the rest of the window pool is
    held aside; then B continues A's conversation (its match ends on A's tail) beside a new
    prompt, which makes the pool short in B's first step. B's tokens are HF's (reclaimed pages
    are poisoned)."""
    from minisgl.scheduler.policy import Policy

    reclaimed: List[int] = []
    real = Policy._reclaim_windows
    monkeypatch.setattr(Policy, "_reclaim_windows", lambda self, a, short: (reclaimed.append(short), real(self, a, short))[1])
    prompts = random_prompts([22] + [13] * 5 + [40], seed=550)
    kw: Dict[str, Any] = dict(page_size=4, max_extend_tokens=16, cache_type="radix", max_running_req=2, max_seq_len_override=96,
                              num_page_override=400)  # fmt: skip
    with running_llm(model_dir("gemma2"), enable_overlap=False, **kw) as llm:
        sched = llm.scheduler
        pool = _window_pool(llm)
        poison_on_drop(sched)
        a = _generate(sched, prompts[:1], 12, 0)[0][0]
        _generate(sched, prompts[1:6], 4, 1)
        aside = pool.window.alloc(pool.num_window_free - 2)  # (as if other requests held them)
        turn = prompts[0] + a + [7, 8, 9]
        assert not reclaimed
        b, _, hits = _generate(sched, [turn, prompts[6]], 12, 100)
        assert reclaimed, "the window pool never ran short"
        pool.window.free(aside)
    assert hits[0] >= 28, f"B did not continue from A's cached tail: {hits}"
    hf = hf_oracle("gemma2")
    assert_greedy_consistent(hf, turn, b[0], "B")
    assert_greedy_consistent(hf, prompts[6], b[1], "the new prompt")


def test_window_pages_are_freed_while_decoding(model_dir):
    """One request decoding 8 windows past a 3-window prompt: the window pages it holds never
    exceed its window's tail plus the pages allocated ahead, while its main pages grow."""
    with running_llm(model_dir("gemma3"), page_size=1, max_extend_tokens=16, max_running_req=2, max_seq_len_override=128) as llm:
        sched = llm.scheduler
        pool = _window_pool(llm)
        sched.add_request(
            UserRequest(1, random_prompts([24], seed=510)[0], SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))
        )
        held: List[int] = []
        while sched.has_work():
            sched.step()
            held.append(pool.window.num_pages - pool.num_window_free)
            req = sched.active.get(1)
            if req is not None and req.holds_row:
                assert held[-1] <= (WINDOW - 1) + 1 + DECODE_AHEAD_TOKENS + 16, (held[-1], req)
        assert max(held) <= WINDOW + DECODE_AHEAD_TOKENS + 16 < 24 + 64
        assert pool.num_free + sched.cache.cached_pages == pool.num_pages


def test_aborts_and_retractions_return_both_pools(model_dir, window_unaware):
    """Six requests in a pool too small for all of them (retractions), two aborted mid-decode:
    the others' tokens equal the window-unaware run's, and after the run every main page and every
    window page is free or held by the prefix cache (then all free after a reset)."""
    path = model_dir("gemma2")
    prompts = random_prompts([20, 26, 9, 33, 14, 21], seed=520)
    # (a window page per main page: the main pool is what runs short here; the window pool's
    # pressure is test_window_pool_admission_under_pressure's)
    kw: Dict[str, Any] = dict(page_size=4, max_extend_tokens=16, max_running_req=4, max_seq_len_override=96, num_page_override=40,
                              num_window_page_override=40)  # fmt: skip

    def run() -> Tuple[Dict[int, List[int]], int]:
        out: Dict[int, List[int]] = {}
        with running_llm(path, **kw) as llm:  # (its exit asserts the no-leak contract)
            sched = llm.scheduler
            for uid, ids in enumerate(prompts):
                params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
                sched.add_request(UserRequest(uid, ids, params))
            steps = 0
            while sched.has_work():
                for o in sched.step():
                    if o.token_id is not None:
                        out.setdefault(o.uid, []).append(o.token_id)
                steps += 1
                if steps == 12:
                    assert sched.abort(1) and sched.abort(4)
            retractions = sched.stats().retractions
            if isinstance(sched.allocator, HybridPageAllocator):
                sched.check_invariants()
                window = sched.allocator.window
                assert window.num_free + sum(w >= 0 for w in sched.allocator.win_of) == window.num_pages
        return {u: t for u, t in out.items() if u not in (1, 4)}, retractions

    got, retractions = run()
    assert retractions > 0, "the pool was large enough: nothing was retracted"
    window_unaware()
    ref, _ = run()
    assert got == ref


def watch_window_admission(sched: Any) -> Dict[str, int]:
    """Check every plan against the allocator: each request admitted for the step runs its
    first chunk in it (none waits in a row for window pages), every page a planned request reads
    from its window on has a window page, and the admitted requests' claims fit the window pool
    less a step's chunks. Returns the most rows held at once."""
    allocator = sched.allocator
    admitted: List[int] = []
    seen = {"rows": 0}
    real_admitted, real_plan = sched._admitted, sched._plan

    def admitted_hook(req: Any, reserve: int) -> None:
        admitted.append(req.uid)
        real_admitted(req, reserve)

    def plan_hook(pick: Any) -> Any:
        plan = real_plan(pick)
        missing = set(admitted) - set(plan.uids)
        assert not missing, f"requests {missing} were admitted without the window pages of their first chunk"
        admitted.clear()
        for req in plan.reqs:
            live = req.pages[sched._window_dead(req) :]
            assert all(allocator.win_of[p] >= 0 for p in live), f"request {req.uid} reads a page without its window page"
        assert sched._window_claimed + sched._window_step_pages <= allocator.window.num_pages, "window claims overflow the pool"
        seen["rows"] = max(seen["rows"], sum(r.holds_row for r in sched.active.values()))
        return plan

    sched._admitted, sched._plan = admitted_hook, plan_hook
    return seen


# more requests than the window pool holds at once: long prompts (2-5 windows) and short ones
# whose outputs take them past the window; a tiny window pool beside a main pool that never runs short
BARRAGE = dict(page_size=4, max_extend_tokens=16, cache_type="radix", max_running_req=8, max_seq_len_override=96,
               num_page_override=8 * 96 // 4 + 16, num_window_page_override=20)  # fmt: skip
BARRAGE_ADMISSION = {
    # claims of the expected length at a low estimate: decoders outgrow them and are retracted
    "optimistic": dict(admission="optimistic", init_new_token_ratio=0.05, min_new_token_ratio=0.05),
    "worst-case": dict(admission="worst-case"),  # claims are bounds: never short, never retracted
}


def _barrage(path: Path, prompts: List[List[int]], admission: str, window_aware: bool = True) -> Tuple[Run, int, int]:
    """(the run, retractions, most rows at once) of every prompt at once."""
    with running_llm(path, enable_overlap=False, **BARRAGE, **BARRAGE_ADMISSION[admission]) as llm:
        sched = llm.scheduler
        assert isinstance(sched.allocator, HybridPageAllocator) == window_aware
        seen = watch_window_admission(sched) if window_aware else {"rows": 0}
        if window_aware:
            poison_on_drop(sched)
        run = _generate(sched, prompts, 24, 0)
        retractions = sched.stats().retractions
        if window_aware:  # (running_llm's exit checks both pools; after a reset every window page is free)
            stats = sched.stats()
            assert stats.window_total_pages == 20 and stats.window_free_pages == 20, stats
    return run, retractions, seen["rows"]


@pytest.mark.parametrize("admission", sorted(BARRAGE_ADMISSION))
def test_window_pool_admission_under_pressure(admission, model_dir, window_unaware):
    """Twelve requests at once through a window pool of 20 pages (two long requests' claims):
    admission waits for window pages (`watch_window_admission`), optimistic claims are outgrown
    and those decoders retracted (the main pool never runs short), and every request's greedy
    tokens equal its solo run's and the window-unaware pool's; both pools end whole."""
    path = model_dir("gemma3")
    prompts = random_prompts([4, 3, 5, 4, 3, 6, 4, 5, 21, 30, 41, 3], seed=560)
    (tokens, _, _), retractions, rows = _barrage(path, prompts, admission)
    assert rows < len(prompts), "the window pool held every request at once"
    if admission == "optimistic":
        assert retractions > 0, "no decoder outgrew its window claim"
    else:
        assert retractions == 0
    with running_llm(path, enable_overlap=False, **BARRAGE) as llm:
        solo = [_generate(llm.scheduler, [p], 24, 100 + i)[0][0] for i, p in enumerate(prompts)]
    assert tokens == solo
    window_unaware()
    assert _barrage(path, prompts, admission, window_aware=False)[0][0] == tokens


def test_admission_ignoring_the_window_pool_is_caught(model_dir, monkeypatch):
    """The mutation: admission that does not look at the window pool admits requests whose
    window pages are not there (`watch_window_admission` fails)."""
    from minisgl.scheduler.policy import Policy

    monkeypatch.setattr(Policy, "_window_admits", lambda self, req, match, claim, budget: True)
    prompts = random_prompts([4, 3, 5, 4, 3, 6, 4, 5, 21, 30, 41, 3], seed=560)
    with pytest.raises(Exception, match="without the window pages|claims overflow"):  # (a StepFailed around it)
        _barrage(model_dir("gemma3"), prompts, "worst-case")


def test_engine_splits_its_page_budget(model_dir, monkeypatch):
    """The engine's page budget for a model with sliding layers is `kv_page_sizing`'s split of
    the same bytes; its pool holds the global layers per main slot and the sliding ones in the
    window pool (+ the dummy page's twin); num_page_override sizes the main pool, the window pool
    then by the same rule (at most one window page per main page)."""
    from helpers import running_engine

    from minisgl.kvcache.pool import HybridKVCachePool

    with running_engine(model_dir("gemma3"), page_size=4, max_running_req=2) as engine:
        pool = engine.kv_cache
        assert isinstance(pool, HybridKVCachePool) and engine.num_window_pages is not None
        assert pool.window.num_slots == (engine.num_window_pages + 1) * 4 and pool.full.num_slots == pool.num_slots
        assert [pool.sliding(i) for i in range(3)] == [True, True, False]  # (gemma3's layer_types)
        monkeypatch.setattr(engine, "_sync_get_memory", lambda: (64 * GIB, 7 * GIB))
        cfg = dataclasses.replace(engine.config, num_page_override=None, memory_ratio=0.5, cpu_kv_cache_bytes=1 << 40)
        main, window = engine._determine_num_pages(10 * GIB, cfg)
        sizing = kv_page_sizing(engine.config.model_config, "auto", torch.float32, 1, 4, 2, 8192, DECODE_AHEAD_TOKENS + 4,
                                engine.config.max_seq_len)  # fmt: skip
        assert (main, window) == sizing.pages(2 * GIB) and window is not None and window < main
        # 2 of 3 layers slide: a main page costs a third of a plain one, and the window pool is small
        assert main * sizing.main_page_bytes + window * sizing.window_page_bytes <= 2 * GIB < (main + window + 1) * sizing.page_bytes
        rule = sizing.window
        assert rule is not None
        cfg = dataclasses.replace(cfg, num_page_override=50)
        assert engine._determine_num_pages(10 * GIB, cfg) == (50, min(50, rule.for_main(50)))
        # the window pool's own override, never below one request's claim and a step's chunks
        # (a bare engine's steps may be 8192 tokens: 2048 pages of chunks)
        cfg = dataclasses.replace(cfg, num_page_override=5000)
        assert engine._determine_num_pages(10 * GIB, dataclasses.replace(cfg, num_window_page_override=rule.floor)) == (5000, rule.floor)
        with pytest.raises(ValueError, match="num_window_page_override"):
            engine._determine_num_pages(10 * GIB, dataclasses.replace(cfg, num_window_page_override=rule.floor - 1))


# ---- CUDA (MINISGL_TEST_DEVICE=cuda) -----------------------------------------------------------
CUDA = pytest.mark.skipif(TEST_DEVICE != "cuda", reason="CUDA paths (MINISGL_TEST_DEVICE=cuda)")


@CUDA
def test_cuda_kernels_through_a_translation():
    """kernel_checks/gemma.py's translation check on the GPU: decode, extend and deterministic
    kernels over a window pool through a translation give the untranslated pool's bits."""
    from kernel_checks import gemma as G

    gen = torch.Generator().manual_seed(7)
    k, v = torch.randn(512, 2, 16, generator=gen), torch.randn(512, 2, 16, generator=gen)
    lens = [1, 9, 40, 110]
    table = torch.stack([torch.randperm(512, generator=gen)[:160] for _ in lens]).int()
    errors = G.check_translation(k, v, table, lens, 4, 0.3, torch.device("cuda"))
    assert not errors, errors


@CUDA
@pytest.mark.parametrize("name", MODELS)
def test_cuda_graphs_over_window_pages(name, model_dir, window_unaware):
    """On CUDA (triton backend): decode steps and mixed steps replay CUDA graphs while window
    pages are dropped and reused (the translation is read inside the captured step); greedy
    tokens and logprobs equal the eager run's, and those of the graphs over the pool without
    window pages bit for bit."""
    from helpers import record_runners

    prompts = random_prompts([17, 30, 41], seed=530 + MODELS.index(name))
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=0)
    kw: Dict[str, Any] = dict(page_size=16, max_extend_tokens=16, cache_type="radix", max_running_req=4, max_seq_len_override=128,
                              attention_backend="triton")  # fmt: skip
    runs: Dict[str, List[Any]] = {}
    for label, extra in (("graphs", {}), ("eager", dict(cuda_graph_bs=[], cuda_graph_max_tokens=0)), ("unaware", {})):
        if label == "unaware":
            window_unaware()
        with running_llm(model_dir(name), **kw, **extra) as llm:
            engine = llm.scheduler.engine
            assert (engine.num_window_pages is None) == (label == "unaware")
            log = record_runners(engine)
            runs[label] = [(r.token_ids, r.logprobs) for r in llm.generate(prompts, params)]
        want = "ModuleRunner" if label == "eager" else "GraphRunner"
        assert {cls for cls, phase in log if phase == "decode"} == {want}, (label, log)
    assert runs["graphs"] == runs["unaware"]
    for (ta, la), (tb, lb) in zip(runs["graphs"], runs["eager"]):
        assert ta == tb
        assert (torch.tensor(la) - torch.tensor(lb)).abs().max().item() < 1e-4
