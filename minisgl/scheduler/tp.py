"""Tensor-parallel scheduling: rank 0 plans, every rank runs the plan.

Rank 0 owns the only Policy (admission, pages, prefix cache: `LeaderScheduler`); only it hears
from the outside world (the LLM API or the tokenizer worker). Each step it broadcasts the
StepPlan it is about to launch over the gloo CPU group (`minisgl.distributed.broadcast_message`,
the plan pickled), then launches it; every other rank (`Follower`) owns an Engine (one shard of
the model) and a Runner, and executes the same plan, so the collectives inside the model line
up. Idle, rank 0 sends a "noop" about once a second so a dead rank is noticed; "exit" ends the
followers. The sampled tokens agree because the engine broadcasts rank 0's draw (see
Engine.forward_batch); the token pool and page table of every rank receive the same writes.

What a follower needs besides the rows, it keeps per request from the plan (`NewRow`): the
SamplingParams (temperature, seed, bias, min_tokens with its stop ids), and for penalties the
prompt and, each step, the tokens rank 0 accepted since the last plan (`plan.history`; rank 0
runs synchronously while such a request is admitted, so the history is complete when the next
plan is made). Grammar masks are computed on every rank: each rank compiles the grammar and
advances its matcher with the same history, which is deterministic, so the masks agree without
sending a vocabulary-sized bitmask per row per step.

Why a torch.distributed broadcast and not a second transport (ZeroMQ PUB/SUB): the ranks are
already connected by the process group, so there is no extra address to configure per node, the
broadcast is itself the per-step barrier that keeps ranks in lockstep, and a rank that dies
breaks the gloo connection, which every other rank sees at its next step.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import multiprocessing as mp
import pickle
import threading
import time
import traceback
from typing import Any, Callable, Dict, List, Tuple

import torch

from minisgl.distributed import DistributedInfo, broadcast_message
from minisgl.engine import Engine
from minisgl.sampling_params import GrammarSpec
from minisgl.scheduler.config import SchedulerConfig
from minisgl.scheduler.grammar_compile import CompileJob, CompilePool
from minisgl.scheduler.plan import NewRow, StepPlan
from minisgl.scheduler.request import SchedReq, TokenOutput, UserRequest
from minisgl.scheduler.runner import Flight, Runner
from minisgl.scheduler.scheduler import Scheduler
from minisgl.utils.env import read_env
from minisgl.utils.logger import init_logger

logger = init_logger(__name__)

HEARTBEAT_S = 1.0
# "grammar" carries a GrammarSpec that rank 0 started compiling: the followers compile it too
ACTIONS = ("step", "noop", "exit", "fingerprint", "grammar")  # sent as their index


def _send(action: str, plan: StepPlan | GrammarSpec | None = None) -> None:
    data = pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL) if plan is not None else b""
    broadcast_message(ACTIONS.index(action), data)


def _recv() -> Tuple[str, Any]:
    code, data = broadcast_message(0)
    return ACTIONS[code], (pickle.loads(data) if data else None)


class TPRankLost(RuntimeError):
    """A collective with the other TP ranks failed: one of them is gone."""


class _PublishingRunner(Runner):
    """Rank 0's runner: sends each plan to the followers just before launching it."""

    def __init__(self, engine: Engine, publish: Callable[[str, StepPlan | None], None]) -> None:
        super().__init__(engine)
        self._publish = publish

    def launch(self, plan: StepPlan) -> Flight:
        self._publish("step", plan)
        return super().launch(plan)


