"""Two minisgl replicas behind a real SMG gateway (the Shepherd Model Gateway, `smg` on PyPI,
what sglang-router became), as issue 30 asks: chats through the gateway, cache-aware routing on our
prefix cache, and a replica drained by SIGTERM while the gateway keeps serving from the other.

The replicas serve the tiny chat model (the embedded model's tokenizer and chat template, random
weights): routing and draining do not depend on the weights, and two embedded-model replicas would
cost the suite half a minute more."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time
from typing import Any, Dict, Iterator, List

import httpx
import pytest
from server_helpers import ServerProcess, free_port

if shutil.which("smg") is None:
    pytest.skip("the smg gateway is not installed (pip install smg: a test extra)", allow_module_level=True)

EXTRA = ("--dtype", "float32", "--max-seq-len", "1024", "--page-size", "4", "--shutdown-timeout", "60")
MODEL = "tiny_chat_llama"
SYSTEM = "You are a helpful assistant. " + " ".join(f"Rule {i}: be kind and precise." for i in range(40))


class Gateway:
    def __init__(self, workers: List[ServerProcess], log_path: Any) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = ["smg", "launch", "--worker-urls", *[w.base_url for w in workers], "--policy", "cache_aware",
               "--host", "127.0.0.1", "--port", str(self.port), "--prometheus-host", "127.0.0.1",
               "--prometheus-port", str(free_port()), "--log-level", "warn"]  # fmt: skip
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                if httpx.get(self.url + "/v1/models", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"the gateway never answered (rc {self.proc.poll()})")

    def stop(self) -> None:
        self.proc.kill()  # (the gateway's own graceful stop is not under test: it waits seconds)
        self.proc.wait(20)
        self._log.close()


@pytest.fixture(scope="module")
def replicas(tiny_chat_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Dict[str, Any]]:
    logs = tmp_path_factory.mktemp("smg")
    workers = [ServerProcess(tiny_chat_model, *EXTRA, log_path=logs / f"replica{i}.log") for i in range(2)]
    gateway = None
    try:
        for w in workers:
            w.wait_ready()
        gateway = Gateway(workers, logs / "gateway.log")
        gateway.wait_ready()
        yield {"workers": workers, "gateway": gateway}
    finally:
        if gateway is not None:
            gateway.stop()
        for w in workers:
            w.stop()


def _finished(srv: ServerProcess) -> float:
    return sum(v for k, v in srv.metrics().items() if k.startswith("minisgl_requests_total"))


def _chat(url: str, messages: List[Dict[str, str]], **kw: Any) -> httpx.Response:
    body = {"model": MODEL, "messages": messages, "max_tokens": 4, "temperature": 0, **kw}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=120)


def _shared(i: int) -> List[Dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Question {i}?"}]


def test_chats_through_the_gateway_follow_the_prefix_cache(replicas: Dict[str, Any]) -> None:
    url = replicas["gateway"].url
    workers: List[ServerProcess] = replicas["workers"]
    before = [_finished(w) for w in workers]
    first = _chat(url, _shared(0))
    assert first.status_code == 200, first.text
    owner = [i for i, w in enumerate(workers) if _finished(w) > before[i]]
    assert len(owner) == 1
    for i in range(1, 10):  # the same long system prompt: routed where it is cached
        resp = _chat(url, _shared(i))
        assert resp.status_code == 200, resp.text
        usage = resp.json()["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] > usage["prompt_tokens"] // 2, (i, usage)
    for i in range(10):  # prompts of their own
        resp = _chat(url, [{"role": "user", "content": f"Tell me about the number {i * 7919}."}])
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["message"]["content"] is not None
    after = [_finished(w) for w in workers]
    assert sum(after) - sum(before) == 20  # each chat ran once (no retry ran one twice)
    assert after[owner[0]] - before[owner[0]] >= 10


def test_a_draining_replica_finishes_its_streams_and_the_gateway_uses_the_other(replicas: Dict[str, Any]) -> None:
    import psutil

    url = replicas["gateway"].url
    workers: List[ServerProcess] = replicas["workers"]
    before = [_finished(w) for w in workers]
    assert _chat(url, _shared(0)).status_code == 200  # (cached on one replica since the test before, or now)
    owner = [i for i, w in enumerate(workers) if _finished(w) > before[i]]
    assert len(owner) == 1
    draining, other = workers[owner[0]], workers[1 - owner[0]]
    before = [_finished(w) for w in workers]
    pids = draining.tree_pids()
    # The draining replica's scheduler is frozen from before its streams start until the new
    # requests were answered: the streams are still open then, however fast the machine is.
    sched = [c.pid for c in psutil.Process(draining.proc.pid).children(recursive=True) if c.name().startswith("minisgl-sched")]
    assert len(sched) == 1
    os.kill(sched[0], signal.SIGSTOP)
    lines: List[List[str]] = [[] for _ in range(3)]

    def stream(i: int) -> None:
        body = {"model": MODEL, "messages": _shared(100 + i), "max_tokens": 64, "ignore_eos": True, "temperature": 0, "stream": True}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as resp:
            lines[i].append(f"status {resp.status_code}")
            lines[i].extend(line for line in resp.iter_lines() if line.startswith("data:"))

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(3)]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60  # cache-aware: the shared-prefix streams go to the owner
        while draining.metrics().get("minisgl_http_requests_in_flight", 0) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert draining.metrics().get("minisgl_http_requests_in_flight", 0) == 3
        draining.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while httpx.get(draining.base_url + "/health", timeout=10).status_code != 503 and time.monotonic() < deadline:
            time.sleep(0.05)
        new = [_chat(url, _shared(200 + i) if i % 2 else [{"role": "user", "content": f"new {i}"}]) for i in range(8)]
    finally:
        os.kill(sched[0], signal.SIGCONT)
    assert [r.status_code for r in new] == [200] * 8, [r.text[:200] for r in new if r.status_code != 200]
    for t in threads:
        t.join(120)
    for got in lines:
        assert got[0] == "status 200" and got[-1] == "data: [DONE]", got[-3:]
        assert any('"finish_reason":"length"' in x.replace(" ", "") for x in got), got[-3:]
    assert draining.proc.wait(90) == 0, draining.log()[-3000:]
    assert "every request finished" in draining.log()
    # nothing lost, nothing run twice: the 8 new chats ran on the other replica, once each
    assert _finished(other) - before[1 - owner[0]] == 8  # (the drained replica's 3 are its streams above)
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
