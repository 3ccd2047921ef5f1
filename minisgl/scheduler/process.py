"""The scheduler process: a Scheduler behind a ZeroMQ socket.

Loop: drain every message waiting on the socket (new requests, aborts), run one `Scheduler.step()`
if there is work, and push the step's token outputs to the detokenizer. When there is no work
the loop blocks on the socket (waking once a second to check that the parent still lives), so an
idle server uses no CPU. A bad request gets an ErrorMsg (400) back and never stops the loop. A
step that raises ends only the requests it touched (`StepFailed`: 500 for each, pages freed) and
the loop goes on; only an error that means the engine is broken (`is_fatal`: out of memory, a
CUDA error), or failures in MAX_CONSECUTIVE_FAILED_STEPS steps in a row, stop the process: every
waiting client gets a 500 and the process exits non-zero, which the server notices and reports.

Not imported by `minisgl.scheduler`: the engine stays importable without pyzmq/msgpack.
"""

from __future__ import annotations

import time
import traceback
from typing import Any, List, Tuple

import zmq

from minisgl.message import (
    AbortMsg,
    ErrorMsg,
    ExitMsg,
    FlushCacheDone,
    FlushCacheMsg,
    SchedulerStats,
    TokenBatchMsg,
    UserMsg,
    decode_msg,
    encode_msg,
)
from minisgl.utils.logger import init_logger

logger = init_logger(__name__)

STATS_INTERVAL_S = 0.5
IDLE_POLL_MS = 1000
MAX_CONSECUTIVE_FAILED_STEPS = 8


