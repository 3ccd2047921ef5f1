"""The scheduler of one rank: the step loop that drives a Policy (host, `policy.py`) and a runner
(device, `runner.py`; over one Engine unless a runner is given, as the policy tests do).

With overlap scheduling, step N+1 is planned and launched before step N's results are read
back; results then lag by one step, and pages of requests that finished are released only
after every step that may still use them has completed.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, List, Protocol, Set

import torch

from minisgl.engine import Engine
from minisgl.scheduler.config import SchedulerConfig
from minisgl.scheduler.plan import StepPlan
from minisgl.scheduler.policy import Limits, Policy, SchedulerStats
from minisgl.scheduler.request import TokenOutput
from minisgl.scheduler.runner import Runner, is_fatal
from minisgl.utils.hf import resolve_model_path
from minisgl.utils.logger import init_logger

logger = init_logger(__name__)

COMPILE_WAIT_S = 0.02  # the longest an idle loop waits for a grammar compile before it reads messages again

__all__ = ["Scheduler", "SchedulerStats", "StepFailed", "StepRunner", "is_fatal"]


class StepRunner(Protocol):
    """What the loop needs of a runner (`runner.Runner`, or a fake in the policy tests).

    `launch` must advance every row of the plan as the engine does (`complete_one`: the fed
    tokens are cached, one more token is on the way) before it returns."""

    def launch(self, plan: StepPlan) -> Any: ...
    def wait(self, flight: Any) -> None: ...
    def results(self, flight: Any) -> Any: ...  # a runner.StepResult
    def synchronize(self) -> None: ...
    def is_fatal(self, exc: BaseException) -> bool: ...
    def use_grammar(self, backend: Any) -> None: ...


class StepFailed(RuntimeError):
    """`Scheduler.step()` raised; the requests in `uids` were ended (finish reason "error") and
    their resources released. `outputs` are the step's results that were ready before the error
    (abort notices); `__cause__` is the original exception."""

    def __init__(self, uids: List[int], outputs: List[TokenOutput], cause: BaseException) -> None:
        super().__init__(f"a scheduler step failed ({type(cause).__name__}: {cause}); requests ended: {uids}")
        self.uids = uids
        self.outputs = outputs


@dataclass
class _InFlight:
    plan: StepPlan
    flight: Any  # the runner's handle
    launched_at: float = 0.0  # Scheduler.clock() before the launch


class Scheduler(Policy):
    def __init__(self, config: SchedulerConfig, runner: StepRunner | None = None, limits: Limits | None = None) -> None:
        runner_is_engine = runner is None
        draft_engine: Engine | None = None
        if config.speculative_algorithm == "draft" and runner is not None:
            raise ValueError("speculative_algorithm='draft' needs the scheduler's own engine (its draft model runs beside it)")
        if runner is None:
            if config.speculative_algorithm == "draft":
                from minisgl.scheduler.spec_draft import build_draft_engine, draft_config, memory_reserve

                draft = draft_config(config)  # (refuses another vocabulary before any weight loads)
                self.engine = Engine(config, reserve=memory_reserve(draft))
                try:
                    draft_engine = build_draft_engine(draft, self.engine)
                except BaseException:
                    self.engine.shutdown()
                    raise
            else:
                self.engine = Engine(config)
            self.device = self.engine.device
            model_config = self.engine.config.model_config
            eos = set(model_config.eos_token_ids) | _generation_eos(config.model_path)
            spec = self.engine.pooling_spec
            pooling = spec.method if spec is not None else None
            windows = [w for w in model_config.layer_windows if w is not None]
            limits = Limits(self.engine.num_pages, self.engine.max_seq_len, model_config.vocab_size, frozenset(eos), pooling,
                            fast_step_tokens=self.engine.fast_step_tokens, window_pages=self.engine.num_window_pages,
                            window=max(windows) if windows else None)  # fmt: skip
            runner = self._make_runner(self.engine)
            # On a CPU the forward runs to completion inside the launch: there is nothing for
            # the host to overlap, and reading results a step late only delays every token by a
            # step. An explicit enable_overlap still wins (the tests run both ways).
            self.overlap = config.overlap and (config.enable_overlap is not None or self.device.type != "cpu")
        else:
            assert limits is not None, "a scheduler over a given runner needs its limits"
            self.overlap = config.overlap
        if config.speculative_algorithm is not None and self.overlap:
            # a verify step's accepted length decides where the next step starts
            logger.info("speculative decoding (%s) runs the non-overlap loop", config.speculative_algorithm)
            self.overlap = False
        self.runner = runner
        on_cpu = runner_is_engine and self.device.type == "cpu"
        super().__init__(config, limits, share_rows=config.tp_info.size > 1, on_grammar=runner.use_grammar, on_cpu=on_cpu)
        self.draft_engine = draft_engine
        if draft_engine is not None:
            from minisgl.scheduler.spec_draft import DraftModelProposer

            self.proposer = DraftModelProposer(draft_engine)
        self.clock: Callable[[], float] = time.perf_counter  # times steps for the step budget (tests inject one)
        self._in_flight: _InFlight | None = None
        self._processing: _InFlight | None = None  # the step whose results are being read
        self._step_plans: List[StepPlan] = []  # what the current step planned (for _recover)
        self._host_s = self._wait_s = 0.0

    def _make_runner(self, engine: Engine) -> Runner:
        return Runner(engine)

    @property
    def token_pool(self) -> torch.Tensor:
        assert isinstance(self.runner, Runner)
        return self.runner.token_pool

    def has_work(self) -> bool:
        return self._in_flight is not None or super().has_work()

    # ---- the loop ----------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> List[TokenOutput]:
        """Plan and launch one step; return the tokens of the step that completed.

        If the step raises, the requests it touched are ended (their pages freed, none of their
        KV kept in the prefix cache) and `StepFailed` names them; the scheduler stays consistent
        and the next step serves everyone else. Errors that mean the engine itself is broken
        (out of memory, a CUDA error) propagate unchanged: see `runner.is_fatal`."""
        outputs = self.take_early()
        self._step_plans = []
        try:
            return outputs + self._step()
        except Exception as exc:
            # With TP ranks in lockstep a rank cannot recover alone (the others may wait in a
            # collective): any failure is fatal there.
            if self.runner.is_fatal(exc) or self.config.tp_info.size > 1:
                raise
            failed = self._recover()
            raise StepFailed(failed, outputs, exc) from exc

    def _step(self) -> List[TokenOutput]:
        outputs: List[TokenOutput] = []
        decodable, need = self.decodable()
        if self._in_flight is not None and self.must_retract(decodable, need):
            # Retraction frees pages at once: first finish the step that may still write them
            # (its tokens are real output; finished requests return their pages too).
            flight, self._in_flight = self._in_flight, None
            outputs += self._process(flight)
            self.release_deferred()
            decodable, need = self.decodable()
        start = time.perf_counter()
        plan = self.plan_step(decodable, need, self._in_flight.plan if self._in_flight is not None else None)
        launched = None
        if plan is not None:
            self._step_plans.append(plan)
            launched_at = self.clock()
            launched = _InFlight(plan, self.runner.launch(plan), launched_at)
            self.launched(plan)
        self._host_s += time.perf_counter() - start
        if plan is None and self._in_flight is None and self._compiling:
            # only grammars compiling: wait for one (bounded, so new messages are still read)
            self.wait_for_compiles(COMPILE_WAIT_S)
        must_sync = launched is not None and self.must_sync
        if self.overlap and not must_sync:
            if self._in_flight is not None:
                outputs += self._process(self._in_flight)
            self._in_flight = launched
        else:
            if self._in_flight is not None:
                outputs += self._process(self._in_flight)
                self._in_flight = None
            if launched is not None:
                outputs += self._process(launched)
        if self._in_flight is None:
            self.release_deferred()
        return outputs

    def _process(self, flight: _InFlight) -> List[TokenOutput]:
        self._processing = flight
        outputs = self._process_flight(flight)
        self._processing = None
        return outputs

    def _process_flight(self, flight: _InFlight) -> List[TokenOutput]:
        start = time.perf_counter()
        self.runner.wait(flight.flight)
        self._wait_s += time.perf_counter() - start
        self.step_timed(flight.plan, (self.clock() - flight.launched_at) * 1e3)
        self.release_deferred()  # every step before this one has completed
        return self.consume(flight.plan, self.runner.results(flight.flight))

    def _recover(self) -> List[int]:
        """After a failed step: end every request of the plan it made (and of the step it was
        processing, if that failed), and release what they and earlier finished requests hold.
        A step still in flight that did not fail is kept: its results are valid."""
        # Nothing may still write to the pages we free. A device that cannot even synchronize
        # is broken: that error propagates.
        self.runner.synchronize()
        plans = list(self._step_plans)
        if self._processing is not None:
            plans.append(self._processing.plan)
            if self._in_flight is self._processing:
                self._in_flight = None
            self._processing = None
        return self.fail(plans)

    def run_until_idle(self) -> List[TokenOutput]:
        out: List[TokenOutput] = []
        while self.has_work():
            out += self.step()
        return out

    # ---- introspection -----------------------------------------------------------------------
    def stats(self) -> SchedulerStats:
        stats = super().stats()
        stats.host_s, stats.wait_s = self._host_s, self._wait_s
        return stats

    def check_invariants(self) -> None:
        assert not self.has_work(), "check_invariants() needs an idle scheduler"
        super().check_invariants()

    def shutdown(self) -> None:
        pool = getattr(self, "_compile_pool", None)  # (None too if __init__ failed before it)
        if pool is not None:
            pool.close()
        draft = getattr(self, "draft_engine", None)
        if draft is not None:  # (before the target's: the process's global state is cleared with it)
            draft.shutdown()
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


def _generation_eos(model_path: str) -> Set[int]:
    try:
        path = Path(resolve_model_path(model_path)) / "generation_config.json"
        eos: Any = json.loads(path.read_text()).get("eos_token_id") if path.exists() else None
    except (OSError, ValueError):
        return set()
    if eos is None:
        return set()
    return {eos} if isinstance(eos, int) else set(eos)
