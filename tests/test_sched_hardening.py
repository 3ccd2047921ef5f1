"""Scheduler-loop hardening: grammars compile off the loop, and fair admission.

The grammar tests run a real Scheduler over the tiny chat model, with the compiles a test must see
running held behind a gate (no clock); the fairness tests drive the host-only policy
with the fake runner of tests/test_policy.py (steps, no clock).
"""

from __future__ import annotations

import json
import threading
from typing import Any, Dict, Iterator, List

import pytest
import torch
from helpers import TEST_ATTENTION_BACKEND, TEST_DEVICE
from sched_helpers import assert_idle_and_clean

from minisgl.distributed import DistributedInfo
from minisgl.sampling_params import GrammarSpec, InvalidRequest, SamplingParams
from minisgl.scheduler import Scheduler, SchedulerConfig, UserRequest, grammar_compile


def nested_schema(depth: int) -> str:
    """A JSON schema nested `depth` objects deep, every property optional: it compiles in
    seconds over a 49k vocabulary (depth 200: 1.6 s on the CI CPU), yet `{}` satisfies it."""
    schema: Dict[str, Any] = {"type": "string", "maxLength": 4}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema, "b": {"type": "integer"}}, "additionalProperties": False}
    return json.dumps(schema)


# ---- TP: every rank compiles (rank 0 tells the followers), the ranks agree ----------------------
# (first in the module: it builds its own engines before the module's shared Scheduler exists)


def test_tp2_grammar_matches_tp1(tmp_path_factory: pytest.TempPathFactory) -> None:
    from sched_helpers import llm_kwargs
    from test_structured_output import SCHEMAS, build_tiny_bpe_model

    from minisgl.llm import LLM

    path = build_tiny_bpe_model(tmp_path_factory.mktemp("bpe_tp"))
    kw = llm_kwargs(max_seq_len_override=256, num_page_override=1024, max_running_req=4)
    params = [SamplingParams(max_tokens=40, grammar=GrammarSpec("json_schema", json.dumps(s))) for s in SCHEMAS[:3]]
    prompts = [[1, 2, 3], [4, 5], [6]]
    with LLM(path, **kw) as llm1:
        ref = [r.token_ids for r in llm1.generate(prompts, params)]
    llm2 = LLM(path, tp=2, **kw)
    try:
        sched = llm2.scheduler
        for uid, (p, sp) in enumerate(zip(prompts, params), start=500):
            sched.add_request(UserRequest(uid, p, sp))  # compiled off the loop, on every rank
        got: Dict[int, List[int]] = {}
        while sched.has_work():
            for out in sched.step():
                if out.token_id is not None:
                    got.setdefault(out.uid, []).append(out.token_id)
        assert [got[500 + i] for i in range(3)] == ref
        fps = sched.rank_fingerprints()
        assert fps[0] == fps[1]
        assert_idle_and_clean(sched)
    finally:
        llm2.shutdown()


@pytest.fixture(scope="module")
def sched(tiny_chat_model: str) -> Iterator[Scheduler]:
    s = Scheduler(
        SchedulerConfig(
            model_path=tiny_chat_model,
            tp_info=DistributedInfo(0, 1),
            dtype=torch.float32,
            device=TEST_DEVICE,
            attention_backend=TEST_ATTENTION_BACKEND,
            max_running_req=8,
            max_seq_len_override=1024,
            num_page_override=4096,
        )
    )
    try:
        yield s
    finally:
        s.shutdown()


def _run(sched: Scheduler, uid: int, params: SamplingParams, prompt: List[int]) -> List[int]:
    sched.add_request(UserRequest(uid, prompt, params))
    tokens: List[int] = []
    while sched.has_work():
        for out in sched.step():
            if out.uid == uid and out.token_id is not None:
                tokens.append(out.token_id)
    return tokens


class GatedCompiles:
    """Holds the scheduler's grammar compiles of one schema until the test opens the gate: a compile
    then lasts exactly as long as the test wants, on any machine, with no clock."""

    def __init__(self, sched: Scheduler, held: str) -> None:
        self.gate = threading.Event()
        self.entered = threading.Event()
        pool = sched.compile_pool()
        real = pool._compile

        def compile(spec: GrammarSpec) -> Any:
            if spec.value == held:
                self.entered.set()
                assert self.gate.wait(120), "the gate was never opened"
            return real(spec)

        pool._compile = compile


