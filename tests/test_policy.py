"""The scheduling policy and its step loop (`Scheduler` over a given runner) with a fake runner:
no Engine and no model (torch is imported only for the config's dtype field).

The fake runner plays the device: it applies each StepPlan's page-table and token-pool writes to
dictionaries, checks that every row's cached positions point at KV of exactly its prefix and
that no plan writes KV into a slot a step still in flight reads, and "samples" a token that is
a pure function of the row's token-pool contents (so any scheduling of the same requests must
produce the same tokens). After every scenario the pool is checked for leaks.
"""

from __future__ import annotations

import pickle
from types import SimpleNamespace
from typing import Any, Dict, List, Sequence, Tuple

import pytest
import torch

from minisgl.distributed import DistributedInfo
from minisgl.sampling_params import SamplingParams
from minisgl.scheduler.config import SchedulerConfig
from minisgl.scheduler.plan import StepPlan
from minisgl.scheduler.policy import Limits
from minisgl.scheduler.request import Status, UserRequest
from minisgl.scheduler.scheduler import Scheduler, StepFailed

EOS = 0
MAX_SEQ_LEN = 128


def fake_model(prefix_hash: int) -> int:
    """The next token after a prefix (never EOS)."""
    return 10 + prefix_hash % 200


def _roll(h: int, token: int) -> int:
    return hash((h, token)) & 0x7FFFFFFF


def reference(prompt: Sequence[int], n: int) -> List[int]:
    h, out = 0, []
    for t in prompt:
        h = _roll(h, t)
    for _ in range(n):
        t = fake_model(h)
        out.append(t)
        h = _roll(h, t)
    return out


class FakeRunner:
    """The device, as dictionaries."""

    def __init__(self, num_slots: int, max_seq_len: int = MAX_SEQ_LEN) -> None:
        self.num_slots = num_slots
        self.max_seq_len = max_seq_len
        self.page_table: Dict[Tuple[int, int], int] = {}
        self.token_pool: Dict[Tuple[int, int], int] = {}
        self.kv: Dict[int, int] = {}  # slot -> hash of the prefix whose last token's KV it holds
        self.in_flight: List[Any] = []
        self.plans: List[StepPlan] = []
        self.fail_uid: int | None = None

    def launch(self, plan: StepPlan) -> Any:
        if self.fail_uid is not None and self.fail_uid in plan.uids:
            raise ValueError("injected fault")
        assert len(set(plan.rows)) == len(plan.rows), "two rows of one step share a table row"
        for target, writes in ((self.page_table, plan.page_writes), (self.token_pool, plan.token_writes)):
            for row, col, values in writes:
                for j, v in enumerate(values):
                    target[(row, col + j)] = v
        busy = {s for f in self.in_flight for s in f.reads}
        reads: List[int] = []
        tokens: List[int] = []
        for req, row, start, end, emit in zip(plan.reqs, plan.rows, plan.starts, plan.ends, plan.emits):
            assert (req.uid, req.table_idx, req.cached_len, req.device_len) == (req.uid, row, start, end)
            assert 0 <= start < end <= self.max_seq_len
            ids = req.token_ids
            h = 0
            for p in range(end):
                token = self.token_pool[(row, p)]
                if p < len(ids):
                    assert token == ids[p], f"request {req.uid}: token pool holds {token} at {p}, the host {ids[p]}"
                h = _roll(h, token)
                slot = self.page_table[(row, p)]
                assert 0 <= slot < self.num_slots
                if p < start:
                    assert self.kv.get(slot) == h, f"request {req.uid}: cached position {p} points at another prefix's KV"
                else:
                    assert slot not in busy, f"request {req.uid} writes KV into slot {slot}, read by a step in flight"
                    self.kv[slot] = h
                reads.append(slot)
            token = fake_model(h)
            tokens.append(token)
            if emit:
                self.token_pool[(row, end)] = token
            req.complete_one()  # as the engine does
        flight = SimpleNamespace(plan=plan, reads=reads, tokens=tokens)
        self.in_flight.append(flight)
        self.plans.append(plan)
        return flight

    def wait(self, flight: Any) -> None:
        self.in_flight.remove(flight)

    def results(self, flight: Any) -> Any:
        return SimpleNamespace(tokens=flight.tokens, logprobs=None, prompt_logprobs=None)

    def synchronize(self) -> None:
        self.in_flight.clear()

    def is_fatal(self, exc: BaseException) -> bool:
        return isinstance(exc, MemoryError)

    def use_grammar(self, backend: Any) -> None:
        pass


