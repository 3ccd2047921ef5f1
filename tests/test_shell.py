"""`python -m minisgl --shell`: driven through piped input and through a pseudo-terminal."""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
import time
from typing import List

import pytest
from server_helpers import REPO

ARGS = ("--dtype", "float32", "--max-seq-len", "256", "--num-pages", "2048", "--log-level", "warning")
MAX_TOKENS = 12


def _reference(model: str, conversations: List[List[dict]]) -> List[str]:
    from minisgl.core import SamplingParams
    from minisgl.llm import LLM

    llm = LLM(model, dtype="float32", max_seq_len_override=256, num_page_override=2048)
    try:
        return [r.text for r in llm.generate(conversations, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))]
    finally:
        llm.shutdown()


def _answers(stdout: str) -> dict:
    """Map each '> input' line of the transcript to the text printed after it."""
    parts = re.split(r"^> (.*)$", stdout, flags=re.M)
    return {"banner": parts[0], "turns": [(parts[i], parts[i + 1].strip("\n")) for i in range(1, len(parts) - 1, 2)]}


def test_shell_piped_input(tiny_chat_model: str) -> None:
    cmd = [sys.executable, "-m", "minisgl", "--shell", "--model", tiny_chat_model, "--shell-max-tokens", str(MAX_TOKENS), *ARGS]
    script = "Hello there\nWhat next?\n/reset\nHello there\n/bogus\n/exit\nnever read\n"
    proc = subprocess.Popen(cmd, cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    q1 = [{"role": "user", "content": "Hello there"}]
    try:
        a1 = _reference(tiny_chat_model, [q1])[0]  # computed while the shell starts
        q2 = q1 + [{"role": "assistant", "content": a1}, {"role": "user", "content": "What next?"}]
        a2 = _reference(tiny_chat_model, [q2])[0]
        out, err = proc.communicate(script, timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    t = _answers(out)
    assert "minisgl shell" in t["banner"]
    turns = t["turns"]
    assert [q for q, _ in turns] == ["Hello there", "What next?", "/reset", "Hello there", "/bogus", "/exit"], out
    assert turns[0][1] == a1  # the answer streamed in full
    assert turns[1][1] == a2  # ... with the conversation so far as context
    assert turns[2][1] == "(conversation reset)"
    assert turns[3][1] == a1  # after /reset the history is gone: the same question, the same answer
    assert "unknown command" in turns[4][1]


def _read_until(fd: int, pattern: str, timeout: float, buf: List[str]) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = "".join(buf)
        if re.search(pattern, text):
            return text
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
            try:
                data = os.read(fd, 4096)
            except OSError:
                break
            buf.append(data.decode("utf-8", errors="replace"))
    raise AssertionError(f"{pattern!r} not seen within {timeout} s; output so far:\n{''.join(buf)[-2000:]}")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pseudo-terminal test uses Linux ptys")
def test_shell_in_a_terminal(tiny_chat_model: str) -> None:
    import pty

    master, slave = pty.openpty()
    cmd = [sys.executable, "-m", "minisgl", "--shell", "--model", tiny_chat_model, "--shell-max-tokens", "400", *ARGS]
    env = dict(os.environ, PROMPT_TOOLKIT_NO_CPR="1", TERM="xterm")

    def make_controlling_terminal() -> None:  # so that Ctrl-C on the terminal sends SIGINT
        import fcntl
        import termios

        os.setsid()
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    proc = subprocess.Popen(cmd, cwd=REPO, stdin=slave, stdout=slave, stderr=slave, env=env, preexec_fn=make_controlling_terminal)
    os.close(slave)
    buf: List[str] = []
    try:
        _read_until(master, r"minisgl shell.*\n(.|\n)*>", 240, buf)
        os.write(master, b"Hello there\r")
        n = len("".join(buf))
        _read_until(master, r"Hello there(.|\n)*\w+ \w+ \w+", 60, buf)  # the answer is streaming
        os.write(master, b"\x03")  # Ctrl-C stops this answer, not the shell
        _read_until(master, r"\[stopped\]", 30, buf)
        os.write(master, b"/reset\r")
        _read_until(master, r"conversation reset", 30, buf)
        os.write(master, b"/exit\r")
        assert proc.wait(30) == 0
        assert n > 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        os.close(master)
