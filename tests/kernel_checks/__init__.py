"""Kernel checks as real modules: run under Triton's interpreter by the CPU tests (TRITON_INTERPRET
must be set before triton is first imported, hence a subprocess per check), and imported by the
CUDA tests, which run the same checks on the GPU at real shapes.

The checks are long (tens of seconds each, one core) and independent of everything else, so the
session starts the ones its selected tests will ask for (`prefetch`, from conftest.py) in one
background thread, one at a time: they use the second core while the suite's other tests run.
`run_module` returns a prefetched check's result (waiting for it if it is still running) or runs
it now. Either way the test sees the same CompletedProcess: only when it ran differs."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

TESTS = Path(__file__).resolve().parents[1]

Key = Tuple[str, Tuple[str, ...], bool]  # (module, args, interpret)
_PREFETCHED: Dict[Key, "Future[subprocess.CompletedProcess]"] = {}
_LOCK = threading.Lock()


def _run(key: Key, timeout: float) -> subprocess.CompletedProcess:
    module, args, interpret = key
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS.parent), str(TESTS)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    cmd = [sys.executable, "-m", f"kernel_checks.{module}", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=TESTS)


def run_module(module: str, *args: str, interpret: bool = True, timeout: float = 600) -> subprocess.CompletedProcess:
    """`python -m kernel_checks.<module> args` from tests/, the repo root on the path; under Triton's
    interpreter unless interpret is False (then TRITON_INTERPRET is removed: a compile-only check)."""
    key: Key = (module, tuple(args), interpret)
    with _LOCK:
        fut = _PREFETCHED.pop(key, None)
    if fut is not None:
        return fut.result(timeout=timeout * 2)  # queued behind the other prefetched checks at most
    return _run(key, timeout)


def prefetch(keys: Sequence[Key], timeout: float = 600) -> None:
    """Start `keys` in a background thread, one after another (run_module collects them)."""
    todo: "queue.Queue[Tuple[Key, Future]]" = queue.Queue()
    with _LOCK:
        for key in keys:
            if key not in _PREFETCHED:
                _PREFETCHED[key] = fut = Future()
                todo.put((key, fut))

    def worker() -> None:
        while not todo.empty():
            key, fut = todo.get()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(_run(key, timeout))
            except BaseException as exc:  # the test that asks for it reports it
                fut.set_exception(exc)

    threading.Thread(target=worker, name="kernel-checks", daemon=True).start()


# The subprocess checks of each CPU test module (what conftest.py prefetches when the module's
# tests are selected); the test files call run_module with exactly these arguments.
CHECKS: Dict[str, List[Key]] = {
    "test_triton_attention_interpret.py": [("attention", ("kernels", "engine"), True), ("attention", ("tiles",), True),
                                           ("attention", ("fp8",), True)],
    "test_triton_sampling_interpret.py": [("sampling", (), True), ("sm90", ("sampling",), False)],
    "test_deterministic.py": [("deterministic", (), True)],
    "test_gemma.py": [("gemma", (), True)],
    "test_gpt_oss.py": [("gpt_oss", (), True)],
    "test_deepseek.py": [("mla", (), True), ("sm90", ("mla",), False)],
    "test_triton_kernels_interpret.py": [("ops", (), True), ("sm90", ("ops",), False)],
    "test_triton_gemv_interpret.py": [("gemv", (), True), ("sm90", ("gemv",), False)],
    "test_fp8_kernels_interpret.py": [("fp8", (), True), ("sm90", ("fp8",), False)],
    "test_int4_kernels_interpret.py": [("int4", (), True), ("sm90", ("int4",), False)],
}  # fmt: skip
