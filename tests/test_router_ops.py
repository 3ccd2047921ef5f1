"""What routers read (issue 30): router metric names, /loads, readiness, X-Request-Id, the drain
on SIGTERM, and KV events. One server for the live checks, one per SIGTERM case (started
together, so their start-ups overlap)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import subprocess
import threading
import time
from typing import Any, Dict, Iterator, List

import httpx
import msgpack
import pytest
import zmq
from server_helpers import ServerProcess, assert_error_body, free_port, pids_alive

PAGE = 4
EXTRA = ("--dtype", "float32", "--max-seq-len", "1024", "--page-size", str(PAGE))
# 16 prompts of 48 pages each cannot all stay cached in 256 pages: the cache evicts
NUM_PAGES = 256


def _start(model: str, logs: Any, name: str, *extra: str) -> ServerProcess:
    return ServerProcess(model, *EXTRA, *extra, log_path=logs / f"{name}.log")


@pytest.fixture(scope="module")
def servers(tiny_chat_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Dict[str, Any]]:
    logs = tmp_path_factory.mktemp("router_ops")
    kv_port, replay_port = free_port(), free_port()
    kv = ("--kv-events-endpoint", f"tcp://*:{kv_port}", "--kv-events-replay-endpoint", f"tcp://*:{replay_port}")
    started = {
        "main": _start(tiny_chat_model, logs, "main", "--num-pages", str(NUM_PAGES), *kv),
        "drain": _start(tiny_chat_model, logs, "drain", "--num-pages", "2048", "--shutdown-timeout", "60"),
        "cut": _start(tiny_chat_model, logs, "cut", "--num-pages", "2048", "--shutdown-timeout", "1"),
    }
    try:
        first_health = _first_answer(started["main"])
        for s in started.values():
            s.wait_ready()
        yield {**started, "kv_endpoint": f"tcp://127.0.0.1:{kv_port}", "replay_endpoint": f"tcp://127.0.0.1:{replay_port}",
               "first_health": first_health}  # fmt: skip
    finally:
        for s in started.values():
            s.stop()


def _first_answer(srv: ServerProcess) -> httpx.Response:
    """The first answer /health gives once the port opens (the workers then take seconds to load)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and srv.proc.poll() is None:
        try:
            return httpx.get(srv.base_url + "/health", headers={"X-Request-Id": "probe-1"}, timeout=10)
        except httpx.TransportError:
            time.sleep(0.02)  # the port is not bound yet (Python start-up)
    raise AssertionError(f"the port never answered:\n{srv.log()[-3000:]}")


class Stream:
    """An SSE stream read on a thread into `lines`; `close()` drops the connection (the server
    then aborts the request)."""

    def __init__(self, srv: ServerProcess, body: Dict[str, Any], headers: Dict[str, str] | None = None) -> None:
        self.lines: List[str] = []
        self._first = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, args=(srv, body, headers), daemon=True)
        self._thread.start()
        assert self._first.wait(120), "the stream sent nothing"

    def _read(self, srv: ServerProcess, body: Dict[str, Any], headers: Dict[str, str] | None) -> None:
        try:
            with httpx.stream(
                "POST", srv.base_url + "/v1/completions", json={**body, "stream": True}, headers=headers, timeout=120
            ) as resp:
                self.lines.append(f"status {resp.status_code} id {resp.headers.get('x-request-id')}")
                for line in resp.iter_lines():
                    if line.startswith("data:"):
                        self.lines.append(line)
                        self._first.set()
                    if self._stop.is_set():
                        return
        except httpx.HTTPError as exc:
            self.lines.append(f"transport error: {exc!r}")
        finally:
            self._first.set()

    def join(self, timeout: float = 60) -> List[str]:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the stream did not end"
        return self.lines

    def close(self) -> None:
        self._stop.set()
        self.join()


# ---- metrics and /loads ---------------------------------------------------------------------------

ALIASES = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "sglang:num_queue_reqs",
    "sglang:token_usage",
    "sglang:num_running_reqs",
)


def _labelled(metrics: Dict[str, float], name: str, model: str) -> float:
    return metrics[f'{name}{{model_name="{model}"}}']