def test_grammar_compiles_off_the_loop(sched: Scheduler) -> None:
    """A stream keeps getting tokens while another request's grammar compiles: the compile is held
    (gated) until the stream has made 20 more tokens, which a loop blocked on it never would."""
    schema = nested_schema(3)
    gated = GatedCompiles(sched, schema)
    constrained = SamplingParams(max_tokens=24, grammar=GrammarSpec("json_schema", schema))
    stream_uid, uid = 401, 400
    sched.add_request(UserRequest(stream_uid, [5, 6, 7], SamplingParams(max_tokens=900, ignore_eos=True)))
    streamed = 0
    tokens: List[int] = []
    finish: str | None = None
    while finish is None:
        for out in sched.step():
            if out.uid == stream_uid and out.token_id is not None:
                streamed += 1
            elif out.uid == uid:
                if out.token_id is not None:
                    tokens.append(out.token_id)
                finish = out.finish_reason if out.finished else None
        if streamed == 3:
            sched.add_request(UserRequest(uid, [9, 10, 11], constrained))
            assert uid in sched.compiling
        if streamed == 23:
            assert gated.entered.is_set() and uid in sched.compiling, "the compile was not held while the stream ran"
            gated.gate.set()
        assert streamed < 900, "the stream ended before the grammar request did"
    assert streamed > 23
    assert sched.abort(stream_uid)
    sched.run_until_idle()
    assert_idle_and_clean(sched)
    # Correct output: what the same request produces alone (its grammar now cached: admitted at once).
    assert finish in ("stop", "length")
    assert _run(sched, 3, constrained, [9, 10, 11]) == tokens
    assert_idle_and_clean(sched)


def test_bad_grammar_fails_only_its_request(sched: Scheduler) -> None:
    sched.add_request(UserRequest(10, [5, 6], SamplingParams(max_tokens=4, grammar=GrammarSpec("json_schema", '{"type": "objec"}'))))
    sched.add_request(UserRequest(11, [5, 6], SamplingParams(max_tokens=4)))
    done: Dict[int, str | None] = {}
    rejected: List[tuple[int, InvalidRequest]] = []
    while sched.has_work():
        for out in sched.step():
            if out.finished:
                done[out.uid] = out.finish_reason
        rejected += sched.take_rejected()
    assert done == {11: "length"}
    assert [(uid, e.status, e.param) for uid, e in rejected] == [(10, 400, "response_format")]
    assert rejected[0][1].message.startswith("invalid JSON schema")
    assert_idle_and_clean(sched)


def test_abort_while_compiling(sched: Scheduler) -> None:
    sched.add_request(UserRequest(20, [5], SamplingParams(max_tokens=4, grammar=GrammarSpec("json_schema", nested_schema(120)))))
    assert 20 in sched.compiling
    assert sched.abort(20)
    outs = sched.step()
    assert [(o.uid, o.finish_reason) for o in outs] == [(20, "abort")]
    assert not sched.has_work() and not sched.take_rejected()
    assert_idle_and_clean(sched)


def test_compile_timeout_is_a_400(sched: Scheduler, monkeypatch: pytest.MonkeyPatch) -> None:
    schema = nested_schema(121)
    gated = GatedCompiles(sched, schema)  # held past the timeout on any machine
    monkeypatch.setattr(grammar_compile, "COMPILE_TIMEOUT_S", 0.05)
    sched.add_request(UserRequest(30, [5], SamplingParams(max_tokens=4, grammar=GrammarSpec("json_schema", schema))))
    rejected: List[tuple[int, InvalidRequest]] = []
    while sched.has_work():
        sched.step()
        rejected += sched.take_rejected()
    assert [(uid, e.status, e.param) for uid, e in rejected] == [(30, 400, "response_format")]
    assert rejected[0][1].message.startswith("grammar too complex")
    gated.gate.set()  # (the held compile finishes in the background)
    assert_idle_and_clean(sched)


# ---- fair admission (the host-only policy over test_policy's fake runner) ----------------------

GROUP_N = 64  # one client's n=64 choices
GROUP_PROMPT, GROUP_BUDGET = [3, 4, 5, 6, 7, 8, 9, 10], 110  # long budgets: their estimate fills the pool
SMALL_PROMPT, SMALL_BUDGET = [20, 21, 22, 23], 4


def _fair_policy(**kw: Any) -> Scheduler:
    from test_policy import make_policy

    # 1024 pages: the group's estimate (64 x (8 + 0.5 x 110) tokens) is ~4x the pool, so FIFO
    # admits a quarter of it and keeps the rest, and anything queued behind it, waiting.
    return make_policy(num_pages=1024, max_running_req=128, max_extend_tokens=256, **kw)