class SchedulerLoop:
    def __init__(
        self, scheduler: Any, recv_sock: zmq.Socket, send_sock: zmq.Socket, parent_pid: int | None = None, kv_events: Any = None
    ) -> None:
        from minisgl.scheduler import StepFailed, UserRequest

        self._UserRequest = UserRequest
        self._StepFailed = StepFailed
        self._failed_steps = 0
        self.scheduler = scheduler
        self.recv_sock = recv_sock
        self.send_sock = send_sock
        self.parent_pid = parent_pid
        self.max_seq_len = scheduler.max_seq_len
        self.aborted = 0
        self._last_stats_t = time.monotonic()
        self._last_stats_gen = 0
        self._last_stats: SchedulerStats | None = None
        self._last_load: Tuple[int, int] = (0, 0)  # (running, waiting) of the last stats sent
        self._running = True
        self.kv_events = kv_events  # a KVEventPublisher (--kv-events-endpoint) or None
        # TP rank 0 (scheduler/tp.py): a no-op broadcast while idle, so a dead rank shows at once
        self._heartbeat = getattr(scheduler, "heartbeat", lambda: None)

    # ---- messages ----------------------------------------------------------------------------
    def _send(self, msg: Any) -> None:
        self.send_sock.send(encode_msg(msg), copy=False)

    def _error(self, uid: int, message: str, status: int = 400, param: str | None = None, code: str | None = None) -> None:
        self._send(ErrorMsg(uid, message, status, param, code))

    def handle(self, msg: Any) -> None:
        if isinstance(msg, UserMsg):
            self._add(msg)
        elif isinstance(msg, AbortMsg):
            if self.scheduler.abort(msg.uid):
                self.aborted += 1
                logger.debug("aborted request %d", msg.uid)
        elif isinstance(msg, FlushCacheMsg):
            # Only an idle scheduler flushes: running requests hold pinned prefixes.
            busy = self.scheduler.has_work()
            freed = 0 if busy else self.scheduler.reset_prefix_cache()
            if not busy:
                logger.info("prefix cache flushed: %d pages freed", freed)
            self._send(FlushCacheDone(msg.uid, not busy, freed))
        elif isinstance(msg, ExitMsg):
            self._running = False
        else:
            logger.warning("scheduler ignores a message of type %s", type(msg).__name__)

    def _add(self, msg: UserMsg) -> None:
        from minisgl.sampling_params import InvalidRequest

        try:
            req = self._UserRequest(
                msg.uid, list(msg.input_ids), msg.sampling, strict_max_tokens=msg.max_tokens_explicit, group=msg.group or None
            )
            self.scheduler.add_request(req)  # validates: the same checks as the API server's
            self._send_rejected()  # (a grammar that failed to compile before)
        except InvalidRequest as exc:
            self._error(msg.uid, exc.message, exc.status, exc.param, exc.code)
        except Exception as exc:  # never let one request take the scheduler down
            logger.error("request %d rejected by an internal error:\n%s", msg.uid, traceback.format_exc())
            self._error(msg.uid, f"internal error while adding the request: {type(exc).__name__}: {exc}", status=500)

    def _recv_all(self, block: bool) -> List[Any]:
        msgs: List[Any] = []
        if block and not self.recv_sock.poll(IDLE_POLL_MS):
            return msgs
        while True:
            try:
                data = self.recv_sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return msgs
            try:
                msgs.append(decode_msg(data))
            except Exception as exc:
                logger.error("scheduler dropped an undecodable message: %s", exc)

    # ---- stats -------------------------------------------------------------------------------
    def _stats(self, idle: bool) -> SchedulerStats:
        s = self.scheduler.stats()
        now = time.monotonic()
        dt = now - self._last_stats_t
        rate = 0.0 if idle or dt <= 0 else (s.generated_tokens - self._last_stats_gen) / dt
        self._last_stats_t, self._last_stats_gen = now, s.generated_tokens
        # the three fields only this loop knows; `stats()` returns a fresh record, sent as it is
        s.num_active, s.aborted_requests, s.gen_throughput = len(self.scheduler.active), self.aborted, rate
        return s

    def _maybe_send_stats(self, idle: bool) -> None:
        """Every STATS_INTERVAL_S while busy, at once when idle, and at once when the load a router
        reads (running, waiting) changed: a new request shows in the gauges within its first step,
        before its first token (the stats go out ahead of the step's tokens, on the same socket)."""
        load = self.scheduler.load()
        if not idle and load == self._last_load and time.monotonic() - self._last_stats_t < STATS_INTERVAL_S:
            return
        self._last_load = load
        stats = self._stats(idle)
        if stats != self._last_stats:
            self._send(stats)
            self._last_stats = stats

    # ---- the loop ----------------------------------------------------------------------------
    def run(self) -> None:
        self._maybe_send_stats(idle=True)
        while self._running:
            idle = not self.scheduler.has_work()
            if idle:
                self._maybe_send_stats(idle=True)
                self._heartbeat()
                if self.parent_pid is not None:
                    from minisgl.server.process_utils import parent_alive

                    if not parent_alive(self.parent_pid):
                        logger.error("the server process is gone; scheduler exits")
                        return
            for msg in self._recv_all(block=idle):
                self.handle(msg)
            if self.scheduler.has_work():
                self.step()
            if self.kv_events is not None:
                self.kv_events.publish()  # this iteration's cache changes, one batch

    def step(self) -> None:
        try:
            outputs = self.scheduler.step()
        except self._StepFailed as exc:
            self._failed_steps += 1
            logger.error("a scheduler step failed; ending requests %s:\n%s", exc.uids, _format_cause(exc))
            for uid in exc.uids:
                self._error(uid, "internal error while running the request (see the server log)", status=500)
            if self._failed_steps >= MAX_CONSECUTIVE_FAILED_STEPS:
                self._fail_everyone(f"{self._failed_steps} scheduler steps failed in a row")
                raise
            outputs = exc.outputs
        except Exception:
            self._fail_everyone(traceback.format_exc())
            raise
        else:
            self._failed_steps = 0
        self._maybe_send_stats(idle=False)
        if outputs:
            self._send(TokenBatchMsg(outputs))  # the scheduler's records, as they are
        self._send_rejected()

    def _send_rejected(self) -> None:
        # requests whose grammar failed to compile off the loop: the 400 they got at once before
        for uid, exc in self.scheduler.take_rejected():
            self._error(uid, exc.message, exc.status, exc.param, exc.code)

    def _fail_everyone(self, reason: str) -> None:
        logger.error("the scheduler stops: %s", reason)
        uids = set(self.scheduler.active) | {r.uid for r in self.scheduler.waiting} | set(self.scheduler.compiling)
        for uid in uids:
            self._error(uid, "internal error in the scheduler (see the server log)", status=500)


