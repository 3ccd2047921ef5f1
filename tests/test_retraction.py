"""Optimistic admission and retraction (issue 13): with a pool that fits ~3 worst-case
requests, 24 requests without max_tokens all complete with many running at once; requests are
retracted when a decode step runs out of pages and resume by recompute; outputs equal HF's
greedy tokens (fp32) and no page leaks."""

from __future__ import annotations

import random
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List

import pytest
import torch
from helpers import TEST_ATTENTION_BACKEND, TEST_DEVICE
from sched_helpers import assert_idle_and_clean, assert_match_ref

from minisgl.core import SamplingParams
from minisgl.distributed import DistributedInfo
from minisgl.scheduler import Scheduler, SchedulerConfig, UserRequest

CTX = 384
REF_LEN = 64


@contextmanager
def small_pool_scheduler(model_path: Any, **kw: Any) -> Iterator[Scheduler]:
    page_size = kw.get("page_size", 1)
    kw.setdefault("num_page_override", 3 * CTX // page_size + 4)  # ~3 worst-case requests
    kw.setdefault("max_running_req", 32)
    sched = Scheduler(
        SchedulerConfig(
            model_path=str(model_path),
            tp_info=DistributedInfo(0, 1),
            dtype=torch.float32,
            device=TEST_DEVICE,
            attention_backend=TEST_ATTENTION_BACKEND,
            max_seq_len_override=CTX,
            **kw,
        )
    )
    try:
        yield sched
        assert_idle_and_clean(sched)
    finally:
        sched.shutdown()


def chat_workload(refs, n: int = 24, seed: int = 13, num_long: int = 4):
    """Prompts of 8-24 tokens, no max_tokens. Most stop at a token their greedy reference
    reaches after 4-48 tokens (as chats stop at EOS long before the context ends); every
    (n / num_long)-th never stops and runs to the context's end, so together they outgrow the
    pool. Returns prompts, stop ids (None: none), and (tokens, scores, finish reason) expected."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, 256) for _ in range(rng.randint(8, 24))] for _ in range(n)]
    stops: List[int | None] = []
    expected = []
    for i, p in enumerate(prompts):
        if num_long and i % (n // num_long) == n // num_long - 1:
            ref, scores = refs.get(p, CTX - len(p))
            stops.append(None)
            expected.append((ref, scores, "length"))
            continue
        ref, scores = refs.get(p, REF_LEN)
        stop = ref[rng.randint(4, 48)]
        end = ref.index(stop) + 1
        stops.append(stop)
        expected.append((ref[:end], scores[:end], "stop"))
    return prompts, stops, expected


def chat_params(stop: int | None) -> SamplingParams:
    return SamplingParams(temperature=0.0, stop_token_ids=[] if stop is None else [stop])


def run_all(sched: Scheduler, prompts, stops) -> tuple[Dict[int, List[int]], Dict[int, str], int]:
    for uid, (p, stop) in enumerate(zip(prompts, stops)):
        sched.add_request(UserRequest(uid, list(p), chat_params(stop)))
    tokens: Dict[int, List[int]] = {}
    finish: Dict[int, str] = {}
    peak = 0
    steps = 0
    while sched.has_work():
        for out in sched.step():
            assert out.uid not in finish, f"output for {out.uid} after it finished (duplicated by a resume?)"
            if out.token_id is not None:
                tokens.setdefault(out.uid, []).append(out.token_id)
            if out.finished:
                finish[out.uid] = out.finish_reason or ""
        peak = max(peak, sched.stats().num_running)
        steps += 1
        assert steps < 20_000
    return tokens, finish, peak


@pytest.mark.parametrize("overlap,page_size", [(True, 1), (False, 1), (True, 4)])
def test_optimistic_admission_retracts_and_resumes(tiny_dir, refs, overlap, page_size):
    prompts, stops, expected = chat_workload(refs)
    with small_pool_scheduler(tiny_dir, enable_overlap=overlap, page_size=page_size) as sched:
        tokens, finish, peak = run_all(sched, prompts, stops)
        stats = sched.stats()
        assert stats.retractions >= 1, "the pool never ran short: the test does not exercise retraction"
        assert peak >= 12 and stats.peak_running >= 12, (peak, stats.peak_running)
        for uid, (ref, scores, reason) in enumerate(expected):
            assert finish[uid] == reason, (uid, finish[uid], len(tokens[uid]))
            assert_match_ref(tokens[uid], ref, scores, f"uid {uid}")


def test_worst_case_admission_never_retracts(tiny_dir, refs):
    prompts, stops, expected = chat_workload(refs, n=8, num_long=2)
    with small_pool_scheduler(tiny_dir, admission="worst-case") as sched:
        tokens, finish, peak = run_all(sched, prompts, stops)
        assert sched.stats().retractions == 0
        assert peak <= 3  # each request reserved its whole context
        for uid, (ref, scores, reason) in enumerate(expected):
            assert finish[uid] == reason
            assert_match_ref(tokens[uid], ref, scores, f"uid {uid}")


def test_abort_of_a_retracted_request_frees_everything(tiny_dir, refs):
    prompts, stops, _ = chat_workload(refs)
    with small_pool_scheduler(tiny_dir) as sched:
        for uid, (p, stop) in enumerate(zip(prompts, stops)):
            sched.add_request(UserRequest(uid, list(p), chat_params(stop)))
        aborted = set()
        while sched.has_work():
            outs = sched.step()
            for req in list(sched.retracted):
                if req.uid not in aborted:
                    assert sched.abort(req.uid)
                    aborted.add(req.uid)
            for out in outs:
                if out.uid in aborted and out.finished:
                    assert out.finish_reason == "abort"
        assert aborted, "nothing was retracted"


def test_priority_policy_admits_the_most_urgent_first(tiny_dir) -> None:
    """--schedule-policy priority: with one table row, queued requests run lowest priority
    value first (FIFO among equals); under FCFS a non-zero priority is refused, naming it."""
    from minisgl.sampling_params import InvalidRequest

    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14], [15, 16]]
    priorities = [5, 0, 3, -1, 0]
    with small_pool_scheduler(tiny_dir, schedule_policy="priority", max_running_req=1) as sched:
        for uid, (p, pr) in enumerate(zip(prompts, priorities)):
            sched.add_request(UserRequest(uid, p, SamplingParams(temperature=0.0, max_tokens=3, priority=pr)))
        order: List[int] = []
        while sched.has_work():
            for out in sched.step():
                if out.finished:
                    order.append(out.uid)
        assert order == [3, 1, 4, 2, 0]
    with small_pool_scheduler(tiny_dir) as sched:
        with pytest.raises(InvalidRequest, match="schedule-policy priority") as err:
            sched.add_request(UserRequest(0, [1, 2], SamplingParams(max_tokens=2, priority=1)))
        assert err.value.param == "priority"
        sched.add_request(UserRequest(1, [1, 2], SamplingParams(max_tokens=2, priority=0)))
        while sched.has_work():
            sched.step()


@pytest.mark.parametrize("mixed", [True, False])
def test_a_stream_gets_a_token_every_step_while_long_prompts_prefill(tiny_dir, mixed) -> None:  # noqa: F811
    """Mixed batches: while four 300-token prompts are prefilled in 16-token chunks, the decoding
    stream's row rides along in every step, so it gets exactly one token per step (the step that
    would stall it for a whole prefill never exists). Counted in steps, not timed: what a stall
    costs in milliseconds is benchmark/mixed_gap.py's to measure. With mixed_batches off, prefill
    and decode alternate and the stream misses steps."""
    chunk, long_len = 16, 300
    with small_pool_scheduler(tiny_dir, max_extend_tokens=chunk, mixed_batches=mixed, num_page_override=4 * CTX) as sched:
        stream = UserRequest(0, [3, 1, 4, 1, 5], SamplingParams(temperature=0.0, max_tokens=CTX - 8, ignore_eos=True))
        sched.add_request(stream)
        got = 0
        while got < 3:
            got += sum(o.uid == 0 and o.token_id is not None for o in sched.step())
        rng = random.Random(7)
        for uid in range(1, 5):
            prompt = [rng.randrange(1, 256) for _ in range(long_len)]
            sched.add_request(UserRequest(uid, prompt, SamplingParams(temperature=0.0, max_tokens=2)))
        first_token: set = set()
        per_step: List[int] = []
        while len(first_token) < 4:
            outs = sched.step()
            per_step.append(sum(o.uid == 0 and o.token_id is not None for o in outs))
            first_token |= {o.uid for o in outs if o.uid != 0 and o.token_id is not None}
            assert len(per_step) <= 4 * long_len, "the long prompts never finished prefilling"
        sched.abort(0)
        while sched.has_work():
            sched.step()
    # at least the chunks the four prompts need: the stream was watched across all of them
    assert len(per_step) >= 4 * long_len // chunk, len(per_step)
    if mixed:
        assert per_step == [1] * len(per_step), per_step
    else:
        assert per_step.count(0) >= 4 * long_len // chunk - 1, per_step