def _first_token_step(
    policy: Scheduler, uid: int, tokens: Dict[int, List[int]] | None = None, max_steps: int = 2000
) -> tuple[int, Dict[int, List[int]], Dict[int, str]]:
    """Steps from now until `uid` gets its first token (1: the next step), then run to the end."""
    from test_policy import collect

    tokens = {} if tokens is None else tokens
    reasons: Dict[int, str] = {}
    ttft = 0
    for step in range(1, max_steps + 1):
        if not policy.has_work():
            break
        collect(policy.step(), tokens, reasons)
        if not ttft and tokens.get(uid):
            ttft = step
    assert not policy.has_work(), "the policy did not finish its work"
    return ttft, tokens, reasons


def test_a_single_request_is_not_queued_behind_an_n64_group() -> None:
    from test_policy import assert_clean, collect, greedy, reference

    alone = _fair_policy()
    alone.add_request(UserRequest(1000, SMALL_PROMPT, greedy(SMALL_BUDGET)))
    ttft_alone, _, _ = _first_token_step(alone, 1000)
    assert ttft_alone == 1

    policy = _fair_policy()
    for i in range(GROUP_N):  # the n choices of one request: one group
        policy.add_request(UserRequest(i, GROUP_PROMPT, greedy(GROUP_BUDGET, ignore_eos=True), group=0))
    early: Dict[int, List[int]] = {}
    for _ in range(3):  # the group is admitted and decoding (as far as the estimate lets it)
        collect(policy.step(), early, {})
    admitted = len(policy.active)
    assert 0 < admitted < GROUP_N, "the scenario needs a group the pool cannot take at once"
    policy.add_request(UserRequest(1000, SMALL_PROMPT, greedy(SMALL_BUDGET)))
    # The rule: the newcomer's group was never served, so it is the next request considered
    # (round-robin), and neither the group's estimate nor its rows can hold it back: K = 1.
    ttft, tokens, reasons = _first_token_step(policy, 1000, early)
    assert ttft <= 1, f"the single request waited {ttft} steps"
    assert ttft <= 3 * ttft_alone
    assert tokens[1000] == reference(SMALL_PROMPT, SMALL_BUDGET)
    assert all(tokens[i] == reference(GROUP_PROMPT, GROUP_BUDGET) for i in range(GROUP_N))
    assert set(reasons.values()) == {"length"}
    assert_clean(policy)


def test_the_last_row_is_kept_for_a_new_group() -> None:
    from test_policy import assert_clean, greedy, make_policy

    policy = make_policy(num_pages=1024, max_running_req=8)
    for i in range(GROUP_N):
        policy.add_request(UserRequest(i, GROUP_PROMPT, greedy(20, ignore_eos=True), group=0))
    policy.step()
    assert len(policy.active) == 7, "a group may not take the last free row"
    policy.add_request(UserRequest(1000, SMALL_PROMPT, greedy(SMALL_BUDGET)))
    policy.step()
    assert 1000 in policy.active
    _first_token_step(policy, 1000)
    assert_clean(policy)


def test_priority_comes_before_fairness() -> None:
    from test_policy import assert_clean, greedy

    policy = _fair_policy(schedule_policy="priority")
    for i in range(GROUP_N):
        policy.add_request(UserRequest(i, GROUP_PROMPT, greedy(GROUP_BUDGET, ignore_eos=True), group=0))
    for _ in range(3):
        policy.step()
    # less urgent than the waiting group: not considered while a more urgent request waits
    policy.add_request(UserRequest(1000, SMALL_PROMPT, greedy(SMALL_BUDGET, priority=1)))
    policy.step()
    assert 1000 not in policy.active and any(r.sampling_params.priority == 0 for r in policy.waiting)
    # as urgent as the group: fairness within the level admits it at once
    policy.add_request(UserRequest(1001, SMALL_PROMPT, greedy(SMALL_BUDGET)))
    policy.step()
    assert 1001 in policy.active and 1000 not in policy.active
    _first_token_step(policy, 1000)
    assert_clean(policy)


# ---- prompt logprobs: bounded memory, per prefill chunk ------------------------------------------


def _prompt_lps(sched: Scheduler, uid: int, prompt: List[int], k: int) -> List[Any]:
    sched.add_request(UserRequest(uid, prompt, SamplingParams(max_tokens=1, prompt_logprobs=k)))
    got: List[Any] = []
    while sched.has_work():
        for out in sched.step():
            if out.uid == uid and out.prompt_logprobs is not None:
                got = out.prompt_logprobs
    return got