def test_router_metrics_move_while_a_request_runs(servers: Dict[str, Any]) -> None:
    srv: ServerProcess = servers["main"]
    model = srv.openai().models.list().data[0].id
    idle = srv.wait_idle()
    for name in ALIASES:
        assert _labelled(idle, name, model) == 0.0, name
    # closed (aborted) after the checks below
    stream = Stream(srv, {"prompt": "Count on and on", "max_tokens": 900, "ignore_eos": True, "temperature": 0})
    # The first chunk is out. The scheduler sends a changed load ahead of a step's tokens, on the
    # same socket, so the server already holds running = 1; frozen from here, the request cannot
    # end however fast the machine, and /v1/loads reads the same scheduler numbers as /metrics.
    with _frozen_scheduler(srv):
        busy = srv.wait_metric(f'vllm:num_requests_running{{model_name="{model}"}}', 1)
        assert _labelled(busy, "vllm:kv_cache_usage_perc", model) > 0
        assert _labelled(busy, "sglang:token_usage", model) == _labelled(busy, "vllm:kv_cache_usage_perc", model)
        assert _labelled(busy, "vllm:kv_cache_usage_perc", model) == busy["minisgl_kv_cache_usage"]
        loads = httpx.get(srv.base_url + "/v1/loads", timeout=10).json()
    stream.close()
    assert loads["dp_rank_count"] == 1 and len(loads["loads"]) == 1
    load = loads["loads"][0]
    assert load["num_running_reqs"] >= 1 and 0 < load["token_usage"] <= 1
    assert load["max_total_num_tokens"] == NUM_PAGES * PAGE
    after = srv.wait_idle()
    assert _labelled(after, "vllm:num_requests_running", model) == 0
    # vLLM's prefix-cache counters count prompt tokens (queries) and those found cached (hits)
    assert after[f'vllm:prefix_cache_queries_total{{model_name="{model}"}}'] >= 1
    assert after[f'vllm:prefix_cache_queries_total{{model_name="{model}"}}'] == after["minisgl_prompt_tokens_total"]


def test_loads_on_both_paths(servers: Dict[str, Any]) -> None:
    srv: ServerProcess = servers["main"]
    srv.wait_idle()
    for path in ("/loads", "/v1/loads"):
        resp = httpx.get(srv.base_url + path, timeout=10)
        assert resp.status_code == 200, resp.text
        body = resp.json()
        (load,) = body["loads"]
        assert load["dp_rank"] == 0 and load["num_running_reqs"] == 0 and load["num_waiting_reqs"] == 0
        for key in ("num_total_reqs", "num_used_tokens", "max_total_num_tokens", "token_usage", "gen_throughput", "cache_hit_rate",
                    "utilization", "max_running_requests"):  # fmt: skip
            assert isinstance(load[key], (int, float)), key


# ---- readiness and request ids --------------------------------------------------------------------


def test_health_is_503_while_loading_then_200(servers: Dict[str, Any]) -> None:
    first: httpx.Response = servers["first_health"]  # answered while the workers were starting
    assert first.status_code == 503 and first.json()["status"] == "loading"
    assert first.headers["x-request-id"] == "probe-1" and first.headers["retry-after"]
    srv: ServerProcess = servers["main"]
    assert httpx.get(srv.base_url + "/health", timeout=10).status_code == 200
    assert "still loading" in srv.log() or "scheduler ready" in srv.log()


def test_request_id_echoed_given_and_generated(servers: Dict[str, Any]) -> None:
    srv: ServerProcess = servers["main"]
    given = httpx.get(srv.base_url + "/v1/models", headers={"X-Request-Id": "trace-abc-123"}, timeout=10)
    assert given.headers["x-request-id"] == "trace-abc-123"
    made = httpx.get(srv.base_url + "/health", timeout=10)
    assert made.status_code == 200 and len(made.headers["x-request-id"]) == 32
    other = httpx.get(srv.base_url + "/health", timeout=10)
    assert other.headers["x-request-id"] != made.headers["x-request-id"]
    bad = httpx.post(
        srv.base_url + "/v1/completions", json={"prompt": "hi", "max_tokens": -1}, headers={"X-Request-Id": "req-4xx"}, timeout=10
    )
    assert_error_body(bad, 400, param="max_tokens")
    assert bad.headers["x-request-id"] == "req-4xx"
    missing = httpx.get(srv.base_url + "/no/such/route", headers={"X-Request-Id": "req-404"}, timeout=10)
    assert missing.status_code == 404 and missing.headers["x-request-id"] == "req-404"
    # an id a client could use to forge log lines is replaced
    forged = httpx.get(srv.base_url + "/health", headers={"X-Request-Id": "a" * 200}, timeout=10)
    assert forged.headers["x-request-id"] != "a" * 200
    lines = Stream(srv, {"prompt": "Hello", "max_tokens": 5, "temperature": 0}, headers={"X-Request-Id": "stream-77"}).join()
    assert lines[0] == "status 200 id stream-77", lines[0]
    log_deadline = time.monotonic() + 30  # the request's log line is written when it ends
    while "[stream-77]" not in srv.log() and time.monotonic() < log_deadline:
        time.sleep(0.05)
    assert "[stream-77]" in srv.log()