def _format_cause(exc: BaseException) -> str:
    cause = exc.__cause__ or exc
    return "".join(traceback.format_exception(type(cause), cause, cause.__traceback__))


def _task_info(engine: Any) -> dict:
    """What the API server needs to know of the task: which endpoints it serves, and for the
    embed task the vector's size and whether `dimensions` may truncate it."""
    spec = engine.pooling_spec
    if spec is None:
        return {"task": "generate"}
    dims = spec.matryoshka_dims
    return {
        "task": "embed",
        "pooling": spec.method,
        "normalize": spec.normalize,
        "hidden_size": engine.config.model_config.hidden_size,
        "matryoshka_dimensions": list(dims) if dims is not None else None,
    }


def run_scheduler_process(args: Any, ready_conn: Any, rank: int = 0) -> None:
    """Entry point of the scheduler process (multiprocessing spawn target)."""
    from minisgl.server.process_utils import IpcAddrs, fail_startup, push_socket, setup_child_process

    parent = setup_child_process(f"minisgl-sched{rank}", args.log_level)
    try:
        from minisgl.scheduler.tp import LeaderScheduler, make_scheduler, run_server_follower

        config = args.scheduler_config(rank)
        scheduler = make_scheduler(config)  # tp > 1: rank 0 leads, the others follow (scheduler/tp.py)
    except BaseException as exc:
        fail_startup(ready_conn, f"scheduler rank {rank}" if rank else "scheduler", exc)
    if rank != 0:
        return run_server_follower(scheduler, ready_conn)
    if isinstance(scheduler, LeaderScheduler):
        import signal

        signal.signal(signal.SIGTERM, lambda signum, frame: scheduler.request_stop())  # then tell the followers

    addrs = IpcAddrs.in_dir(args.ipc_dir)
    ctx = zmq.Context()
    recv_sock = ctx.socket(zmq.PULL)
    recv_sock.bind(addrs.scheduler)
    send_sock = push_socket(ctx, addrs.tokenizer)
    info = {
        "max_seq_len": scheduler.max_seq_len,
        "num_pages": scheduler.allocator.num_pages,
        "page_size": scheduler.page_size,
        "vocab_size": scheduler.vocab_size,
        "max_running_req": config.max_running_req,
        "dtype": str(scheduler.engine.dtype).replace("torch.", ""),
        "device": str(scheduler.device),
        "attention_backend": scheduler.engine.config.attention_backend,
        "overlap": scheduler.overlap,
        **_task_info(scheduler.engine),
    }
    kv_events = None
    if args.kv_events_endpoint:  # before "ready": a subscriber may connect as soon as the server answers
        from minisgl.scheduler.kv_event_publisher import attach_kv_events

        try:
            kv_events = attach_kv_events(scheduler, args.kv_events_endpoint, args.kv_events_replay_endpoint)
        except zmq.ZMQError as exc:
            fail_startup(ready_conn, f"--kv-events-endpoint {args.kv_events_endpoint}", exc)
    ready_conn.send(("ready", info))
    ready_conn.close()
    logger.info(
        "scheduler ready: %s on %s (%s), context %d tokens, %d KV pages",
        config.model_path, info["device"], info["dtype"], info["max_seq_len"], info["num_pages"],
    )  # fmt: skip
    try:
        SchedulerLoop(scheduler, recv_sock, send_sock, parent, kv_events).run()
    finally:
        if kv_events is not None:
            kv_events.close()
        recv_sock.close(linger=0)
        send_sock.close(linger=100)
        ctx.term()
        scheduler.shutdown()
