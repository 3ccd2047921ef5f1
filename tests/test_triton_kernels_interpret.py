"""The Triton kernels (minisgl/kernel/triton_ops.py, minisgl/moe/triton_moe.py) on a CPU machine.

1. Against their torch references through Triton's interpreter (TRITON_INTERPRET=1,
   tests/kernel_checks/ops.py). The interpreter must be switched on before triton is first
   imported, so the checks run in a subprocess; it is made to round float32 -> bfloat16 to nearest like the GPU (it truncates).
2. Compiled ahead of time for an H100/H200 (sm_90) with the specialisations a launch would get
   (unit strides constant, 16-byte aligned pointers): the interpreter runs numpy, so it accepts
   code the GPU compiler rejects (a scalar where a tensor is needed, for one); this catches that
   without a GPU (tests/kernel_checks/sm90.py). The MoE GEMM must also be software-pipelined
   (async copies) at decode tiles.

Skipped when triton is not installed (CI does not install it); on a CUDA machine
tests/test_triton_ops_cuda.py runs the comparisons on the GPU at real shapes.
"""

from __future__ import annotations

import importlib.util

import pytest
from kernel_checks import run_module

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


def test_triton_kernels_in_interpreter() -> None:
    proc = run_module("ops", timeout=300)
    print(proc.stdout)
    assert proc.returncode == 0, f"ops checks failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"


def test_triton_kernels_compile_for_sm90() -> None:
    proc = run_module("sm90", "ops", interpret=False, timeout=300)
    print(proc.stdout)
    assert proc.returncode == 0, f"sm_90 compilation failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-4000:]}"