class LeaderScheduler(Scheduler):
    """Rank 0's scheduler: plans for every rank."""

    def __init__(self, config: SchedulerConfig) -> None:
        assert config.tp_info.rank == 0 and config.tp_info.size > 1
        self._closed = False
        self._busy = False  # inside a step or a broadcast: a SIGTERM waits until it is over
        self._stop_requested = False
        self._last_publish = time.monotonic()
        super().__init__(config)

    def _make_runner(self, engine: Engine) -> Runner:
        return _PublishingRunner(engine, self._publish)

    def grammar_submitted(self, job: CompileJob) -> None:
        # The followers start compiling now, in parallel with this rank, so the grammar is
        # (almost always) ready there when the plan that admits the request arrives.
        if not job.future.done():
            self._publish("grammar", job.spec)

    def step(self) -> List[TokenOutput]:
        self._busy = True
        try:
            return super().step()
        finally:
            self._busy = False
            self._maybe_stop()

    def heartbeat(self, interval_s: float = HEARTBEAT_S) -> None:
        """While idle (the server loop calls this about once a second): a no-op message, so a
        dead rank is noticed now rather than at the next request."""
        if time.monotonic() - self._last_publish >= interval_s:
            self._busy = True
            try:
                self._publish("noop")
            finally:
                self._busy = False
                self._maybe_stop()

    def request_stop(self) -> None:
        """SIGTERM handler of a TP server's rank 0: leave at once, or after the step in progress
        (a step abandoned half-way would leave the followers inside a collective)."""
        if self._busy:
            self._stop_requested = True
        else:
            raise SystemExit(0)

    def _maybe_stop(self) -> None:
        if self._stop_requested:
            self._stop_requested = False
            raise SystemExit(0)

    def rank_fingerprints(self) -> List[str]:
        """Every rank's fingerprint of its device state (see `fingerprint`); all equal when the
        ranks are in lockstep. For tests and debugging: it is a collective."""
        self._publish("fingerprint")
        assert isinstance(self.runner, Runner)
        return _gather_fingerprints(self.runner)

    def _publish(self, action: str, plan: StepPlan | GrammarSpec | None = None) -> None:
        self._last_publish = time.monotonic()
        try:
            _send(action, plan)
        except RuntimeError as exc:
            raise TPRankLost(f"TP rank 0 lost contact with the other ranks (one died?): {exc}") from exc

    def shutdown(self) -> None:
        if not self._closed:
            self._closed = True
            try:
                self._publish("exit")
            except Exception as exc:  # a follower already gone: nothing left to tell
                logger.warning("could not tell the other TP ranks to exit: %s", exc)
        super().shutdown()


