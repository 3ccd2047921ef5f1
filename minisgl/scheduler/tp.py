"""Tensor-parallel scheduling: rank 0 leads, every other rank follows the same schedule.

Every rank owns a Scheduler (and its Engine, one shard of the model). The scheduler is a
deterministic function of the calls it receives (requests, aborts, cache resets, steps), so if
every rank receives the same calls in the same order, every rank builds the same batches, and
the collectives inside the model line up. Only rank 0 hears from the outside world (the LLM API
or the tokenizer worker); it records each mutating call it applies, and at every step it
broadcasts the recorded calls plus the action ("step", "noop", "exit") over the gloo CPU group
(`minisgl.distributed.broadcast_message`: one int64 broadcast for the action and byte count, a
second for the pickled calls only when there are any, so a plain decode step costs one round). Followers apply the calls, then step, and throw their
outputs away: only rank 0 returns tokens. The sampled tokens agree because the engine
broadcasts rank 0's draw (see Engine.forward_batch).

Why a torch.distributed broadcast and not a second transport (ZeroMQ PUB/SUB): the ranks are
already connected by the process group, so there is no extra address to configure per node, the
broadcast is itself the per-step barrier that keeps ranks in lockstep, and a rank that dies
breaks the gloo connection, which every other rank sees at its next step.

Only calls that change scheduling state are recorded: a request rank 0 rejects (validation
error) raises before it is recorded, so followers never see it.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import pickle
import time
import traceback
from typing import Any, List, Tuple

from minisgl.distributed import DistributedInfo, broadcast_message
from minisgl.scheduler.config import SchedulerConfig
from minisgl.scheduler.request import TokenOutput, UserRequest
from minisgl.scheduler.scheduler import Scheduler
from minisgl.utils.env import read_env
from minisgl.utils.logger import init_logger

logger = init_logger(__name__)

HEARTBEAT_S = 1.0
Op = Tuple[Any, ...]  # ("add", UserRequest) | ("abort", uid) | ("reset_cache",)
ACTIONS = ("step", "noop", "exit", "fingerprint")  # sent as their index


def _send(ops: List[Op], action: str) -> None:
    broadcast_message(ACTIONS.index(action), pickle.dumps(ops, protocol=pickle.HIGHEST_PROTOCOL) if ops else b"")


def _recv() -> Tuple[List[Op], str]:
    code, data = broadcast_message(0)
    return (pickle.loads(data) if data else []), ACTIONS[code]


class TPRankLost(RuntimeError):
    """A collective with the other TP ranks failed: one of them is gone."""


class LeaderScheduler(Scheduler):
    """Rank 0's scheduler: a Scheduler that shares its inputs with the followers each step."""

    def __init__(self, config: SchedulerConfig) -> None:
        assert config.tp_info.rank == 0 and config.tp_info.size > 1
        super().__init__(config)
        self._ops: List[Op] = []
        self._closed = False
        self._busy = False  # inside a step or a broadcast: a SIGTERM waits until it is over
        self._stop_requested = False
        self._last_publish = time.monotonic()

    def add_request(self, req: UserRequest) -> None:
        super().add_request(req)  # raises on a bad request: then nothing is recorded
        self._ops.append(("add", req))

    def abort(self, uid: int) -> bool:
        found = super().abort(uid)
        if found:  # a miss changes nothing on any rank
            self._ops.append(("abort", uid))
        return found

    def reset_prefix_cache(self) -> int:
        freed = super().reset_prefix_cache()
        self._ops.append(("reset_cache",))
        return freed

    def step(self) -> List[TokenOutput]:
        self._busy = True
        try:
            self._publish("step")
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
        """Every rank's fingerprint of its scheduling state and token pool (see `fingerprint`);
        all equal when the ranks are in lockstep. For tests and debugging: it is a collective."""
        self._publish("fingerprint")
        return _gather_fingerprints(self)

    def _publish(self, action: str) -> None:
        ops, self._ops = self._ops, []
        self._last_publish = time.monotonic()
        try:
            _send(ops, action)
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