def make_policy(
    num_pages: int = 512, page_size: int = 1, overlap: bool = False, share_rows: bool = False, max_seq_len: int = MAX_SEQ_LEN, **kw: Any
) -> Scheduler:
    """The scheduler's policy and loop over a fake runner (share_rows: plan for TP followers)."""
    kw.setdefault("max_running_req", 8)
    tp = DistributedInfo(0, 2 if share_rows else 1)
    config = SchedulerConfig(model_path="unused", tp_info=tp, dtype=torch.float32, page_size=page_size, enable_overlap=overlap, **kw)
    limits = Limits(num_pages, max_seq_len, 256, frozenset({EOS}))
    return Scheduler(config, FakeRunner(num_pages * page_size, max_seq_len), limits)


def runner_of(policy: Scheduler) -> FakeRunner:
    assert isinstance(policy.runner, FakeRunner)
    return policy.runner


def drive(policy: Scheduler, max_steps: int = 5000) -> Tuple[Dict[int, List[int]], Dict[int, str]]:
    tokens: Dict[int, List[int]] = {}
    reasons: Dict[int, str] = {}
    for _ in range(max_steps):
        if not policy.has_work():
            return tokens, reasons
        collect(policy.step(), tokens, reasons)
    raise AssertionError("the policy did not finish its work")


def collect(outputs: Sequence[Any], tokens: Dict[int, List[int]], reasons: Dict[int, str]) -> None:
    for out in outputs:
        if out.token_id is not None:
            tokens.setdefault(out.uid, []).append(out.token_id)
        if out.finished:
            assert out.uid not in reasons, f"request {out.uid} finished twice"
            assert out.finish_reason is not None
            reasons[out.uid] = out.finish_reason


def assert_clean(policy: Scheduler) -> None:
    """No leak: idle, every row free, every page free or cached unpinned; free after a reset."""
    policy.check_invariants()
    stats = policy.stats()
    assert stats.num_running == stats.num_waiting == 0
    assert stats.free_pages == stats.total_pages
    policy.reset_prefix_cache()
    assert policy.allocator.num_free == policy.allocator.num_pages
    policy.check_invariants()


def workload(n: int, seed: int = 0, max_len: int = 40, max_new: int = 20) -> List[Tuple[List[int], int]]:
    import random

    rng = random.Random(seed)
    return [([rng.randrange(1, 256) for _ in range(rng.randint(1, max_len))], rng.randint(1, max_new)) for _ in range(n)]


def greedy(n: int, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, **kw)


def submit(policy: Scheduler, reqs: Sequence[Tuple[List[int], int]], first_uid: int = 0, **kw: Any) -> None:
    for uid, (prompt, n) in enumerate(reqs, start=first_uid):
        policy.add_request(UserRequest(uid, list(prompt), greedy(n, **kw)))


def check_outputs(tokens: Dict[int, List[int]], reqs: Sequence[Tuple[List[int], int]], first_uid: int = 0) -> None:
    for uid, (prompt, n) in enumerate(reqs, start=first_uid):
        assert tokens.get(uid) == reference(prompt, n), f"request {uid}"


def first_step(policy: Scheduler) -> Dict[int, int]:
    """uid -> index of the first plan it appeared in."""
    seen: Dict[int, int] = {}
    for i, plan in enumerate(runner_of(policy).plans):
        for uid in plan.uids:
            seen.setdefault(uid, i)
    return seen


# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("page_size", [1, 4])
def test_workload_matches_the_reference(overlap: bool, page_size: int) -> None:
    policy = make_policy(page_size=page_size, overlap=overlap, max_extend_tokens=24)
    reqs = workload(20)
    submit(policy, reqs)
    tokens, reasons = drive(policy)
    check_outputs(tokens, reqs)
    assert set(reasons.values()) == {"length"}
    assert policy.stats().generated_tokens == sum(n for _, n in reqs)
    assert_clean(policy)


