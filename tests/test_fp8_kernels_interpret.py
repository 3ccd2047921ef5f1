"""The FP8 linear kernels (minisgl/kernel/triton_fp8.py) on a CPU machine, through Triton's
interpreter (tests/kernel_checks/fp8.py, in a subprocess: TRITON_INTERPRET must be set before
triton is imported; float8_e4m3fn conversions patched to round like the GPU): the per-token-group
activation quantizer and the block-scaled GEMM (128 x 128 weight blocks and per-row scales) against
a dequantize-then-matmul oracle in float32, at decode and prefill row counts. Skipped when triton
is not installed; tests/test_fp8_cuda.py runs the same checks on the GPU at real shapes."""

from __future__ import annotations

import importlib.util

import pytest
from kernel_checks import run_module

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


def test_fp8_kernels_in_interpreter() -> None:
    proc = run_module("fp8", timeout=300)
    print(proc.stdout)
    assert proc.returncode == 0, f"fp8 checks failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"


def test_fp8_kernels_compile_for_sm90() -> None:
    """Every tile the GEMM picks, compiled for sm_90 (tests/kernel_checks/sm90.py fp8): FP8 wgmma
    (below 64 rows exact e4m3 -> fp16 mma.sync), shared memory within the H200's, no spills."""
    proc = run_module("sm90", "fp8", interpret=False, timeout=300)
    print(proc.stdout)
    assert proc.returncode == 0, f"sm_90 compilation failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-4000:]}"
