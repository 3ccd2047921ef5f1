"""A scheduler step that raises ends only the requests it touched; the scheduler stays consistent
(no page or row leaks, nothing bad in the prefix cache) and serves everyone else unchanged.

Faults are injected into a real Scheduler on a tiny float32 model: the engine's forward for one
request's prefill, and the processing of one step's results. (How the server's scheduler loop
answers a failed step: tests/test_server_units.py.)
"""

from __future__ import annotations

from typing import Any, Dict, List

import pytest
from sched_helpers import TINY, assert_idle_and_clean, greedy, running_llm

from minisgl.scheduler import StepFailed, UserRequest

PROMPTS = [[5, 17, 33, 2, 9, 41, 7, 8], [11, 3, 250, 64, 1, 99], [77, 78, 79, 80, 81, 82, 83, 84, 85, 86, 87]]


def _drain(sched: Any, tokens: Dict[int, List[int]], failures: List[StepFailed]) -> None:
    while sched.has_work():
        try:
            outputs = sched.step()
        except StepFailed as exc:
            failures.append(exc)
            outputs = exc.outputs
        for out in outputs:
            if out.token_id is not None:
                tokens.setdefault(out.uid, []).append(out.token_id)


@pytest.mark.parametrize("overlap", [True, False])
def test_failed_prefill_ends_only_its_request(tiny_model_dir: Any, overlap: bool) -> None:
    with running_llm(tiny_model_dir(TINY), enable_overlap=overlap, page_size=4) as llm:
        ref = [r.token_ids for r in llm.generate(PROMPTS, greedy(10))]
        llm.scheduler.reset_prefix_cache()
        sched = llm.scheduler
        real_forward = sched.engine.forward_batch

        def faulty_forward(batch: Any, args: Any) -> Any:
            if batch.is_prefill and any(r.uid == 101 for r in batch.reqs):
                raise ValueError("injected fault")
            return real_forward(batch, args)

        sched.engine.forward_batch = faulty_forward
        tokens: Dict[int, List[int]] = {}
        failures: List[StepFailed] = []
        sched.add_request(UserRequest(100, PROMPTS[0], greedy(10)))
        for _ in range(3):  # request 100 is decoding when 101 arrives
            for out in sched.step():
                tokens.setdefault(out.uid, []).append(out.token_id)  # type: ignore[arg-type]
        sched.add_request(UserRequest(101, PROMPTS[1], greedy(10)))
        sched.add_request(UserRequest(102, PROMPTS[2], greedy(10)))
        _drain(sched, tokens, failures)
        sched.engine.forward_batch = real_forward
        assert len(failures) == 1 and 101 in failures[0].uids and 100 not in failures[0].uids
        assert isinstance(failures[0].__cause__, ValueError)
        assert tokens[100] == ref[0]  # the running request never noticed
        if 102 not in failures[0].uids:  # admitted in a later step: unaffected
            assert tokens[102] == ref[2]
        assert_idle_and_clean(sched)
        # the failed prompt runs normally now: nothing it left behind is reused
        assert [r.token_ids for r in llm.generate(PROMPTS, greedy(10))] == ref


def test_failure_while_reading_results(tiny_model_dir: Any) -> None:
    with running_llm(tiny_model_dir(TINY), enable_overlap=True) as llm:
        ref = [r.token_ids for r in llm.generate(PROMPTS[:2], greedy(6))]
        sched = llm.scheduler
        real = sched._process_flight
        fired = []

        def faulty(flight: Any) -> Any:
            if not fired and flight.plan.is_decode:
                fired.append(True)
                raise RuntimeError("injected while processing")
            return real(flight)

        sched._process_flight = faulty  # type: ignore[method-assign]
        for i, p in enumerate(PROMPTS[:2]):
            sched.add_request(UserRequest(200 + i, p, greedy(6)))
        tokens: Dict[int, List[int]] = {}
        failures: List[StepFailed] = []
        _drain(sched, tokens, failures)
        sched._process_flight = real  # type: ignore[method-assign]
        assert len(failures) == 1 and sorted(failures[0].uids) == [200, 201]
        assert_idle_and_clean(sched)
        assert [r.token_ids for r in llm.generate(PROMPTS[:2], greedy(6))] == ref
