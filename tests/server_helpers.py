"""What every server test uses: a `python -m minisgl` subprocess on a free loopback port, its
metrics, and the tiny chat model (a random Llama with the embedded SmolLM2's tokenizer and chat
template, so prompts, templates and detokenization are real while a forward costs milliseconds)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Dict, Iterator, List

import httpx

REPO = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 240.0  # the CI machine has 2 cores; other jobs may share them
API_KEY = "test-key-123"
MAX_SEQ_LEN = 512


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_tiny_chat_model(out_dir: Path, tokenizer_dir: str, max_position: int = 1024) -> Path:
    """A tiny random Llama with the embedded model's tokenizer and chat template."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if (out_dir / "config.json").exists() and (out_dir / "tokenizer.json").exists():
        return out_dir
    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    torch.manual_seed(1234)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_position,
        initializer_range=0.2,  # varied, prompt-dependent greedy outputs (the default repeats itself)
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    LlamaForCausalLM(config).eval().save_pretrained(tmp)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        src = Path(tokenizer_dir) / name
        if src.exists():
            shutil.copy(src, tmp / name)
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return out_dir


class ServerProcess:
    """`python -m minisgl ...` as a subprocess (its own session, log in a file)."""

    def __init__(self, model: str | None, *extra: str, log_path: Path, api_key: str | None = None) -> None:
        self.api_key = api_key
        self._args = [*extra] + (["--model", model] if model is not None else []) + (["--api-key", api_key] if api_key is not None else [])
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self._port_retries = 2
        self._env = dict(os.environ, PYTHONUNBUFFERED="1")  # as now: a restart runs with it too
        self._env.pop("MINISGL_API_KEY", None)
        self._start()

    def _start(self) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "minisgl", "--port", str(self.port), "--log-level", "info", *self._args]
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT, env=self._env, start_new_session=True)

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> "ServerProcess":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                # The port was free when picked, but another process may take it before the
                # server binds it (seconds of Python start-up on a shared machine): the server
                # then exits with status 2 and says so. Start again on a new port.
                if self.proc.returncode == 2 and "choose another --port" in self.log() and self._port_retries > 0:
                    self._port_retries -= 1
                    self._start()
                    continue
                raise RuntimeError(f"server exited with {self.proc.returncode} during start-up:\n{self.log()[-4000:]}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"server not ready after {timeout:.0f} s:\n{self.log()[-4000:]}")

    def tree_pids(self) -> List[int]:
        import psutil

        try:
            parent = psutil.Process(self.proc.pid)
            return [parent.pid] + [c.pid for c in parent.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def stop(self, timeout: float = 20.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        else:
            try:  # whatever is left of its session
                os.killpg(self.proc.pid, signal.SIGKILL)
            except OSError:
                pass
        self._log.close()
        return self.proc.returncode

    def headers(self) -> Dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def openai(self, **kw: Any) -> Any:
        import openai

        return openai.OpenAI(base_url=self.base_url + "/v1", api_key=self.api_key or "none", max_retries=0, timeout=120, **kw)

    def async_openai(self, **kw: Any) -> Any:
        import openai

        return openai.AsyncOpenAI(base_url=self.base_url + "/v1", api_key=self.api_key or "none", max_retries=0, timeout=120, **kw)

    def metrics(self) -> Dict[str, float]:
        text = httpx.get(self.base_url + "/metrics", timeout=10).text
        return parse_metrics(text)

    def wait_idle(self, timeout: float = 30.0) -> Dict[str, float]:
        """Poll /metrics until no request runs, waits or holds a page-table row."""
        deadline = time.monotonic() + timeout
        m: Dict[str, float] = {}
        while time.monotonic() < deadline:
            m = self.metrics()
            if (
                m.get("minisgl_num_running_requests") == 0
                and m.get("minisgl_num_waiting_requests") == 0
                and m.get("minisgl_scheduler_active_requests") == 0
                and m.get("minisgl_http_requests_in_flight") == 0
            ):
                return m
            time.sleep(0.1)
        raise AssertionError(f"server not idle after {timeout} s: {m}")

    def wait_metric(self, name: str, value: float, timeout: float = 30.0, poll: float = 0.1) -> Dict[str, float]:
        """Poll /metrics until `name` reaches `value` (scheduler numbers arrive asynchronously)."""
        deadline = time.monotonic() + timeout
        m: Dict[str, float] = {}
        while time.monotonic() < deadline:
            m = self.metrics()
            if m.get(name, 0.0) >= value:
                return m
            time.sleep(poll)
        raise AssertionError(f"{name} did not reach {value} after {timeout} s: {m.get(name)}")


def parse_metrics(text: str) -> Dict[str, float]:
    out: Dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, _, value = line.rpartition(" ")
        out[name] = float(value)
    return out


def pids_alive(pids: List[int]) -> List[int]:
    import psutil

    alive = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            if p.status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def assert_error_body(resp: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> Dict[str, Any]:
    assert resp.status_code == status, (resp.status_code, resp.text)
    body = resp.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


@contextmanager
def serving(model: str | None, *extra: str, log_dir: Path, api_key: str | None = None) -> Iterator[ServerProcess]:
    """A started, ready server for a fixture's lifetime (stopped however the tests end)."""
    srv = ServerProcess(model, *extra, log_path=log_dir / "server.log", api_key=api_key)
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


# The flags of the session's shared chat server (conftest `chat_server`): float32 keeps every
# step on the module path; pages and rows enough for the 48-stream test.
CHAT_SERVER_FLAGS = (
    "--dtype", "float32", "--max-seq-len", str(MAX_SEQ_LEN), "--num-pages", "16384", "--max-running-requests", "48",
)  # fmt: skip


class CannedFrontend:
    """Answers every choice with canned text, through a real RequestStream: the text in pieces of
    3 characters, or the given `pieces` (e.g. the detokenizer's, token by token); the last piece
    ends the choice with `finish_reason`."""

    failure: str | None = None
    stats = None
    metrics = None

    def __init__(self, text: str, pieces: List[str] | None = None, finish_reason: str = "stop") -> None:
        self.text = text
        self.pieces = pieces if pieces is not None else [text[i : i + 3] for i in range(0, len(text), 3)]
        self.finish_reason = finish_reason
        self.sent: List[Any] = []
        self._uid = 0

    @property
    def num_in_flight(self) -> int:
        return 0

    def new_uid(self) -> int:
        self._uid += 1
        return self._uid

    def _forget(self, stream: Any) -> None:
        pass

    def _send(self, msg: Any) -> None:
        pass

    def submit(self, msgs: List[Any], label: str = "", choices: int = 1) -> Any:
        import asyncio

        from minisgl.message import ReplyMsg
        from minisgl.server.frontend import RequestStream

        self.sent += msgs
        stream = RequestStream(self, [m.uid for m in msgs], label, choices)  # type: ignore[arg-type]
        loop = asyncio.get_running_loop()
        for uid in stream.uids:
            for j, piece in enumerate(self.pieces):
                last = j == len(self.pieces) - 1
                reply = ReplyMsg(uid, piece, 1, last, self.finish_reason if last else None, 5, j + 1, 0, None, None, [7])
                loop.call_soon(stream._deliver, uid, reply)
        return stream


def canned_app(
    text: str, *flags: str, chat_template: str = "{{ messages }}", tokenizer_description: Dict[str, Any] | None = None, **canned: Any
) -> Any:
    """(a TestClient of the API over a CannedFrontend, that frontend): the routes in-process."""
    from fastapi.testclient import TestClient

    from minisgl.server.api_server import create_app
    from minisgl.server.args import parse_args
    from minisgl.server.metrics import ServerMetrics

    args = parse_args(list(flags))
    args.model_path = "/models/x"
    frontend = CannedFrontend(text, **canned)
    info = {"max_seq_len": 512, "vocab_size": 100, "max_running_req": 4}
    tokenizer_info = {"chat_template": chat_template, "info": tokenizer_description}
    app = create_app(args, info, frontend, ServerMetrics(), tokenizer_info=tokenizer_info)  # type: ignore[arg-type]
    return TestClient(app), frontend


def sse_data(resp: Any) -> List[Any]:
    """The JSON of every `data:` line of an SSE response, [DONE] left out."""
    import json

    return [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]