def test_worst_case_admission_stays_within_the_page_budget() -> None:
    # each request needs 10 + 10 = 20 pages at worst; 50 pages admit two at a time
    policy = make_policy(num_pages=50, admission="worst-case")
    reqs = [([i + 1] * 10, 10) for i in range(6)]
    submit(policy, reqs)
    tokens: Dict[int, List[int]] = {}
    reasons: Dict[int, str] = {}
    collect(policy.step(), tokens, reasons)
    assert [r.uid for r in policy.prefilling + policy.running] == [0, 1]
    assert [r.uid for r in policy.waiting] == [2, 3, 4, 5]
    peak = 0
    while policy.has_work():
        collect(policy.step(), tokens, reasons)
        held = sum(len(r.pages) + r.reserved_pages for r in policy.active.values())
        assert held <= 50
        peak = max(peak, len(policy.active))
    assert peak == 2 and policy.stats().retractions == 0
    check_outputs(tokens, reqs)
    assert_clean(policy)


def test_chunked_prefill_sizes_and_mixed_steps() -> None:
    policy = make_policy(max_extend_tokens=16)
    policy.add_request(UserRequest(0, [3] * 5, greedy(30)))
    first = policy.step()  # prefill of request 0
    policy.add_request(UserRequest(1, list(range(1, 41)), greedy(3)))
    tokens, _ = drive(policy)
    tokens[0] = [o.token_id for o in first] + tokens[0]
    plans = runner_of(policy).plans
    chunks = [(p.starts[p.uids.index(1)], p.ends[p.uids.index(1)], p.emits[p.uids.index(1)]) for p in plans if 1 in p.uids and p.is_prefill]
    # the decode row of request 0 rides along: 15 prompt tokens a step, the rest in the last chunk
    assert chunks == [(0, 15, False), (15, 30, False), (30, 40, True)]
    for plan in plans:
        if plan.is_prefill:
            assert sum(e - s for s, e in zip(plan.starts, plan.ends)) <= 16
        if 1 in plan.uids and plan.is_prefill:  # request 0's decode row first
            assert plan.num_decode_rows == 1 and plan.uids == [0, 1] and plan.ends[0] - plan.starts[0] == 1
    assert policy.stats().mixed_steps == 3
    check_outputs(tokens, [([3] * 5, 30), (list(range(1, 41)), 3)])
    assert_clean(policy)


def test_without_mixed_batches_prefill_and_decode_alternate() -> None:
    policy = make_policy(max_extend_tokens=8, mixed_batches=False)
    policy.add_request(UserRequest(0, [7] * 4, greedy(12)))
    policy.step()
    policy.add_request(UserRequest(1, list(range(1, 25)), greedy(2)))
    drive(policy)
    phases = [p.phase for p in runner_of(policy).plans]
    assert "prefill,decode,prefill,decode,prefill" in ",".join(phases)
    assert all(p.num_decode_rows == 0 for p in runner_of(policy).plans)
    assert_clean(policy)


@pytest.mark.parametrize("overlap", [False, True])
def test_retraction_takes_the_latest_admitted_and_resumes_it(overlap: bool) -> None:
    # 60 pages: the optimistic estimate admits all four prompts, their decodes do not fit
    policy = make_policy(num_pages=60, overlap=overlap, init_new_token_ratio=0.05, min_new_token_ratio=0.05)
    reqs = [([i + 1] * 8, 20) for i in range(4)]
    submit(policy, reqs)
    tokens: Dict[int, List[int]] = {}
    reasons: Dict[int, str] = {}
    victims: List[int] = []
    while policy.has_work():
        before = {r.uid for r in policy.retracted}
        collect(policy.step(), tokens, reasons)
        victims += [r.uid for r in policy.retracted if r.uid not in before]
    assert victims, "nothing was retracted"
    assert victims[0] == 3, "the latest admitted goes first"
    assert policy.stats().retractions >= len(victims)
    # a resumed request re-prefills its tokens (prompt + generated) but the cached prefix
    resumed = [p for p in runner_of(policy).plans if p.is_prefill and 3 in p.uids]
    assert len(resumed) >= 2 and resumed[-1].ends[resumed[-1].uids.index(3)] > 8
    check_outputs(tokens, reqs)  # retraction is invisible in the tokens
    assert set(reasons.values()) == {"length"}
    assert_clean(policy)