# ---- KV events ------------------------------------------------------------------------------------


def _oracle_hash(parent: int | None, tokens: List[int]) -> int:
    """docs/SERVER.md's block hash, written out independently of minisgl/kvcache/events.py."""
    prefix = (parent or 0).to_bytes(8, "big")
    data = prefix + b"".join(t.to_bytes(4, "big") for t in tokens)
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "big")


class Subscriber:
    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        self.last_seq: int | None = None

    def batches(self, timeout_s: float) -> Iterator[List[Any]]:
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if not self.sock.poll(int(left * 1000)):
                return
            topic, seq, payload = self.sock.recv_multipart()
            seq_n = int.from_bytes(seq, "big")
            assert len(seq) == 8 and (self.last_seq is None or seq_n == self.last_seq + 1), (self.last_seq, seq_n)
            self.last_seq = seq_n
            ts, events, dp_rank = msgpack.unpackb(payload)
            assert isinstance(ts, float) and dp_rank == 0
            yield events

    def until(self, kind: str, timeout_s: float = 60.0) -> List[List[Any]]:
        """Every event up to and including the first of `kind`."""
        seen: List[List[Any]] = []
        for events in self.batches(timeout_s):
            seen.extend(events)
            if any(e[0] == kind for e in events):
                return seen
        raise AssertionError(f"no {kind} event within {timeout_s} s; saw {[e[0] for e in seen]}")

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def _flush(srv: ServerProcess) -> None:
    resp = httpx.post(srv.base_url + "/flush_cache", timeout=30)
    assert resp.status_code == 200, resp.text


def _complete(srv: ServerProcess, prompt: List[int], max_tokens: int = 1) -> Dict[str, Any]:
    resp = httpx.post(
        srv.base_url + "/v1/completions",
        json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
        timeout=60,
    )
    assert resp.status_code == 200, resp.text
    return resp.json()


def _stored(events: List[List[Any]]) -> List[List[Any]]:
    return [e for e in events if e[0] == "BlockStored"]


def _check_chain(stored: List[Any]) -> None:
    _, hashes, parent, tokens, block_size, lora_id, medium = stored
    assert block_size == PAGE and len(tokens) == PAGE * len(hashes) and lora_id is None and medium == "CPU"
    expected, h = [], parent
    for i in range(len(hashes)):
        h = _oracle_hash(h, tokens[i * PAGE : (i + 1) * PAGE])
        expected.append(h)
    assert hashes == expected


@pytest.fixture(scope="module")
def subscriber(servers: Dict[str, Any]) -> Iterator[Subscriber]:
    sub = Subscriber(servers["kv_endpoint"])
    srv: ServerProcess = servers["main"]
    # A SUB socket gets only what is published after its subscription reached the publisher
    # (ZeroMQ's slow joiner): flush until an AllBlocksCleared arrives, then nothing is missed.
    deadline = time.monotonic() + 60
    while True:
        srv.wait_idle()
        _flush(srv)
        if any(e[0] == "AllBlocksCleared" for events in sub.batches(0.5) for e in events):
            break
        assert time.monotonic() < deadline, "no KV event reached the subscriber"
    yield sub
    sub.close()


