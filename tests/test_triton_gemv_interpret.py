"""The skinny-M GEMV kernels (minisgl/kernel/triton_gemv.py) on a CPU machine (the decoder
layer's ops that take them are tests/test_norm_linear.py's).

1. Through Triton's interpreter (tests/kernel_checks/gemv.py; TRITON_INTERPRET=1, in a subprocess:
   it must be on before triton is imported), against the torch code they replace: F.linear, layers/norm.py's RMSNorm with the
   residual add, layers/activation.py's SiLU-and-mul; one row (broadcast path) and several
   (tl.dot path; float32 only, the interpreter's bf16 dot is broken), K and N not multiples of
   the tiles, float32 and bfloat16.
2. Every tile `skinny.default_config` picks (Qwen3-0.6B and 14B shapes, every batch bucket)
   compiled ahead of time for sm_90 with the specialisations a launch gets: code the GPU
   compiler rejects (the interpreter accepts more), shared memory over the H200's 227 KiB, and
   register spills in the SASS fail here, without a GPU.

Skipped when triton is not installed; tools/gemv_tune.py checks and times them on a GPU.
"""

from __future__ import annotations

import importlib.util

import pytest
from kernel_checks import run_module

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


def test_gemv_kernels_in_interpreter() -> None:
    proc = run_module("gemv", timeout=300)
    print(proc.stdout)
    assert proc.returncode == 0, f"gemv checks failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"


def test_gemv_kernels_compile_for_sm90() -> None:
    proc = run_module("sm90", "gemv", interpret=False, timeout=300)
    print(proc.stdout)
    assert proc.returncode == 0, f"sm_90 compilation failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-4000:]}"
