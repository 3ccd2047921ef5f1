"""`python -m minisgl --tp 2` on CPU (gloo, float32): the OpenAI client gets the same greedy
answers as from `--tp 1`, streaming and not; SIGTERM stops every rank; a rank killed with SIGKILL
ends the server with status 1 and a message naming the rank; two launchers
(`--nnodes 2 --node-rank 0/1 --dist-init-addr 127.0.0.1:PORT`) serve together and stop together.

The model is test_server's tiny random Llama with the embedded model's tokenizer (4 query heads,
2 KV heads: one of each per rank)."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from typing import Any, Dict, List

import httpx
import pytest
from helpers import TEST_DEVICE
from server_helpers import ServerProcess, free_port, pids_alive

if TEST_DEVICE.startswith("cuda"):
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("--tp 2 on CUDA needs two GPUs", allow_module_level=True)

EXTRA = ("--dtype", "float32", "--device", TEST_DEVICE, "--max-seq-len", "256", "--num-pages", "2048")
PROMPTS = ["The quick brown fox", "Once upon a time, in a land far away,", "1, 2, 3, 4,"]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
N_NEW = 16
MODEL = "tiny_chat_llama"  # the folder name the tiny model is served under


@pytest.fixture(scope="module")
def servers(tiny_chat_model: str, chat_server: ServerProcess, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """tp1 (the session's chat server, conftest: float32 like these), tp2 (compared, then
    SIGTERMed) and tp2 (a rank SIGKILLed), the last two started together."""
    logs = tmp_path_factory.mktemp("server_tp")
    own = {
        "tp2": ServerProcess(tiny_chat_model, *EXTRA, "--tp", "2", log_path=logs / "tp2.log"),
        "tp2_kill": ServerProcess(tiny_chat_model, *EXTRA, "--tp", "2", log_path=logs / "tp2_kill.log"),
        # node 0 of two whose node 1 never comes (test_node_that_never_joins_times_out reads how
        # it ended). Every launcher of the module starts here, so that their start-ups overlap.
        **_node_pair(tiny_chat_model, logs, "pair"),  # test_two_nodes_serve_and_stop_together's
        **_node_pair(tiny_chat_model, logs, "dead"),  # test_dead_rank_on_another_node_stops_node_0's
        "lonely": ServerProcess(
            tiny_chat_model, *EXTRA, "--tp", "2", "--nnodes", "2", "--node-rank", "0", "--dist-init-addr",
            f"127.0.0.1:{free_port()}", "--dist-timeout", "3", log_path=logs / "lonely.log",
        ),
    }  # fmt: skip
    try:
        for name in ("tp2", "tp2_kill"):
            own[name].wait_ready()
        yield {"tp1": chat_server, **own}
    finally:
        for s in own.values():
            s.stop()


def _node_pair(model: str, logs: Any, name: str) -> Dict[str, ServerProcess]:
    """Two launchers, `--nnodes 2`, one TP rank each, on a rendezvous address of their own."""
    common = (*EXTRA, "--tp", "2", "--nnodes", "2", "--dist-init-addr", f"127.0.0.1:{free_port()}")
    return {
        f"{name}1": ServerProcess(model, *common, "--node-rank", "1", log_path=logs / f"{name}_node1.log"),
        f"{name}0": ServerProcess(model, *common, "--node-rank", "0", log_path=logs / f"{name}_node0.log"),
    }


def _answers(srv: ServerProcess) -> Dict[str, Any]:
    client = srv.openai()
    out: Dict[str, Any] = {}
    for i, p in enumerate(PROMPTS):
        r = client.completions.create(model=MODEL, prompt=p, max_tokens=N_NEW, temperature=0)
        out[f"completion {i}"] = (r.choices[0].text, r.usage.completion_tokens)
        stream = client.completions.create(model=MODEL, prompt=p, max_tokens=N_NEW, temperature=0, stream=True)
        out[f"completion stream {i}"] = "".join(c.choices[0].text for c in stream if c.choices)
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=N_NEW, temperature=0)
    out["chat"] = r.choices[0].message.content
    stream = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=N_NEW, temperature=0, stream=True)
    out["chat stream"] = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    # n > 1: several requests batched together on both ranks
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=N_NEW, temperature=0, n=3)
    out["n=3"] = [c.text for c in r.choices]
    return out


def test_tp2_answers_like_tp1(servers: Dict[str, ServerProcess]) -> None:
    ref, got = _answers(servers["tp1"]), _answers(servers["tp2"])
    assert got == ref
    assert ref["completion 0"][1] == N_NEW and ref["completion 0"][0]
    log = servers["tp2"].log()
    assert "scheduler rank 1 pid" in log  # the banner lists both ranks
    # sampling works at tp=2 too (rank 0's draw is broadcast; the ranks would diverge otherwise)
    client = servers["tp2"].openai()
    r = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=N_NEW, temperature=1.0, n=4)
    assert all(c.text for c in r.choices)
    assert _answers(servers["tp2"]) == ref  # and the greedy answers are unchanged afterwards


def test_sigterm_stops_every_rank(servers: Dict[str, ServerProcess]) -> None:
    srv = servers["tp2"]
    pids = srv.tree_pids()
    assert len(pids) >= 4, pids  # API server, 2 scheduler ranks, tokenizer (+ resource tracker)
    start = time.monotonic()
    srv.proc.send_signal(signal.SIGTERM)
    rc = srv.proc.wait(20)  # the bound: a rank left waiting in a collective would hang for good
    assert rc == 0, (time.monotonic() - start, srv.log()[-3000:])
    assert _wait_gone(pids) == [], f"processes left behind: {pids_alive(pids)}"


def test_sigkill_of_a_rank_stops_the_server(servers: Dict[str, ServerProcess]) -> None:
    srv = servers["tp2_kill"]
    pids = srv.tree_pids()
    rank1 = _child_named(srv, "minisgl-sched1")
    results: Dict[str, Any] = {}

    def request() -> None:
        body = {"prompt": "Go on and on", "max_tokens": 20, "ignore_eos": True, "temperature": 0, "n": 4}
        try:
            results["resp"] = httpx.post(srv.base_url + "/v1/completions", json=body, timeout=60)
        except httpx.HTTPError as exc:
            results["error"] = exc

    # Rank 1 is frozen (SIGSTOP) before the request is sent: rank 0 then waits on it in the first
    # collective, so the request is still running when the SIGKILL lands on any machine.
    os.kill(rank1, signal.SIGSTOP)
    t = threading.Thread(target=request)
    t.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and srv.metrics().get("minisgl_http_requests_in_flight", 0) == 0:
        time.sleep(0.05)
    assert "resp" not in results, results
    start = time.monotonic()
    os.kill(rank1, signal.SIGKILL)
    rc = srv.proc.wait(20)
    elapsed = time.monotonic() - start
    t.join(30)
    log = srv.log()
    assert rc == 1, (elapsed, log[-3000:])  # wait(20) is the bound
    assert f"the scheduler rank 1 process (pid {rank1}) was killed by SIGKILL" in log, log[-3000:]
    assert _wait_gone(pids) == [], f"processes left behind: {pids_alive(pids)}"
    assert "resp" in results and results["resp"].status_code in (500, 503), results


def test_two_nodes_serve_and_stop_together(servers: Dict[str, ServerProcess]) -> None:
    node0, node1 = servers["pair0"], servers["pair1"]
    try:
        node0.wait_ready()
        client = node0.openai()
        ref = servers["tp1"].openai()
        for p in PROMPTS[:2]:
            a = client.completions.create(model=MODEL, prompt=p, max_tokens=N_NEW, temperature=0).choices[0].text
            b = ref.completions.create(model=MODEL, prompt=p, max_tokens=N_NEW, temperature=0).choices[0].text
            assert a == b
        assert node1.proc.poll() is None
        assert "node 1 of 2: TP ranks [1] ready" in node1.log()
        pids = node0.tree_pids() + node1.tree_pids()
        node0.proc.send_signal(signal.SIGTERM)
        assert node0.proc.wait(20) == 0, node0.log()[-3000:]
        assert node1.proc.wait(20) == 0, node1.log()[-3000:]  # rank 0 told rank 1 to exit
        assert _wait_gone(pids) == [], f"processes left behind: {pids_alive(pids)}"
    finally:
        node0.stop()
        node1.stop()


def test_bad_tp_layouts_are_refused() -> None:
    from server_helpers import REPO

    for argv, message in (
        (["--tp", "3", "--nnodes", "2", "--dist-init-addr", "127.0.0.1:1"], "not divisible by --nnodes"),
        (["--tp", "2", "--nnodes", "2"], "needs --dist-init-addr"),
        (["--tp", "2", "--nnodes", "2", "--node-rank", "2", "--dist-init-addr", "h:1"], "outside [0, --nnodes 2)"),
        (["--tp", "2", "--dist-init-addr", "nohost"], "HOST:PORT"),
    ):
        proc = subprocess.run([os.sys.executable, "-m", "minisgl", *argv], cwd=REPO, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2, (argv, proc.stderr[-2000:])
        assert message in proc.stderr + proc.stdout, (argv, proc.stderr[-2000:])


def _wait_gone(pids: List[int], timeout: float = 10.0) -> List[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and pids_alive(pids):
        time.sleep(0.1)
    return pids_alive(pids)


def _child_named(srv: ServerProcess, name: str) -> int:
    import psutil

    for child in psutil.Process(srv.proc.pid).children(recursive=True):
        if child.name() == name:
            return child.pid
    raise AssertionError(f"no child process named {name}")


def test_dead_rank_on_another_node_stops_node_0(servers: Dict[str, ServerProcess]) -> None:
    node0, node1 = servers["dead0"], servers["dead1"]
    try:
        node0.wait_ready()
        rank1 = _child_named(node1, "minisgl-sched1")
        os.kill(rank1, signal.SIGKILL)
        assert node1.proc.wait(20) == 1, node1.log()[-3000:]
        assert f"the scheduler rank 1 process (pid {rank1}) was killed by SIGKILL" in node1.log()
        assert node0.proc.wait(20) == 1, node0.log()[-3000:]  # idle: rank 0's heartbeat finds it within the bound
        assert "lost contact with the other ranks" in node0.log()
    finally:
        node0.stop()
        node1.stop()


def test_node_that_never_joins_times_out(servers: Dict[str, ServerProcess]) -> None:
    node0 = servers["lonely"]
    rc = node0.proc.wait(120)
    log = node0.log()
    assert rc == 1, log[-3000:]
    assert "did not all join" in log and "distributed_timeout=3" in log, log[-3000:]