def test_retraction_under_priority_takes_the_least_urgent() -> None:
    policy = make_policy(num_pages=60, schedule_policy="priority", init_new_token_ratio=0.05, min_new_token_ratio=0.05)
    for uid, prio in enumerate([5, 0, 9, 1]):
        policy.add_request(UserRequest(uid, [uid + 1] * 8, greedy(20, priority=prio)))
    victims: List[int] = []
    tokens: Dict[int, List[int]] = {}
    reasons: Dict[int, str] = {}
    while policy.has_work():
        before = {r.uid for r in policy.retracted}
        collect(policy.step(), tokens, reasons)
        victims += [r.uid for r in policy.retracted if r.uid not in before]
    assert victims and victims[0] == 2  # priority 9
    check_outputs(tokens, [([uid + 1] * 8, 20) for uid in range(4)])
    assert_clean(policy)


def _first_wave(policy: Scheduler, n: int) -> Tuple[int, float]:
    """n chats without max_tokens (prompts of 40-80 tokens) arrive at once: how many run after
    the first step, and the share of the pool still free."""
    import random

    rng = random.Random(3)
    for uid in range(n):
        prompt = [rng.randrange(1, 256) for _ in range(rng.randint(40, 80))]
        policy.add_request(UserRequest(uid, prompt, SamplingParams(temperature=0.0, max_tokens=None)))
    policy.step()
    stats = policy.stats()
    assert stats.num_running + stats.num_waiting == n
    return stats.num_running, stats.free_pages / stats.total_pages


@pytest.mark.parametrize("page_size", [1, 16])
def test_first_wave_is_admitted_while_the_pool_is_mostly_free(page_size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """24 chats without max_tokens on a 6,144-page pool (a 2,048-token context): each is
    estimated at half its remaining context (~1,000 tokens), which alone would admit a handful;
    with the pool almost empty every one runs, up to the running limit (16 here)."""
    pages = 6144 // page_size
    running, free = _first_wave(make_policy(num_pages=pages, page_size=page_size, max_seq_len=2048, max_running_req=16), 24)
    assert running == 16 and free > 0.8
    running, free = _first_wave(make_policy(num_pages=pages, page_size=page_size, max_seq_len=2048, max_running_req=32), 24)
    assert running == 24 and free > 0.7
    # the control: the estimate alone (no free-pool rule) keeps most of them waiting
    monkeypatch.setattr("minisgl.scheduler.policy.FREE_POOL_SHARE", 1.0)
    running, free = _first_wave(make_policy(num_pages=pages, page_size=page_size, max_seq_len=2048, max_running_req=32), 24)
    assert running < 12 and free > 0.8


def test_estimate_decides_once_the_pool_fills() -> None:
    """With most of the pool held by running requests, admission is the estimate's again."""
    policy = make_policy(num_pages=420, max_running_req=16, init_new_token_ratio=1.0, min_new_token_ratio=1.0)
    submit(policy, [([i + 1] * 100, 28) for i in range(3)])  # 300 pages of prompts, 84 expected
    policy.step()
    assert policy.stats().num_running == 3
    # ~117 pages available: 10 + 5 + 84 fits the estimate (though less than half the pool is free)
    policy.add_request(UserRequest(7, [7] * 10, greedy(5)))
    policy.step()
    assert not policy.waiting
    # 20 + 100 + 84 (+ 5) does not: it waits for pages to come back
    policy.add_request(UserRequest(9, [9] * 20, greedy(100)))
    policy.step()
    assert [r.uid for r in policy.waiting] == [9]
    tokens, reasons = drive(policy)
    assert set(reasons.values()) == {"length"} and len(tokens[9]) == 100
    assert_clean(policy)


def test_free_pool_admission_overcommits_and_retraction_catches_it() -> None:
    """12 chats without max_tokens (each runs to the 128-token context) on 200 pages: all are
    admitted at once, their decoding outgrows the pool, retractions free it and every request
    still gives the reference tokens."""
    policy = make_policy(num_pages=200, max_running_req=12)
    reqs = [([i + 1] * 8, MAX_SEQ_LEN - 8) for i in range(12)]
    for uid, (prompt, _) in enumerate(reqs):
        policy.add_request(UserRequest(uid, prompt, SamplingParams(temperature=0.0, max_tokens=None)))
    tokens: Dict[int, List[int]] = {}
    reasons: Dict[int, str] = {}
    collect(policy.step(), tokens, reasons)
    assert policy.stats().num_running == 12
    while policy.has_work():
        collect(policy.step(), tokens, reasons)
    assert policy.stats().retractions > 0
    check_outputs(tokens, reqs)
    assert set(reasons.values()) == {"length"}
    assert_clean(policy)


def test_priority_admits_the_most_urgent_first_fifo_among_equals() -> None:
    policy = make_policy(max_running_req=1, schedule_policy="priority")
    for uid, prio in enumerate([3, 1, 3, 0, 1]):
        policy.add_request(UserRequest(uid, [uid + 1, 2], greedy(2, priority=prio)))
    assert [r.uid for r in policy.waiting] == [3, 1, 4, 0, 2]
    drive(policy)
    order = sorted(first_step(policy), key=first_step(policy).get)  # type: ignore[arg-type]
    assert order == [3, 1, 4, 0, 2]
    assert_clean(policy)


def test_fcfs_keeps_arrival_order() -> None:
    policy = make_policy(max_running_req=1)
    for uid in range(4):
        policy.add_request(UserRequest(uid, [uid + 1], greedy(2)))
    drive(policy)
    seen = first_step(policy)
    assert sorted(seen, key=seen.get) == [0, 1, 2, 3]  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="priority"):
        policy.add_request(UserRequest(9, [1], greedy(2, priority=1)))
    assert_clean(policy)


