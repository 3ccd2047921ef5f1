"""The server's process tree: start-up, SIGTERM, a dying child, bad command lines."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from typing import Any, Dict, List

import httpx
import pytest
from server_helpers import REPO, ServerProcess, pids_alive

EXTRA = ("--dtype", "float32", "--max-seq-len", "256", "--num-pages", "2048")


@pytest.fixture(scope="module")
def two_servers(tiny_chat_model: str, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Two servers, started together to overlap their start-up."""
    logs = tmp_path_factory.mktemp("lifecycle")
    servers = [ServerProcess(tiny_chat_model, *EXTRA, log_path=logs / f"server{i}.log") for i in range(2)]
    try:
        for s in servers:
            s.wait_ready()
        yield servers
    finally:
        for s in servers:
            s.stop()


def _wait_exit(srv: ServerProcess, timeout: float) -> int:
    try:
        return srv.proc.wait(timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"server still running {timeout} s later:\n{srv.log()[-3000:]}") from None


def _wait_gone(pids: List[int], timeout: float = 10.0) -> List[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and pids_alive(pids):
        time.sleep(0.1)
    return pids_alive(pids)


def _child_named(srv: ServerProcess, prefix: str) -> int:
    import psutil

    for child in psutil.Process(srv.proc.pid).children(recursive=True):
        if child.name().startswith(prefix):
            return child.pid
    raise AssertionError(f"no child process named {prefix}*")


def test_ctrl_c_ends_every_process_cleanly(two_servers: List[ServerProcess]) -> None:
    """Ctrl-C: SIGINT to the whole process group (the server runs in its own session), as a
    terminal sends it; SIGTERM to the API server alone is tests/test_router_ops.py's."""
    import os

    srv = two_servers[0]
    pids = srv.tree_pids()
    assert len(pids) >= 3, pids  # API server, scheduler, tokenizer worker (+ multiprocessing's tracker)
    _child_named(srv, "minisgl-sched")
    _child_named(srv, "minisgl-tokeniz")
    deadline = time.monotonic() + 10  # the banner follows the first /health answer by a poll or two
    while "minisgl ready" not in srv.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "minisgl ready" in srv.log()
    # a stream in flight does not hold the shutdown up
    events: List[str] = []

    def stream() -> None:
        body = {"prompt": "Go on and on", "max_tokens": 200, "ignore_eos": True, "stream": True, "temperature": 0}
        try:
            with httpx.stream("POST", srv.base_url + "/v1/completions", json=body, timeout=30) as resp:
                for line in resp.iter_lines():
                    events.append(line)
        except httpx.HTTPError as exc:
            events.append(f"error: {exc}")

    t = threading.Thread(target=stream)
    t.start()
    deadline = time.monotonic() + 30
    while not events and time.monotonic() < deadline:
        time.sleep(0.05)
    start = time.monotonic()
    os.killpg(srv.proc.pid, signal.SIGINT)
    rc = _wait_exit(srv, 15)
    elapsed = time.monotonic() - start
    t.join(30)
    assert rc == 0, (elapsed, srv.log()[-3000:])  # _wait_exit's 15 s is the (generous) bound
    # every process is gone, multiprocessing's resource tracker (which prints leak warnings) too
    assert _wait_gone(pids) == [], f"processes left behind: {pids_alive(pids)}"
    log = srv.log()
    assert "SIGINT received" in log
    # children ignore SIGINT and end on the parent's SIGTERM, in time (none killed) and leaving
    # no named semaphore behind (the tokenizer worker's encode pool)
    for bad in ("Traceback", "leaked semaphore", "ignored SIGTERM"):
        assert bad not in log, log[-3000:]


def test_dead_scheduler_stops_the_server(two_servers: List[ServerProcess]) -> None:
    import os

    srv = two_servers[1]
    pids = srv.tree_pids()
    sched = _child_named(srv, "minisgl-sched")
    # The scheduler is frozen (SIGSTOP) before the request is sent, so the request is still in
    # flight when the SIGKILL lands however fast or slow the machine is; the API server counting
    # it in flight is the trigger, not a clock.
    os.kill(sched, signal.SIGSTOP)
    body = {"prompt": "Go on and on", "max_tokens": 20, "temperature": 0}
    results: Dict[str, Any] = {}

    def request() -> None:
        try:
            results["resp"] = httpx.post(srv.base_url + "/v1/completions", json=body, timeout=60)
        except httpx.HTTPError as exc:
            results["error"] = exc

    t = threading.Thread(target=request)
    t.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and srv.metrics().get("minisgl_http_requests_in_flight", 0) == 0:
        time.sleep(0.05)
    assert "resp" not in results, results  # (the frozen scheduler cannot have answered it)
    os.kill(sched, signal.SIGKILL)
    rc = _wait_exit(srv, 20)
    t.join(30)
    log = srv.log()
    assert rc == 1, log[-3000:]
    assert f"the scheduler process (pid {sched}) was killed by SIGKILL" in log
    assert _wait_gone(pids) == [], f"processes left behind: {pids_alive(pids)}"
    # the request in flight was answered with an error, not left hanging
    assert "resp" in results, results
    assert results["resp"].status_code == 503, results["resp"].text
    assert "scheduler" in results["resp"].json()["error"]["message"]


def test_bad_model_path_fails_fast() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "minisgl", "--model", "/nonexistent/model", "--port", "1"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "/nonexistent/model" in proc.stderr and "does not exist" in proc.stderr


def test_help_documents_every_option() -> None:
    proc = subprocess.run([sys.executable, "-m", "minisgl", "--help"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0
    for flag in (
        "--model", "--host", "--port", "--dtype", "--device", "--tp", "--attention-backend", "--cache",
        "--max-running-requests", "--page-size", "--max-prefill-length", "--memory-ratio", "--num-pages",
        "--max-seq-len", "--api-key", "--shell", "--log-level",
    ):  # fmt: skip
        assert flag in proc.stdout, flag
    assert "127.0.0.1" in proc.stdout and "1919" in proc.stdout


def test_worker_failing_at_start_up_is_reported(tiny_chat_model: str, tmp_path) -> None:  # noqa: F811
    import shutil
    from pathlib import Path

    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(tiny_chat_model) / name, broken / name)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")  # the scheduler fails to load it
    proc = subprocess.run(
        [sys.executable, "-m", "minisgl", "--model", str(broken), "--port", "1", "--dtype", "float32", "--num-pages", "64"],
        cwd=REPO, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "start-up failed" in proc.stderr and "failed to start" in proc.stderr, proc.stderr[-3000:]
