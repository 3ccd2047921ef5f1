"""The API server's side of the ZeroMQ link: submit requests, receive their replies.

Used by the HTTP server and by the shell. One asyncio task reads every message from the tokenizer
worker and routes it by uid to the `RequestStream` waiting for it.

Admission is bounded: at most `max_pending` choices (scheduler requests) may be in flight, i.e.
running or queued; beyond that `submit` raises `Overloaded` (HTTP 503 with Retry-After) instead of
letting the queues grow without bound. Messages are encoded before anything is registered, and
sent without blocking the event loop: a full ZeroMQ queue (a stuck worker) is `Overloaded` too.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any, Dict, List, Tuple

import zmq
import zmq.asyncio

from minisgl.message import (
    AbortReq,
    ErrorMsg,
    FlushCacheDone,
    FlushCacheMsg,
    ReplyBatchMsg,
    ReplyMsg,
    SchedulerStats,
    TokenizeMsg,
    TokenizeOnlyMsg,
    ToolReply,
    decode_msg,
    encode_msg,
)
from minisgl.server.metrics import ServerMetrics
from minisgl.server.process_utils import IpcAddrs
from minisgl.server.request_id import current_request_id
from minisgl.server.tracing import current_span
from minisgl.utils.logger import init_logger

logger = init_logger(__name__)

SEND_HWM = 100_000  # messages queued towards the tokenizer worker before sends fail


class Unavailable(RuntimeError):
    """A worker died: the server takes no more requests."""


class Overloaded(RuntimeError):
    """Too many requests in flight: try again later."""

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


Event = Tuple[int, Any]  # (choice index, ReplyMsg | ErrorMsg)


class RequestStream:
    """The replies of one client request: `n` scheduler requests (choices) sharing one queue.

    `choices` scheduler requests in a row share one prompt (a request's `n`): its tokens are
    counted once, as the response's `usage` counts them."""

    def __init__(self, frontend: "Frontend", uids: List[int], label: str = "", choices: int = 1) -> None:
        self.frontend = frontend
        self.uids = uids
        self.label = label  # what the request log line calls it (the endpoint)
        self.choices = choices
        self.request_id = current_request_id.get()  # X-Request-Id of the HTTP request (None in the shell)
        self.span = current_span.get()  # its OpenTelemetry span (server/tracing.py), None when not traced
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.outcomes: List[str] = []  # finish reasons, "error <status>", "abort"
        self.ttft: float | None = None
        self.index = {uid: i for i, uid in enumerate(uids)}
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.unfinished = set(uids)
        self.start = time.perf_counter()
        self.last_token_t: Dict[int, float] = {}

    @property
    def done(self) -> bool:
        return not self.unfinished

    async def next(self) -> Event:
        return await self.queue.get()

    def _deliver(self, uid: int, msg: Any) -> None:
        if uid not in self.unfinished:
            return
        metrics = self.frontend.metrics
        now = time.perf_counter()
        if isinstance(msg, ReplyMsg):
            if msg.num_tokens and self.ttft is None:
                self.ttft = now - self.start
                if self.span is not None:
                    self.span.first_token(self.ttft)
            if msg.finished:
                if self.index[uid] % self.choices == 0:  # the first choice of its prompt
                    self.prompt_tokens += msg.prompt_tokens
                    self.cached_tokens += msg.cached_tokens
                self.completion_tokens += msg.completion_tokens
                self.outcomes.append(msg.finish_reason or "unknown")
            if msg.num_tokens and metrics is not None:
                last = self.last_token_t.get(uid)
                if last is None:
                    metrics.ttft.observe(now - self.start)
                else:
                    for _ in range(msg.num_tokens):
                        metrics.itl.observe((now - last) / msg.num_tokens)
                self.last_token_t[uid] = now
            if msg.finished:
                self.unfinished.discard(uid)
                if metrics is not None:
                    metrics.requests.labels(msg.finish_reason or "unknown").inc()
                    metrics.e2e.observe(now - self.start)
        else:  # ErrorMsg: final
            self.unfinished.discard(uid)
            self.outcomes.append(f"error {msg.status}")
            if metrics is not None:
                metrics.requests.labels("error").inc()
            if self.span is not None:
                self.span.error(msg.status, msg.message, msg.code)
        if self.done:
            self.frontend._forget(self)
            self._log()
            if self.span is not None:
                reasons = [o for o in self.outcomes if not o.startswith("error")]
                self.span.finished(self.prompt_tokens, self.cached_tokens, self.completion_tokens, reasons)
        self.queue.put_nowait((self.index[uid], msg))

    def _log(self) -> None:
        """One info line per request (as vLLM/SGLang print), when its last choice ends."""
        ttft = "-" if self.ttft is None else f"{self.ttft * 1000:.0f} ms"
        logger.info(
            "%s%s requests %s: %s; prompt %d (cached %d) + output %d tokens; ttft %s; %.3f s",
            self.label or "request", f" [{self.request_id}]" if self.request_id else "", self.uids if len(self.uids) <= 4 else f"{self.uids[:4]}...", ", ".join(self.outcomes),
            self.prompt_tokens, self.cached_tokens, self.completion_tokens, ttft, time.perf_counter() - self.start,
        )  # fmt: skip

    def abort(self) -> None:
        """Stop every unfinished choice (the client went away): the scheduler frees their pages."""
        if not self.unfinished:
            self.frontend._forget(self)
            return
        for uid in list(self.unfinished):
            self.frontend._send(AbortReq(uid))
            self.outcomes.append("abort")
        self.unfinished.clear()
        self.frontend._forget(self)
        self._log()
        if self.span is not None:
            self.span.aborted()


class Frontend:
    def __init__(self, addrs: IpcAddrs, metrics: ServerMetrics | None = None, max_pending: int | None = None) -> None:
        self.addrs = addrs
        self.metrics = metrics
        self.max_pending = max_pending  # choices in flight at most (None: unbounded)
        self.stats: SchedulerStats | None = None
        self.failure: str | None = None  # set when a worker died: new requests get 503
        self.draining = False  # set on SIGTERM (server/drain.py): new requests get 503, running ones finish
        self._uids = itertools.count(1)
        self._streams: Dict[int, RequestStream] = {}
        self._sync_ctx = zmq.Context()
        self._push = self._sync_ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.SNDHWM, SEND_HWM)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.connect(addrs.tokenizer)
        self._actx: zmq.asyncio.Context | None = None
        self._pull: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task | None = None
        self._calls: Dict[int, asyncio.Future[Any]] = {}  # uid -> a one-reply request (flush, tokenize)

    async def start(self) -> None:
        self._actx = zmq.asyncio.Context()
        self._pull = self._actx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.bind(self.addrs.api)
        self._task = asyncio.create_task(self._recv_loop(), name="minisgl-frontend-recv")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        if self._pull is not None:
            self._pull.close(linger=0)
        if self._actx is not None:
            self._actx.term()
        self._push.close(linger=0)
        self._sync_ctx.term()

    # ---- requests ----------------------------------------------------------------------------
    def new_uid(self) -> int:
        return next(self._uids)

    def submit(self, msgs: List[TokenizeMsg], label: str = "", choices: int = 1) -> RequestStream:
        """Send a client request's scheduler requests (`choices` per prompt, prompt by prompt)."""
        if self.failure is not None:
            raise Unavailable(self.failure)
        if self.draining:
            raise Unavailable("it is shutting down (draining the requests in flight)")
        if self.max_pending is not None and len(self._streams) + len(msgs) > self.max_pending:
            raise Overloaded(
                f"the server is at capacity ({len(self._streams)} requests in flight, at most {self.max_pending}: "
                "--max-running-requests + --max-queued-requests); retry later"
            )
        if len(msgs) > 1:  # one client call (n choices, several prompts): one group for fair admission
            for m in msgs:
                m.group = msgs[0].uid
        frames = [encode_msg(m) for m in msgs]  # before registering: a failure leaves nothing behind
        stream = RequestStream(self, [m.uid for m in msgs], label, choices)
        for uid in stream.uids:
            self._streams[uid] = stream
        try:
            for frame in frames:
                self._push.send(frame, zmq.NOBLOCK, copy=False)
        except zmq.Again:
            stream.abort()
            raise Overloaded("the tokenizer worker is not keeping up; retry later") from None
        if stream.span is not None:
            stream.span.submitted(msgs, choices)
        if self.metrics is not None:
            self.metrics.in_flight.set(self.num_in_flight)
        return stream

    async def flush_cache(self, timeout_s: float = 30.0) -> FlushCacheDone:
        """Ask the scheduler to drop its unpinned prefix cache; it refuses while busy."""
        return await self._call(lambda uid: FlushCacheMsg(uid), timeout_s)

    async def tokenize(self, timeout_s: float = 30.0, **fields: Any) -> ToolReply | ErrorMsg:
        """/tokenize and /detokenize, answered by the tokenizer worker."""
        return await self._call(lambda uid: TokenizeOnlyMsg(uid, **fields), timeout_s)

    async def _call(self, make: Any, timeout_s: float) -> Any:
        if self.failure is not None:
            raise Unavailable(self.failure)
        uid = self.new_uid()
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._calls[uid] = future
        try:
            self._send(make(uid))
            return await asyncio.wait_for(future, timeout_s)
        finally:
            self._calls.pop(uid, None)

    def fail_all(self, message: str, status: int = 503) -> None:
        """A worker died: end every waiting request with an error."""
        self.failure = message
        self.end_all(message, status, abort=False)  # (no worker to tell)

    def end_all(self, message: str, status: int = 503, code: str = "server_unavailable", abort: bool = True) -> None:
        """End every request in flight with an error (a stream sends it as its last chunk); with
        `abort`, also abort its choices in the scheduler, which frees their pages."""
        for uid, stream in list(self._streams.items()):
            if abort and uid in stream.unfinished:
                self._send(AbortReq(uid))
            stream._deliver(uid, ErrorMsg(uid, message, status, None, code))

    @property
    def num_in_flight(self) -> int:
        return len({id(s) for s in self._streams.values()})

    def _send(self, msg: Any) -> None:
        try:
            self._push.send(encode_msg(msg), zmq.NOBLOCK, copy=False)
        except zmq.Again:
            logger.error("dropped a %s: the queue to the tokenizer worker is full", type(msg).__name__)

    def _forget(self, stream: RequestStream) -> None:
        for uid in stream.uids:
            if self._streams.get(uid) is stream:
                del self._streams[uid]
        if self.metrics is not None:
            self.metrics.in_flight.set(self.num_in_flight)

    # ---- replies -----------------------------------------------------------------------------
    async def _recv_loop(self) -> None:
        assert self._pull is not None
        while True:
            data = await self._pull.recv()
            try:
                msg = decode_msg(data)
            except Exception as exc:
                logger.error("API server dropped an undecodable message: %s", exc)
                continue
            if isinstance(msg, ReplyBatchMsg):
                for reply in msg.replies:
                    stream = self._streams.get(reply.uid)
                    if stream is not None:
                        stream._deliver(reply.uid, reply)
            elif isinstance(msg, (FlushCacheDone, ToolReply)) or (isinstance(msg, ErrorMsg) and msg.uid in self._calls):
                future = self._calls.get(msg.uid)
                if future is not None and not future.done():
                    future.set_result(msg)
            elif isinstance(msg, ErrorMsg):
                stream = self._streams.get(msg.uid)
                if stream is not None:
                    stream._deliver(msg.uid, msg)
            elif isinstance(msg, SchedulerStats):
                self.stats = msg
                if self.metrics is not None:
                    self.metrics.update_stats(msg)
            else:
                logger.warning("API server ignores a message of type %s", type(msg).__name__)
