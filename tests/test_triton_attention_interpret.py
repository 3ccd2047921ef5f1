"""The Triton attention backend on a CPU machine, through Triton's interpreter (TRITON_INTERPRET=1).

tests/kernel_checks/attention.py compares the triton backend's decode (split-K and single-chunk,
longest-first program order, mixed lengths, GQA/MHA, page_size 1 and 16) and extend-over-a-cached-
prefix kernels with the torch backend on random paged inputs, and drives a tiny random Qwen3
Engine with the triton backend against HF generate (float32, token-exact). The interpreter must be
on before triton is first imported, so it runs in a subprocess; float32 only (the interpreter's
bf16 tl.dot is broken). On CUDA, tests/test_attention_cuda.py runs the bf16 cases and CUDA graphs.
"""

from __future__ import annotations

import importlib.util

import pytest
from kernel_checks import run_module

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


def test_triton_attention_backend_in_interpreter() -> None:
    proc = run_module("attention", "kernels", "engine")
    print(proc.stdout[-6000:])
    assert proc.returncode == 0, f"attention checks failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-4000:]}"
    assert "kernels: 12/12 ok" in proc.stdout and "errors: 0" in proc.stdout, proc.stdout[-3000:]
    assert proc.stdout.count("== HF fp32: True") == 4, proc.stdout[-3000:]


def test_extend_tiles_in_interpreter() -> None:
    """The extend kernel's long-chunk tile (128 query rows) and both block orders, against a
    torch reference (causal over a cached prefix, scattered slots, NaN-poisoned output)."""
    proc = run_module("attention", "tiles")
    assert proc.returncode == 0 and "tiles ok" in proc.stdout, proc.stderr[-4000:]


def test_fp8_kv_kernels_in_interpreter() -> None:
    """The fp8_e4m3 pool through the triton kernels: stored bytes == the pool's reference store,
    decode (split and direct) and extend over fp8 keys/values against a float32 reference."""
    proc = run_module("attention", "fp8")
    assert proc.returncode == 0 and "fp8 ok" in proc.stdout, proc.stderr[-4000:]
