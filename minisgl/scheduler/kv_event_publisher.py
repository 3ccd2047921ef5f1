"""The ZeroMQ side of --kv-events-endpoint: one PUB socket in the scheduler process (TP rank 0,
which owns the prefix cache), one message per scheduler iteration that changed the cache.

Each message has vLLM's three frames: `[topic, seq, payload]`, where seq is a counter from 0 as
8 big-endian bytes (a gap tells a subscriber it missed batches) and payload is a msgpack
EventBatch `[ts, [event, ...], data_parallel_rank]` (minisgl has one rank: 0); the events are
those of kvcache/events.py. As in vLLM, an endpoint with `*` (or ipc://, inproc://) is bound,
any other is connected to. Sends never block the scheduler: past the high-water mark a slow
subscriber loses messages, which the sequence numbers show.

Not imported by `minisgl.scheduler`: only process.py uses it, and only when the option is set.
"""

from __future__ import annotations

import time
from typing import Any

import msgpack
import zmq

from minisgl.kvcache.events import KVEventRecorder
from minisgl.utils.logger import init_logger

logger = init_logger(__name__)

SEND_HWM = 100_000
DATA_PARALLEL_RANK = 0


def _binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    def __init__(self, endpoint: str, recorder: KVEventRecorder, topic: str = "") -> None:
        self.recorder = recorder
        self.topic = topic.encode("utf-8")
        self._seq = 0
        self._ctx = zmq.Context()
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
        events = self.recorder.take()
        if not events:
            return
        payload: Any = msgpack.packb([time.time(), events, DATA_PARALLEL_RANK])
        try:
            self._sock.send_multipart([self.topic, self._seq.to_bytes(8, "big"), payload], zmq.NOBLOCK)
        except zmq.Again:
            logger.warning("a KV-event batch was dropped (seq %d): subscribers are not keeping up", self._seq)
        self._seq += 1

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()


def attach_kv_events(scheduler: Any, endpoint: str) -> KVEventPublisher | None:
    """Record the scheduler's radix-cache changes and publish them on `endpoint`; None (with a
    warning) when the cache is not a radix cache (`--cache naive` caches nothing)."""
    from minisgl.kvcache.radix import RadixCacheManager

    cache = getattr(scheduler, "cache", None)
    if not isinstance(cache, RadixCacheManager):
        logger.warning("--kv-events-endpoint: the prefix cache is %s, not radix: no KV events are published", type(cache).__name__)
        return None
    medium = "GPU" if str(scheduler.device).startswith("cuda") else "CPU"
    cache.events = KVEventRecorder(cache.page_size, medium)
    return KVEventPublisher(endpoint, cache.events)