@pytest.mark.parametrize("page_size", [1, 4])
def test_prefix_cache_hit_skips_the_shared_prefix(page_size: int) -> None:
    policy = make_policy(page_size=page_size)
    shared = list(range(1, 21))
    policy.add_request(UserRequest(0, shared + [50, 51], greedy(4)))
    drive(policy)
    policy.add_request(UserRequest(1, shared + [60], greedy(4)))
    tokens, _ = drive(policy)
    plan = next(p for p in runner_of(policy).plans if 1 in p.uids)
    start = plan.starts[plan.uids.index(1)]
    assert start == (20 // page_size) * page_size  # whole pages of the shared prefix
    assert policy.stats().cache_hit_tokens == start
    assert tokens[1] == reference(shared + [60], 4)  # the fake device checked the cached KV's prefix
    assert_clean(policy)


def test_prompt_logprobs_bypass_the_cache() -> None:
    policy = make_policy()
    policy.add_request(UserRequest(0, [1, 2, 3, 4], greedy(2)))
    drive(policy)
    policy.add_request(UserRequest(1, [1, 2, 3, 4], greedy(2, prompt_logprobs=1)))
    plan_count = len(runner_of(policy).plans)
    policy.step()
    plan = runner_of(policy).plans[plan_count]
    assert plan.starts == [0] and plan.prompt_logprobs is not None
    assert plan.prompt_logprobs.targets == [2, 3, 4] and plan.prompt_logprobs.counts == [3]
    drive(policy)
    assert_clean(policy)


@pytest.mark.parametrize("overlap", [False, True])
def test_abort_in_every_state_frees_everything(overlap: bool) -> None:
    policy = make_policy(num_pages=60, overlap=overlap, max_running_req=3, max_extend_tokens=8,
                         init_new_token_ratio=0.05, min_new_token_ratio=0.05)  # fmt: skip
    policy.add_request(UserRequest(0, [1] * 4, greedy(40)))  # decoding, then aborted
    policy.add_request(UserRequest(1, list(range(1, 31)), greedy(5)))  # aborted mid prefill
    policy.add_request(UserRequest(2, [2] * 4, greedy(40)))
    policy.add_request(UserRequest(3, [3] * 4, greedy(40)))
    policy.add_request(UserRequest(4, [4] * 4, greedy(4)))  # aborted while waiting for a row
    tokens: Dict[int, List[int]] = {}
    reasons: Dict[int, str] = {}
    collect(policy.step(), tokens, reasons)
    assert policy.active[1].status is Status.PREFILLING and 0 < policy.active[1].cached_len < 30
    assert policy.abort(1) and policy.abort(4)
    assert not policy.abort(1) and not policy.abort(12345)
    while len(tokens.get(0, [])) < 3:
        collect(policy.step(), tokens, reasons)
    assert policy.active[0].status is Status.RUNNING and policy.abort(0)
    retracted_abort = False
    while policy.has_work():
        collect(policy.step(), tokens, reasons)
        for req in policy.retracted:
            if not retracted_abort:
                assert policy.abort(req.uid)
                retracted_abort = True
    assert retracted_abort, "nothing was retracted"
    assert reasons[0] == reasons[1] == reasons[4] == "abort"
    assert [r for u, r in reasons.items() if u in (2, 3)].count("abort") == 1
    assert 4 not in tokens
    assert_clean(policy)


def test_failed_step_ends_its_requests_and_the_rest_go_on() -> None:
    policy = make_policy(page_size=4)
    runner = runner_of(policy)
    policy.add_request(UserRequest(0, [1, 2, 3], greedy(8)))
    tokens: Dict[int, List[int]] = {}
    reasons: Dict[int, str] = {}
    for _ in range(3):
        collect(policy.step(), tokens, reasons)
    runner.fail_uid = 1
    policy.add_request(UserRequest(1, [4, 5, 6, 7, 8], greedy(8)))
    with pytest.raises(StepFailed) as failure:
        policy.step()
    assert failure.value.uids == [1]
    assert policy.active[0].status is Status.RETRACTED  # a decode row of the failed mixed step resumes
    runner.fail_uid = None
    more, reasons = drive(policy)
    assert tokens[0] + more[0] == reference([1, 2, 3], 8) and reasons == {0: "length"}
    assert 1 not in more
    assert_clean(policy)
    # nothing of the failed request entered the prefix cache: it runs as if new
    policy.add_request(UserRequest(2, [4, 5, 6, 7, 8], greedy(8)))
    assert drive(policy)[0][2] == reference([4, 5, 6, 7, 8], 8)
    assert_clean(policy)


def test_stop_token_ends_a_request() -> None:
    prompt = [9, 9, 9]
    ref = reference(prompt, 10)
    policy = make_policy()
    policy.add_request(UserRequest(0, prompt, greedy(10, stop_token_ids=[ref[3]])))
    tokens, reasons = drive(policy)
    assert tokens[0] == ref[: ref.index(ref[3]) + 1] and reasons[0] == "stop"
    assert_clean(policy)


def test_plans_carry_what_a_follower_needs() -> None:
    """share_rows (tp > 1): a follower can rebuild every request it runs from the plans alone."""
    policy = make_policy(share_rows=True, num_pages=60, init_new_token_ratio=0.05, min_new_token_ratio=0.05)
    reqs = [([i + 1] * 8, 20) for i in range(4)]
    for uid, (prompt, n) in enumerate(reqs):
        policy.add_request(UserRequest(uid, prompt, greedy(n, repetition_penalty=1.0 + 0.1 * (uid % 2))))
    mirrors: Dict[int, List[int]] = {}
    released: List[int] = []
    tokens, _ = drive(policy)
    policy.add_request(UserRequest(9, [1], greedy(1)))  # the last releases travel with the next plan
    drive(policy)
    for plan in runner_of(policy).plans:
        wire: StepPlan = pickle.loads(pickle.dumps(plan))
        assert wire.reqs == [] and wire.uids == plan.uids
        for uid in wire.releases:
            released.append(uid)
            if uid % 2:  # penalized: the follower saw every token but the last
                assert mirrors[uid] == reqs[uid][0] + tokens[uid][:-1]
            del mirrors[uid]
        for new in wire.new_rows:
            mirrors[new.uid] = list(new.prompt)
            assert EOS in new.stop_ids
        for uid, toks in wire.history.items():
            mirrors[uid] += toks
        assert set(wire.uids) <= set(mirrors)
        for i, (uid, end) in enumerate(zip(wire.uids, wire.ends)):
            if uid % 2:  # penalized: the history is complete up to the token fed last
                decoding = wire.is_decode or i < wire.num_decode_rows
                assert len(mirrors[uid]) == end if decoding else len(mirrors[uid]) >= end
    assert policy.stats().retractions > 0
    check_outputs(tokens, reqs)
    assert sorted(released) == [0, 1, 2, 3]
    assert_clean(policy)


def _prompt_tokens(plan: StepPlan) -> int:
    return 0 if plan.is_decode else sum(plan.ends) - sum(plan.starts) - plan.num_decode_rows


@pytest.mark.parametrize("max_step_ms", [40.0, 0.0])
def test_step_budget_caps_prompt_chunks_beside_streams(max_step_ms: float) -> None:
    """A fake clock: a step takes 10 ms + 0.1 ms per prompt token. A stream decodes while a
    1,500-token prompt arrives; with --max-step-ms 40 every step beside it carries at most
    (40 - 10) / 0.1 = 300 prompt tokens (as estimated from the steps so far), so the
    stream's steps stay near 40 ms; with 0 (off) the prompt goes in at once."""
    from minisgl.scheduler.step_budget import FLOOR

    policy = make_policy(num_pages=4096, max_seq_len=2048, max_step_ms=max_step_ms)
    runner = runner_of(policy)
    now = [0.0]
    step_ms: List[float] = []
    launch = runner.launch

    def timed_launch(plan: StepPlan) -> Any:
        step_ms.append(10.0 + 0.1 * _prompt_tokens(plan))
        now[0] += step_ms[-1] / 1e3
        return launch(plan)

    runner.launch = timed_launch  # type: ignore[method-assign]
    policy.clock = lambda: now[0]
    stream, late = [3] * 1000, [1 + i % 250 for i in range(1500)]
    policy.add_request(UserRequest(0, stream, greedy(300)))
    tokens: Dict[int, List[int]] = {}
    reasons: Dict[int, str] = {}
    for _ in range(5):
        collect(policy.step(), tokens, reasons)
    plans = runner.plans
    assert _prompt_tokens(plans[0]) == 1000, "nobody decodes yet: the prompt is not capped"
    policy.add_request(UserRequest(1, late, greedy(3)))
    while policy.has_work():
        collect(policy.step(), tokens, reasons)
    beside = [(_prompt_tokens(p), ms) for p, ms in zip(plans, step_ms) if p.is_prefill and p.num_decode_rows > 0]
    chunks = [n for n, _ in beside]
    assert sum(chunks) == 1500
    if max_step_ms == 0.0:
        assert policy.step_budget is None and chunks == [1500]
    else:
        # the estimate starts from the 1,000-token prefill counted whole (0.11 ms a token: 272
        # tokens) and moves toward the clock's 0.1 ms a token (300 tokens), never above it
        assert all(FLOOR <= n <= 301 for n in chunks[:-1]), chunks
        assert chunks[0] == int(30 / 0.11) and chunks[:-1] == sorted(chunks[:-1]), chunks
        assert max(ms for _, ms in beside) <= 40.1  # the stream's steps stay within the target
        assert policy.step_budget is not None and 0.1 < policy.step_budget.token_ms < 0.11
    check_outputs(tokens, [(stream, 300), (late, 3)])
    assert_clean(policy)


def test_step_budget_defaults() -> None:
    """--max-step-ms unset: on a CPU engine 3x the decode step, off on CUDA and over a given
    runner; 0: off everywhere; the offline LLM turns it off (throughput, nobody streams)."""
    from minisgl.scheduler.policy import Policy

    def budget(on_cpu: bool, **kw: Any) -> Any:
        config = SchedulerConfig(model_path="unused", tp_info=DistributedInfo(0, 1), dtype=torch.float32, **kw)
        return Policy(config, Limits(64, MAX_SEQ_LEN, 256, frozenset({EOS})), on_cpu=on_cpu).step_budget

    assert budget(True) is not None and budget(True).target_ms is None
    assert budget(False) is None and budget(True, max_step_ms=0.0) is None
    assert budget(False, max_step_ms=25.0).target_ms == 25.0
    with pytest.raises(ValueError, match="max_step_ms"):
        budget(True, max_step_ms=-1.0)