def test_kv_events_stored_cleared_and_reproduced(servers: Dict[str, Any], subscriber: Subscriber) -> None:
    srv: ServerProcess = servers["main"]
    prompt = [1000 + 7 * i for i in range(8 * PAGE)]  # 8 whole pages
    _complete(srv, prompt)
    first = _stored(subscriber.until("BlockStored"))
    assert len(first) == 1 and first[0][2] is None  # a fresh tree: the first page has no parent
    _check_chain(first[0])
    tokens = first[0][3]
    assert tokens[: len(prompt)] == prompt
    hashes = first[0][1]

    # same prefix, another tail: the cached pages are reused, the new ones chain onto them
    longer = prompt + [3000 + i for i in range(3 * PAGE)]
    usage = _complete(srv, longer)["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= len(prompt) - PAGE
    (second,) = _stored(subscriber.until("BlockStored"))
    _check_chain(second)
    assert second[2] in hashes  # its parent is a page the first request stored

    srv.wait_idle()
    _flush(srv)
    assert subscriber.until("AllBlocksCleared")[-1] == ["AllBlocksCleared"]
    # after the flush the same prompt is stored again under the same hashes
    _complete(srv, prompt)
    (again,) = _stored(subscriber.until("BlockStored"))
    assert again[1] == hashes and again[3] == tokens


def test_kv_events_removed_on_eviction(servers: Dict[str, Any], subscriber: Subscriber) -> None:
    srv: ServerProcess = servers["main"]
    srv.wait_idle()
    _flush(srv)
    subscriber.until("AllBlocksCleared")
    stored_hashes: set[int] = set()
    removed: List[List[Any]] = []
    for n in range(16):  # 16 x 48 pages > 256 pages: older prompts are evicted
        _complete(srv, [20000 + 100 * n + i for i in range(48 * PAGE)])
        for events in subscriber.batches(0.2):
            for e in events:
                if e[0] == "BlockStored":
                    stored_hashes.update(e[1])
                elif e[0] == "BlockRemoved":
                    removed.append(e)
        if removed:
            break
    else:
        removed = [e for e in subscriber.until("BlockRemoved") if e[0] == "BlockRemoved"]
    assert removed, "no eviction"
    for e in removed:
        assert e[2] == "CPU" and e[1] and set(e[1]) <= stored_hashes, e


def test_kv_events_replay_resends_what_was_published(servers: Dict[str, Any], subscriber: Subscriber) -> None:
    srv: ServerProcess = servers["main"]
    srv.wait_idle()
    _flush(srv)
    live = subscriber.until("AllBlocksCleared")
    last = subscriber.last_seq
    assert last is not None and last >= 2
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(servers["replay_endpoint"])
    try:
        dealer.send_multipart([b"", (last - 2).to_bytes(8, "big")])
        replayed = []
        while True:
            assert dealer.poll(30_000), "no replay answer"
            empty, seq, payload = dealer.recv_multipart()
            assert empty == b""
            if seq == (-1).to_bytes(8, "big", signed=True):
                break
            replayed.append((int.from_bytes(seq, "big"), msgpack.unpackb(payload)[1]))
    finally:
        dealer.close(linger=0)
        ctx.term()
    assert [s for s, _ in replayed] == [last - 2, last - 1, last]
    assert replayed[-1][1][-1] == live[-1] == ["AllBlocksCleared"]


# ---- SIGTERM: the drain ---------------------------------------------------------------------------


def _wait_exit(srv: ServerProcess, timeout: float) -> int:
    try:
        return srv.proc.wait(timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"server still running {timeout} s later:\n{srv.log()[-3000:]}") from None


def _clean_exit_log(srv: ServerProcess, pids: List[int]) -> str:
    """The log once every process of the tree is gone (multiprocessing's resource tracker, the
    last, prints its leak warnings as it exits)."""
    deadline = time.monotonic() + 30
    while pids_alive(pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pids_alive(pids), pids_alive(pids)
    log = srv.log()
    for bad in ("Traceback", "CancelledError", "leaked semaphore"):
        assert bad not in log, log[-3000:]
    return log


@contextlib.contextmanager
def _frozen_scheduler(srv: ServerProcess) -> Iterator[None]:
    """SIGSTOP the scheduler process for the block: what it runs cannot progress meanwhile."""
    import psutil

    sched = [c.pid for c in psutil.Process(srv.proc.pid).children(recursive=True) if c.name().startswith("minisgl-sched")]
    assert len(sched) == 1, sched
    os.kill(sched[0], signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(sched[0], signal.SIGCONT)


def _wait_draining(srv: ServerProcess) -> httpx.Response:
    deadline = time.monotonic() + 30
    while True:
        health = httpx.get(srv.base_url + "/health", timeout=10)
        if health.status_code == 503 or time.monotonic() > deadline:
            return health


def test_sigterm_drains_open_streams_and_refuses_new_requests(servers: Dict[str, Any]) -> None:
    srv: ServerProcess = servers["drain"]
    pids = srv.tree_pids()
    stream = Stream(srv, {"prompt": "Keep going", "max_tokens": 200, "ignore_eos": True, "temperature": 0})
    # The scheduler is frozen while the drain is probed, so the stream is still open however fast
    # the machine is (a fast one once finished all its tokens before the late request was sent).
    with _frozen_scheduler(srv):
        srv.proc.send_signal(signal.SIGTERM)
        health = _wait_draining(srv)
        assert health.status_code == 503 and health.json()["status"] == "draining"
        refused = httpx.post(
            srv.base_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers={"X-Request-Id": "late-1"}, timeout=10
        )
        err = assert_error_body(refused, 503, code="server_unavailable")
        assert "shutting down" in err["message"] and refused.headers["x-request-id"] == "late-1"
    assert _wait_exit(srv, 90) == 0
    lines = stream.join()
    assert lines[-1] == "data: [DONE]", lines[-3:]
    assert any('"finish_reason": "length"' in line for line in lines), lines[-3:]
    log = _clean_exit_log(srv, pids)
    assert "SIGTERM received" in log and "every request finished" in log


def test_sigterm_past_the_timeout_ends_streams_with_an_error_chunk(servers: Dict[str, Any]) -> None:
    srv: ServerProcess = servers["cut"]
    body = {"prompt": "Keep going", "max_tokens": 1000, "ignore_eos": True, "temperature": 0.7, "n": 4}
    pids = srv.tree_pids()
    stream = Stream(srv, body)
    # Frozen, the scheduler cannot finish the request within the 1 s --shutdown-timeout on any
    # machine; it runs again once the API server has ended the stream (it is then told to stop).
    with _frozen_scheduler(srv):
        srv.proc.send_signal(signal.SIGTERM)
        lines = stream.join()
    assert _wait_exit(srv, 60) == 0
    errors = [line for line in lines if line.startswith('data: {"error"')]
    assert errors, lines[-3:]
    assert "server_shutting_down" in errors[-1] and "--shutdown-timeout" in errors[-1]
    log = _clean_exit_log(srv, pids)
    assert "SIGTERM received" in log and "ending 1 request(s) still running" in log


def test_radix_events_follow_splits_and_evictions() -> None:
    """The cache alone (no server): a node split keeps each page's hash; evictions name them."""
    from minisgl.kvcache.events import KVEventRecorder
    from minisgl.kvcache.radix import RadixCacheManager

    cache = RadixCacheManager(PAGE)
    cache.events = KVEventRecorder(PAGE, "CPU")
    a = list(range(100, 100 + 6 * PAGE))
    b = a[: 2 * PAGE] + list(range(500, 500 + 3 * PAGE))  # shares a's first 2 pages: splits its node
    cache.insert(a, list(range(6)))
    cache.insert(b, [0, 1, 10, 11, 12])
    sa, sb = cache.events.take()
    _check_chain(sa)
    _check_chain(sb)
    assert sa[2] is None and sb[2] == sa[1][1] and sb[3] == b[2 * PAGE :]
    freed = cache.evict(9)  # everything: the two leaves, then the shared upper node
    assert sorted(freed) == [0, 1, 2, 3, 4, 5, 10, 11, 12]
    removed = [h for e in cache.events.take() for h in e[1]]
    assert sorted(removed) == sorted(sa[1] + sb[1])
    cache.insert(a, list(range(6)))
    cache.events.take()
    cache.reset()
    assert cache.events.take() == [["AllBlocksCleared"]]
    plain = RadixCacheManager(PAGE)  # no recorder: no hashes kept
    plain.insert(a, list(range(6)))
    assert all(not n.hashes for n in plain._leaves())


def test_loading_answers() -> None:
    """What the port says before the workers are ready, by request (no server needed)."""
    import json

    from minisgl.server.loading import loading_response

    def parse(raw: bytes) -> tuple[str, Dict[str, str], bytes]:
        head, _, body = raw.partition(b"\r\n\r\n")
        status, *lines = head.decode().split("\r\n")
        return status, {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}, body

    status, headers, body = parse(loading_response(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Request-Id: abc\r\n\r\n"))
    assert status == "HTTP/1.1 503 Service Unavailable" and headers["x-request-id"] == "abc"
    assert json.loads(body)["status"] == "loading" and int(headers["content-length"]) == len(body)
    status, headers, body = parse(loading_response(b"POST /v1/chat/completions HTTP/1.1\r\nX-Request-Id: \x01bad\r\n\r\n"))
    assert json.loads(body)["error"]["code"] == "server_loading" and headers["retry-after"] == "5"
    assert headers["x-request-id"] != "\x01bad" and len(headers["x-request-id"]) == 32
    _, headers, body = parse(loading_response(b"HEAD /health HTTP/1.1\r\n\r\n"))
    assert body == b"" and int(headers["content-length"]) > 0  # HEAD: the GET's headers, no body