def apply_op(scheduler: Scheduler, op: Op) -> None:
    kind = op[0]
    if kind == "add":
        scheduler.add_request(op[1])
    elif kind == "abort":
        scheduler.abort(op[1])
    elif kind == "reset_cache":
        scheduler.reset_prefix_cache()
    else:
        raise ValueError(f"unknown scheduler op {kind!r} from rank 0")


def follow(scheduler: Scheduler) -> None:
    """A follower rank's loop: mirror rank 0's calls until it says exit."""
    while True:
        try:
            ops, action = _recv()
        except RuntimeError as exc:
            raise TPRankLost(f"TP rank {scheduler.config.tp_info.rank} lost contact with rank 0: {exc}") from exc
        for op in ops:
            apply_op(scheduler, op)
        if action == "exit":
            return
        if action == "noop":
            continue
        if action == "fingerprint":
            _gather_fingerprints(scheduler)
            continue
        scheduler.step()  # outputs are rank 0's to return


def fingerprint(scheduler: Scheduler) -> str:
    """A digest of what must agree over ranks: the token pool on the device (every sampled token
    is written there), the free pages and rows, and the requests in each state."""
    import hashlib

    h = hashlib.sha256()
    pool = scheduler.token_pool.to("cpu")
    h.update(pool.numpy().tobytes())
    h.update(repr(scheduler.allocator._free).encode())  # order too: it decides the next pages
    h.update(repr((scheduler.free_rows, [r.uid for r in scheduler.running], [r.uid for r in scheduler.prefilling],
                   [r.uid for r in scheduler.waiting], scheduler.cache.cached_pages)).encode())  # fmt: skip
    return h.hexdigest()


def _gather_fingerprints(scheduler: Scheduler) -> List[str]:
    import torch.distributed as dist

    from minisgl.distributed import get_cpu_group

    out: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, fingerprint(scheduler), group=get_cpu_group())
    return out


def make_scheduler(config: SchedulerConfig) -> Scheduler:
    """The scheduler of this rank: a plain one at tp=1 or on a follower, the leader on rank 0."""
    if config.tp_info.size > 1 and config.tp_info.rank == 0:
        return LeaderScheduler(config)
    return Scheduler(config)


def run_server_follower(scheduler: Scheduler, ready_conn: Any) -> None:
    """A TP server's rank r > 0 after its engine is built: report ready, follow rank 0, exit 0
    when rank 0 says exit and 1 when it vanishes (the launcher reports which rank exited)."""
    rank = scheduler.config.tp_info.rank
    ready_conn.send(("ready", {"rank": rank, "num_pages": scheduler.allocator.num_pages, "device": str(scheduler.device)}))
    ready_conn.close()
    logger.info("TP rank %d ready on %s", rank, scheduler.device)
    try:
        follow(scheduler)
    except TPRankLost as exc:
        logger.error("%s; this rank exits", exc)
        raise SystemExit(1) from None
    finally:
        scheduler.shutdown()


# ---- offline: rank 0 in this process, ranks 1..N-1 spawned -----------------------------------
def _worker_main(config: SchedulerConfig, conn: Any) -> None:
    """A spawned follower rank of `LLM(tp=N)`: dies with its parent, ignores Ctrl-C (rank 0 decides)."""
    from minisgl.server.process_utils import setup_child_process

    setup_child_process(f"minisgl-tp{config.tp_info.rank}", read_env().log_level.lower())
    conn.send(("started", None))  # imports done: rank 0 may start its engine
    try:
        scheduler = Scheduler(config)
    except BaseException as exc:
        try:
            conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        except OSError:
            pass
        raise SystemExit(1) from None
    conn.send(("ready", None))
    try:
        follow(scheduler)
    finally:
        scheduler.shutdown()
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
