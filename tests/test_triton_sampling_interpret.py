"""The Gumbel-max sampling kernel (minisgl/kernel/triton_sampling.py) on a CPU machine.

1. Through Triton's interpreter (tests/kernel_checks/sampling.py; TRITON_INTERPRET=1, set before
   triton is first imported, hence a subprocess; float32 -> bfloat16 made to round to nearest like the GPU): the draw frequencies
   against softmax(logits / T), greedy rows against torch.argmax (ties included), seeds (same seed
   same token, whatever the batch and the launch split), -inf entries, dtypes and row strides, and
   the sampler's CUDA path (use_fused forced on): a seeded row draws the same token whether or not
   its neighbours filter.
2. Compiled ahead of time for sm_90, so errors only the GPU compiler raises show up without a GPU.

Skipped when triton is not installed; tests/test_sampling_cuda.py checks it on a GPU.
"""

from __future__ import annotations

import importlib.util

import pytest
from kernel_checks import run_module

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


def test_gumbel_sampling_in_interpreter() -> None:
    proc = run_module("sampling", timeout=300)
    print(proc.stdout)
    assert proc.returncode == 0, f"sampling checks failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"


def test_gumbel_kernels_compile_for_sm90() -> None:
    proc = run_module("sm90", "sampling", interpret=False, timeout=300)
    print(proc.stdout)
    assert proc.returncode == 0, f"sm_90 compilation failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-4000:]}"
