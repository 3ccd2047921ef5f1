"""Scheduler-loop hardening: grammars compile off the loop, and fair admission.

The grammar tests run a real Scheduler over the tiny chat model (its 49,152-token vocabulary is
what makes a deep JSON schema slow to compile); the fairness tests drive the host-only policy
with the fake runner of tests/test_policy.py (steps, no clock).
"""

from __future__ import annotations

import json
import time
from typing import Any, Dict, Iterator, List

import pytest
import torch
from helpers import TEST_ATTENTION_BACKEND, TEST_DEVICE
from sched_helpers import assert_idle_and_clean

from minisgl.distributed import DistributedInfo
from minisgl.sampling_params import GrammarSpec, InvalidRequest, SamplingParams
from minisgl.scheduler import Scheduler, SchedulerConfig, UserRequest, grammar_compile

GAP_BAR_S = 0.5  # the bar: a stream's longest pause while another request's grammar compiles


def nested_schema(depth: int) -> str:
    """A JSON schema nested `depth` objects deep, every property optional: it compiles in
    seconds over a 49k vocabulary (depth 200: 1.6 s on the CI CPU), yet `{}` satisfies it."""
    schema: Dict[str, Any] = {"type": "string", "maxLength": 4}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema, "b": {"type": "integer"}}, "additionalProperties": False}
    return json.dumps(schema)


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


def test_slow_grammar_compiles_off_the_loop(sched: Scheduler) -> None:
    stream_uid, constrained_uid = 1, 2
    constrained = SamplingParams(max_tokens=24, grammar=GrammarSpec("json_schema", nested_schema(200)))
    sched.add_request(UserRequest(stream_uid, [5, 6, 7], SamplingParams(max_tokens=900, ignore_eos=True)))
    stamps: List[float] = []  # when the stream got each token
    tokens: List[int] = []
    finish: str | None = None
    submitted = False
    while finish is None:
        for out in sched.step():
            if out.uid == stream_uid and out.token_id is not None:
                stamps.append(time.perf_counter())
            elif out.uid == constrained_uid:
                if out.token_id is not None:
                    tokens.append(out.token_id)
                finish = out.finish_reason if out.finished else None
        if not submitted and len(stamps) >= 3:
            sched.add_request(UserRequest(constrained_uid, [9, 10, 11], constrained))
            job = sched.compiling[constrained_uid]
            start = len(stamps)
            submitted = True
        assert len(stamps) < 900, "the stream ended before the grammar request did"
    gaps = [b - a for a, b in zip(stamps[start - 1 :], stamps[start:])]
    assert job.seconds > GAP_BAR_S, f"the grammar compiled in {job.seconds:.2f} s: too fast to prove anything"
    assert len(gaps) > 5 and max(gaps) < GAP_BAR_S, f"longest stream gap {max(gaps):.3f} s while a grammar compiled {job.seconds:.2f} s"
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
    assert "invalid json_schema grammar" in rejected[0][1].message
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
    monkeypatch.setattr(grammar_compile, "COMPILE_TIMEOUT_S", 0.05)
    sched.add_request(UserRequest(30, [5], SamplingParams(max_tokens=4, grammar=GrammarSpec("json_schema", nested_schema(121)))))
    rejected: List[tuple[int, InvalidRequest]] = []
    while sched.has_work():
        sched.step()
        rejected += sched.take_rejected()
    assert [(uid, e.status, e.param) for uid, e in rejected] == [(30, 400, "response_format")]
    assert rejected[0][1].message.startswith("grammar too complex")
    assert_idle_and_clean(sched)
