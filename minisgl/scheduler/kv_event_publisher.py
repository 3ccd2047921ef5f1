"""The ZeroMQ side of --kv-events-endpoint: one PUB socket in the scheduler process (TP rank 0,
which owns the prefix cache), one message per scheduler iteration that changed the cache.

Each message has vLLM's three frames: `[topic, seq, payload]`, where seq is a counter from 0 as
8 big-endian bytes (a gap tells a subscriber it missed batches) and payload is a msgpack
EventBatch `[ts, [event, ...], data_parallel_rank]` (minisgl has one rank: 0); the events are
those of kvcache/events.py. As in vLLM, an endpoint with `*` (or ipc://, inproc://) is bound,
any other is connected to. Sends never block the scheduler: past the high-water mark a slow
subscriber loses messages, which the sequence numbers show.

With a replay endpoint (--kv-events-replay-endpoint, vLLM's `replay_endpoint`), a ROUTER socket
there resends the last REPLAY_BATCHES batches: a subscriber that saw a gap sends the first
sequence number it lacks (8 big-endian bytes, from a DEALER: `[b"", seq]`) and gets back
`[b"", seq, payload]` for each batch it still has from there on, then `[b"", -1 as 8 signed
big-endian bytes, b""]`. Requests are served between scheduler iterations (at the latest a
second later when idle: the loop's poll interval).

Not imported by `minisgl.scheduler`: only process.py uses it, and only when the option is set.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Deque, Tuple

import msgpack
import zmq

from minisgl.kvcache.events import KVEventRecorder
from minisgl.utils.logger import init_logger

logger = init_logger(__name__)

SEND_HWM = 100_000
DATA_PARALLEL_RANK = 0
REPLAY_BATCHES = 10_000  # what a replay can resend (vLLM's default buffer_steps)
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


def _binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    def __init__(self, endpoint: str, recorder: KVEventRecorder, topic: str = "", replay_endpoint: str | None = None) -> None:
        self.recorder = recorder
        self.topic = topic.encode("utf-8")
        self._seq = 0
        self._ctx = zmq.Context()
        self._replay: zmq.Socket | None = None
        self._sent: Deque[Tuple[int, bytes]] = deque(maxlen=REPLAY_BATCHES)
        if replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(replay_endpoint)
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.SNDHWM, SEND_HWM)
        self._sock.setsockopt(zmq.LINGER, 0)
        if _binds(endpoint):
            self._sock.bind(endpoint)
        else:
            self._sock.connect(endpoint)
        logger.info("publishing KV events on %s", endpoint)

    def publish(self) -> None:
        """Send what the cache recorded since the last call (nothing when it did not change)."""
        if self._replay is not None:
            self._serve_replays(self._replay)
        events = self.recorder.take()
        if not events:
            return
        payload: Any = msgpack.packb([time.time(), events, DATA_PARALLEL_RANK])
        try:
            self._sock.send_multipart([self.topic, self._seq.to_bytes(8, "big"), payload], zmq.NOBLOCK)
        except zmq.Again:
            logger.warning("a KV-event batch was dropped (seq %d): subscribers are not keeping up", self._seq)
        if self._replay is not None:
            self._sent.append((self._seq, payload))
        self._seq += 1

    def _serve_replays(self, sock: zmq.Socket) -> None:
        while sock.poll(0):
            frames = sock.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                logger.warning("ignored a malformed KV-event replay request (%d frames)", len(frames))
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            try:
                for seq, payload in self._sent:
                    if seq >= first:
                        sock.send_multipart([client, b"", seq.to_bytes(8, "big"), payload], zmq.NOBLOCK)
                sock.send_multipart([client, b"", END_OF_REPLAY, b""], zmq.NOBLOCK)
            except zmq.Again:
                logger.warning("a KV-event replay was cut short: the client is not reading")

    def close(self) -> None:
        self._sock.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()


def attach_kv_events(scheduler: Any, endpoint: str, replay_endpoint: str | None = None) -> KVEventPublisher | None:
    """Record the scheduler's radix-cache changes and publish them on `endpoint`; None (with a
    warning) when the cache is not a radix cache (`--cache naive` caches nothing)."""
    from minisgl.kvcache.radix import RadixCacheManager

    cache = getattr(scheduler, "cache", None)
    if not isinstance(cache, RadixCacheManager):
        logger.warning("--kv-events-endpoint: the prefix cache is %s, not radix: no KV events are published", type(cache).__name__)
        return None
    medium = "GPU" if str(scheduler.device).startswith("cuda") else "CPU"
    cache.events = KVEventRecorder(cache.page_size, medium)
    return KVEventPublisher(endpoint, cache.events, replay_endpoint=replay_endpoint)