def test_prompt_logprobs_in_row_chunks_are_the_same(sched: Scheduler, monkeypatch: pytest.MonkeyPatch) -> None:
    import minisgl.engine.engine as engine_mod

    prompt = [(i * 7919) % 40000 + 10 for i in range(300)]
    whole = _prompt_lps(sched, 40, prompt, 4)
    rows: List[int] = []
    real = engine_mod._logprobs_on_device

    def counting(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> Any:
        rows.append(logits.shape[0])
        return real(logits, tokens, k)

    monkeypatch.setattr(engine_mod, "PROMPT_LOGPROB_ROWS", 64)
    monkeypatch.setattr(engine_mod, "_logprobs_on_device", counting)
    chunked = _prompt_lps(sched, 41, prompt, 4)
    assert len(whole) == len(prompt) - 1
    assert chunked == whole  # bitwise: every op is per row
    assert max(rows) == 64 and sum(rows) >= len(prompt) - 1  # never [prompt, vocab] at once
    assert_idle_and_clean(sched)


def test_a_long_prompt_logprob_request_lets_others_decode(monkeypatch: pytest.MonkeyPatch) -> None:
    from test_policy import assert_clean, collect, greedy, make_policy, runner_of

    from minisgl.scheduler import policy as policy_mod

    monkeypatch.setattr(policy_mod, "PROMPT_LOGPROB_CHUNK", 16)  # (the fake model's context is 128)
    policy = make_policy(num_pages=4096, max_running_req=4, max_extend_tokens=4096)
    policy.add_request(UserRequest(1, [5, 6, 7], greedy(60, ignore_eos=True)))
    tokens: Dict[int, List[int]] = {}
    collect(policy.step(), tokens, {})
    policy.add_request(UserRequest(2, [(i * 37) % 200 + 1 for i in range(100)], greedy(1, prompt_logprobs=2)))
    chunks = []
    while policy.has_work():
        before = len(tokens.get(1, []))
        collect(policy.step(), tokens, {})
        plan = runner_of(policy).plans[-1]
        if 2 in plan.uids:
            i = plan.uids.index(2)
            chunks.append(plan.ends[i] - plan.starts[i])
            assert len(tokens[1]) == before + 1, "the decoding request waited for the prompt"
    assert max(chunks) == 16 and sum(chunks) == 100 and len(chunks) == 7
    assert len(tokens[1]) == 60 and len(tokens[2]) == 1
    assert_clean(policy)


def test_retraction_takes_the_big_group_first() -> None:
    from test_policy import assert_clean, collect, greedy, make_policy, reference

    # 400 pages for 8 + 1 requests that grow to 8 + 100 tokens each: the pool runs out while
    # they decode, and a retraction must pick victims
    policy = make_policy(num_pages=400, max_running_req=16, max_extend_tokens=256)
    for i in range(8):
        policy.add_request(UserRequest(i, GROUP_PROMPT, greedy(100, ignore_eos=True), group=0))
    tokens: Dict[int, List[int]] = {}
    reasons: Dict[int, str] = {}
    collect(policy.step(), tokens, reasons)
    policy.add_request(UserRequest(1000, SMALL_PROMPT, greedy(100, ignore_eos=True)))
    single = None
    while policy.has_work():
        collect(policy.step(), tokens, reasons)
        single = single or policy.active.get(1000)
    assert policy.stats().retractions > 0, "the scenario needs the pool to run out"
    assert single is not None and single.num_retractions == 0, "the single request was retracted before the group's"
    assert tokens[1000] == reference(SMALL_PROMPT, 100)
    assert all(tokens[i] == reference(GROUP_PROMPT, 100) for i in range(8))
    assert_clean(policy)


def test_one_api_call_is_one_group(tmp_path: Any) -> None:
    """Frontend.submit gives the requests of one call (n choices, several prompts) one group; the
    tokenizer worker carries it on to the scheduler (UserMsg), whose UserRequest is built from it."""
    import asyncio

    import zmq

    from minisgl.message import TokenizeMsg, decode_msg
    from minisgl.server.frontend import Frontend
    from minisgl.server.process_utils import IpcAddrs

    addrs = IpcAddrs.in_dir(str(tmp_path))
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind(addrs.tokenizer)
    frontend = Frontend(addrs)
    try:
        uids = [frontend.new_uid() for _ in range(4)]
        frontend.submit([TokenizeMsg(uid, text="x") for uid in uids[:3]])
        frontend.submit([TokenizeMsg(uids[3], text="y")])
        got = [decode_msg(pull.recv()) for _ in range(4)]
        assert [(m.uid, m.group) for m in got] == [(uids[0], uids[0]), (uids[1], uids[0]), (uids[2], uids[0]), (uids[3], 0)]
    finally:
        asyncio.run(frontend.close())
        pull.close(linger=0)
        ctx.term()
