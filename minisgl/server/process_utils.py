"""Helpers for the server's child processes: signals, parent-death handling, ZeroMQ addresses.

Children ignore SIGINT (Ctrl-C reaches the whole foreground process group; the parent decides
how to shut down and terminates them), die with their parent (PR_SET_PDEATHSIG on Linux, plus a
`parent_alive()` check in every idle loop elsewhere), and exit on SIGTERM.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import sys
import traceback
from dataclasses import dataclass
from typing import Any, NoReturn

_PR_SET_NAME = 15
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class IpcAddrs:
    """ipc:// endpoints in a private temporary folder. Each PULL socket binds its own address."""

    tokenizer: str  # the tokenizer worker's PULL (from the API server and from the scheduler)
    scheduler: str  # the scheduler's PULL (from the tokenizer worker)
    api: str  # the API server's PULL (from the tokenizer worker)

    @classmethod
    def in_dir(cls, folder: str) -> "IpcAddrs":
        return cls(
            tokenizer=f"ipc://{os.path.join(folder, 'tokenizer')}",
            scheduler=f"ipc://{os.path.join(folder, 'scheduler')}",
            api=f"ipc://{os.path.join(folder, 'api')}",
        )


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on now (for the TP rendezvous on one machine)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def setup_child_process(name: str, log_level: str) -> int:
    """Call first thing in a child. Returns the parent's pid (for `parent_alive`)."""
    parent = os.getppid()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    libc = _libc()
    if libc is not None:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)
    configure_logging(log_level)
    return parent


def fail_startup(ready_conn: Any, what: str, exc: BaseException) -> NoReturn:
    """Log why a child could not start, tell the parent (which reports it), and exit 1."""
    logging.getLogger("minisgl").error("%s failed to start:\n%s", what, traceback.format_exc())
    try:
        ready_conn.send(("error", f"{type(exc).__name__}: {exc}"))
    except OSError:
        pass
    raise SystemExit(1)


QUEUE_HWM = 100_000  # messages a worker's outgoing queue holds before its sends wait (backpressure)


def push_socket(ctx: Any, addr: str) -> Any:
    """A PUSH socket connected to `addr`. Its queue is bounded: when the receiver falls that far
    behind, sends block (push back on the sender) instead of growing memory without bound."""
    import zmq

    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, QUEUE_HWM)
    sock.connect(addr)
    return sock


def _exit_on_sigterm(signum: int, frame: object) -> None:
    # Leave at once: a worker keeps nothing worth flushing (its ipc sockets live in a folder the
    # parent removes), and interpreter teardown with torch loaded takes seconds.
    os._exit(0)


def parent_alive(parent_pid: int) -> bool:
    return os.getppid() == parent_pid


def configure_logging(level: str) -> None:
    from minisgl.utils.logger import set_log_level

    set_log_level(level)
    logging.getLogger().setLevel(logging.WARNING if level.lower() == "debug" else level.upper())


def describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "is still running"
    if exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with code {exitcode}"