class Follower:
    """A TP rank r > 0: an Engine and a Runner that execute rank 0's plans, and the request
    objects the engine's sampler reads (their lengths set from each plan)."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.engine = Engine(config)
        self.device = self.engine.device
        self.num_pages = self.engine.num_pages
        self.runner = Runner(self.engine)
        self.reqs: Dict[int, SchedReq] = {}
        self.grammar: Any = None
        self._compile_pool: CompilePool | None = None
        self._grammar_lock = threading.Lock()  # two compile threads may both need the backend first
        self._last: Flight | None = None

    def compile_pool(self) -> CompilePool:
        if self._compile_pool is None:
            # no timeout here: rank 0 decides; a grammar it admitted compiled in time there
            self._compile_pool = CompilePool(lambda spec: self._grammar_backend().compile(spec), timeout_s=math.inf)
        return self._compile_pool

    def _grammar_backend(self) -> Any:
        with self._grammar_lock:
            if self.grammar is None:
                from minisgl.scheduler.grammar import GrammarBackend
                from minisgl.utils.hf import load_tokenizer

                vocab_size = self.engine.config.model_config.vocab_size
                self.grammar = GrammarBackend(load_tokenizer(self.config.model_path), vocab_size)
                self.runner.use_grammar(self.grammar)
            return self.grammar

    def execute(self, plan: StepPlan) -> None:
        for uid in plan.releases:
            self.reqs.pop(uid, None)
        for new in plan.new_rows:
            self.reqs[new.uid] = self._new_req(new)
        for uid, tokens in plan.history.items():
            req = self.reqs[uid]
            for token in tokens:
                req.append_token(token)
                if req.grammar_matcher is not None:
                    req.grammar_matcher.accept_token(token)
        reqs = [self.reqs[uid] for uid in plan.uids]
        for req, row, start, end in zip(reqs, plan.rows, plan.starts, plan.ends):
            req.table_idx, req.cached_len, req.device_len = row, start, end
        plan.reqs = reqs
        flight = self.runner.launch(plan)
        # Overlap as rank 0 does: the previous step completes while this one is queued.
        if self._last is not None:
            self.runner.wait(self._last)
        self._last = flight

    def _new_req(self, new: NewRow) -> SchedReq:
        # output_len 0: a follower never decides when a request ends, rank 0 does
        req = SchedReq(UserRequest(new.uid, new.prompt, new.params), output_len=0)
        req.stop_ids = set(new.stop_ids)
        if new.params.grammar is not None:
            # compiling since rank 0's "grammar" message; blocks only if not done yet
            compiled = self.compile_pool().submit(new.params.grammar).future.result()
            req.grammar_matcher = self._grammar_backend().xgr.GrammarMatcher(compiled)
        return req

    def shutdown(self) -> None:
        pool = getattr(self, "_compile_pool", None)  # (None too if __init__ failed before it)
        if pool is not None:
            pool.close()
        self.engine.shutdown()


def follow(follower: Follower) -> None:
    """A follower rank's loop: run rank 0's plans until it says exit."""
    with torch.inference_mode():
        while True:
            try:
                action, plan = _recv()
            except RuntimeError as exc:
                raise TPRankLost(f"TP rank {follower.config.tp_info.rank} lost contact with rank 0: {exc}") from exc
            if action == "exit":
                return
            if action == "noop":
                continue
            if action == "fingerprint":
                _gather_fingerprints(follower.runner)
                continue
            if action == "grammar":
                follower.compile_pool().submit(plan)
                continue
            assert plan is not None
            follower.execute(plan)


def fingerprint(runner: Runner) -> str:
    """A digest of what must agree over ranks: the token pool (every sampled token is written
    there) and the page table (every page the policy handed out)."""
    runner.synchronize()
    h = hashlib.sha256()
    h.update(runner.token_pool.to("cpu").numpy().tobytes())
    h.update(runner.engine.page_table.to("cpu").numpy().tobytes())
    return h.hexdigest()


def _gather_fingerprints(runner: Runner) -> List[str]:
    import torch.distributed as dist

    from minisgl.distributed import get_cpu_group

    out: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, fingerprint(runner), group=get_cpu_group())
    return out


def make_scheduler(config: SchedulerConfig) -> Any:
    """This rank's part: a Scheduler at tp=1, the LeaderScheduler on rank 0, a Follower on the
    other ranks (typed Any so rank 0's callers keep their Scheduler attributes)."""
    if config.tp_info.size > 1:
        return LeaderScheduler(config) if config.tp_info.rank == 0 else Follower(config)
    return Scheduler(config)


def run_server_follower(follower: Follower, ready_conn: Any) -> None:
    """A TP server's rank r > 0 after its engine is built: report ready, follow rank 0, exit 0
    when rank 0 says exit and 1 when it vanishes (the launcher reports which rank exited)."""
    rank = follower.config.tp_info.rank
    ready_conn.send(("ready", {"rank": rank, "num_pages": follower.num_pages, "device": str(follower.device)}))
    ready_conn.close()
    logger.info("TP rank %d ready on %s", rank, follower.device)
    try:
        follow(follower)
    except TPRankLost as exc:
        logger.error("%s; this rank exits", exc)
        raise SystemExit(1) from None
    finally:
        follower.shutdown()


# ---- offline: rank 0 in this process, ranks 1..N-1 spawned -----------------------------------
def _worker_main(config: SchedulerConfig, conn: Any) -> None:
    """A spawned follower rank of `LLM(tp=N)`: dies with its parent, ignores Ctrl-C (rank 0 decides)."""
    from minisgl.server.process_utils import setup_child_process

    setup_child_process(f"minisgl-tp{config.tp_info.rank}", read_env().log_level.lower())
    conn.send(("started", None))  # imports done: rank 0 may start its engine
    try:
        follower = Follower(config)
    except BaseException as exc:
        try:
            conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        except OSError:
            pass
        raise SystemExit(1) from None
    conn.send(("ready", None))
    try:
        follow(follower)
    finally:
        follower.shutdown()
        conn.close()


class WorkerRanks:
    """TP ranks 1..N-1 of an offline LLM, as spawned processes."""

    def __init__(self, config: SchedulerConfig) -> None:
        ctx = mp.get_context("spawn")
        size = config.tp_info.size
        self.procs: List[Any] = []
        self.conns: List[Any] = []
        self.errors: List[str] = []
        for rank in range(1, size):
            cfg = dataclasses.replace(config, tp_info=DistributedInfo(rank, size))
            recv, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_worker_main, args=(cfg, send), name=f"minisgl-tp{rank}", daemon=True)
            proc.start()
            send.close()
            self.procs.append(proc)
            self.conns.append(recv)

    def wait_started(self, timeout: float = 300.0) -> None:
        """Before rank 0 builds its engine: every follower got through its imports. A follower
        that dies here (most often: the caller's script re-ran at import because it lacks the
        `if __name__ == "__main__":` guard that multiprocessing spawn needs) fails now, rather
        than after distributed_timeout at the rendezvous."""
        for rank, conn in enumerate(self.conns, start=1):
            if not conn.poll(timeout):
                raise RuntimeError(f"TP rank {rank} did not start within {timeout:g} s")
            try:
                kind, payload = conn.recv()
            except (EOFError, OSError):
                raise RuntimeError(
                    f"TP rank {rank} {self._exit(rank)} before it started (see its error above). Worker ranks "
                    'are spawned: a script that builds LLM(tp>1) must do it under `if __name__ == "__main__":`'
                ) from None
            if kind != "started":
                raise RuntimeError(f"TP rank {rank} failed to start: {payload}")

    def wait_ready(self, timeout: float) -> None:
        """After rank 0 is built: every follower reports ready (it met rank 0 in the collectives)."""
        for rank, conn in enumerate(self.conns, start=1):
            if not conn.poll(timeout):
                raise RuntimeError(f"TP rank {rank} did not report ready within {timeout:g} s")
            try:
                kind, payload = conn.recv()
            except (EOFError, OSError):
                raise RuntimeError(f"TP rank {rank} exited during start-up ({self._exit(rank)})") from None
            if kind != "ready":
                raise RuntimeError(f"TP rank {rank} failed to start: {payload}")

    def startup_errors(self) -> str:
        """What the followers reported, after rank 0 failed to start (maybe because of them)."""
        out = []
        for rank, conn in enumerate(self.conns, start=1):
            try:
                if conn.poll(1.0):
                    kind, payload = conn.recv()
                    if kind == "error":
                        out.append(f"TP rank {rank}: {_first_line(payload)}")
            except (EOFError, OSError):
                out.append(f"TP rank {rank} {self._exit(rank)}")
        return "; ".join(out)

    def _exit(self, rank: int) -> str:
        from minisgl.server.process_utils import describe_exit

        proc = self.procs[rank - 1]
        proc.join(0.5)
        return describe_exit(proc.exitcode)

    def shutdown(self, grace_s: float = 10.0) -> None:
        """Wait for the followers to leave (rank 0 told them to), then make sure they are gone."""
        for proc in self.procs:
            proc.join(grace_s)
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(3.0)
            if proc.is_alive():
                proc.kill()
                proc.join(3.0)
        for conn in self.conns:
            conn.close()
        self.procs, self.conns = [], []

    def kill(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        for proc in self.procs:
            proc.join(3.0)
        self.procs = []


def _first_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return " ".join(lines[:3]) if lines else "(no message)"
