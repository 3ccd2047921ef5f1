"""The Triton attention backend on a CPU machine, through Triton's interpreter (TRITON_INTERPRET=1).

benchmark/gpu_check.py --quick compares the triton backend's decode (split-K and single-chunk,
longest-first program order, mixed lengths, GQA/MHA, page_size 1 and 16) and extend-over-a-cached-
prefix kernels with the torch backend on random paged inputs, and drives a tiny random Qwen3
Engine with the triton backend against HF generate (float32, token-exact). The interpreter must be
on before triton is first imported, so it runs in a subprocess; float32 only (the interpreter's
bf16 tl.dot is broken). On the H200 the same script runs the bf16 cases and CUDA graphs.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

ROOT = Path(__file__).resolve().parents[1]


def test_triton_attention_backend_in_interpreter() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmark" / "gpu_check.py"), "--parts", "kernels,engine", "--quick", "--out", ""],
        env=env, capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    print(proc.stdout[-6000:])
    assert proc.returncode == 0, f"attention checks failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-4000:]}"
    assert "kernels: 12/12 ok" in proc.stdout and "errors: 0" in proc.stdout, proc.stdout[-3000:]
    assert proc.stdout.count("== HF fp32: True") == 4, proc.stdout[-3000:]
