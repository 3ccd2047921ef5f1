"""Kernel checks as real modules: run under Triton's interpreter by the CPU tests (TRITON_INTERPRET
must be set before triton is first imported, hence a subprocess per check), and imported by the
CUDA tests, which run the same checks on the GPU at real shapes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def run_module(module: str, *args: str, interpret: bool = True, timeout: float = 600) -> subprocess.CompletedProcess:
    """`python -m kernel_checks.<module> args` from tests/, the repo root on the path; under Triton's
    interpreter unless interpret is False (then TRITON_INTERPRET is removed: a compile-only check)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS.parent), str(TESTS)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    cmd = [sys.executable, "-m", f"kernel_checks.{module}", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=TESTS)
