"""The FP8 linear kernels (minisgl/kernel/triton_fp8.py) against a dequantize-then-matmul oracle in
float32: `TRITON_INTERPRET=1 python -m kernel_checks.fp8` (from tests/, the repo root on PYTHONPATH;
tests/test_fp8_kernels_interpret.py runs it; tests/test_fp8_cuda.py calls `run_checks` on the GPU at
real shapes).

- the activation quantizer: scales equal absmax / 448 per (row, 128 columns), codes equal torch's
  own rounding of x / scale (saturated) to e4m3 (at most one e4m3 step where the GPU's division
  rounds differently), an all-zero group gives zeros;
- the GEMM: y equals (x_q * x_s) @ (w_q * w_s)^T evaluated in float32 from the kernel's own x_q and
  x_s, for 128 x 128 weight blocks (N not a multiple of the tile or of 128) and per-row scales
  (one scale column broadcast over K), with and without bias, float32 and bfloat16 output;
- `fp8_linear` end to end against the same oracle on a 3-D input, and (CPU) the op's torch
  implementation in layers/fp8.py (what tests/test_fp8_weights.py runs) against the kernels.
"""

from __future__ import annotations

import sys
from typing import Iterable, List, Tuple

import torch

Shape = Tuple[int, int, int]  # (M, N, K)
INTERPRETER_SHAPES: List[Shape] = [(1, 160, 256), (5, 96, 128), (33, 200, 384), (130, 136, 128)]  # (130: 3 x 2 grouped tiles)


def dequant(q: torch.Tensor, s: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """q.float() * s expanded over (rows x cols) blocks (cols = the full width for one column)."""
    n, k = q.shape
    cols = k if s.shape[1] == 1 else cols
    return q.float() * s.float().repeat_interleave(rows, 0)[:n].repeat_interleave(cols, 1)[:, :k]


def quantize_weight(w: torch.Tensor, block_n: int, per_row: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """(w_q, w_s): absmax / 448 per (block_n x 128) block, or per row (block_n == 1, one column)."""
    n, k = w.shape
    if per_row:
        s = w.abs().amax(1, keepdim=True).clamp(min=1e-10) / 448.0
    else:
        pad = -n % block_n
        wp = torch.nn.functional.pad(w, (0, 0, 0, pad))
        s = wp.reshape(-1, block_n, k // 128, 128).abs().amax(dim=(1, 3)).clamp(min=1e-10) / 448.0
    q = (w / s.repeat_interleave(block_n, 0)[:n].repeat_interleave(k if per_row else 128, 1)).clamp(-448, 448)
    return q.to(torch.float8_e4m3fn), s.float()


def run_checks(shapes: Iterable[Shape], device: str, seed: int = 0, sum_rtol: float = 1e-6) -> List[str]:
    """Failures (empty: all passed); each comparison printed. GEMM results are held to
    `sum_rtol` x max |ref| (+ the output dtype's rounding): the summation order differs from the
    oracle's (and the GPU's FP8 tensor cores sum each 128-wide dot in fewer than 32 bits)."""
    from minisgl.kernel import triton_fp8 as F8

    gen = torch.Generator(device=device).manual_seed(seed)
    failures: List[str] = []

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device)

    def check(name: str, got: torch.Tensor, ref: torch.Tensor, atol: float, rtol: float) -> None:
        err = (got.float() - ref).abs()
        if atol < 0:  # a sum: relative to the output's scale
            atol = -atol * float(ref.abs().max())
        bound = atol + rtol * ref.abs()
        ok = bool((err <= bound).all())
        print(f"{'ok  ' if ok else 'FAIL'} {name}: max |diff| {err.max().item():.3g}, max |ref| {ref.abs().max().item():.3g}")
        if not ok:
            failures.append(name)

    for m, n, k in shapes:
        x = randn(m, k) * torch.rand(m, 1, generator=gen, device=device) * 4
        x[0, :128] = 0.0  # an all-zero group
        x_q, x_s = F8.quantize_groups(x)
        want_s = (x.abs().reshape(m, -1, 128).amax(-1).clamp(min=F8._EPS) / F8.FP8_MAX).float()
        check(f"quant scales M={m} K={k}", x_s, want_s, 0.0, 1e-6)
        want_q = (x / want_s.repeat_interleave(128, 1)).clamp(-448, 448).to(torch.float8_e4m3fn).float()
        # one e4m3 step (2^-3 relative, 2^-9 among subnormals) where x / s rounds differently on the GPU
        check(f"quant codes M={m} K={k}", x_q.float(), want_q, 2.0**-9, 2.0**-3)
        assert bool((x_q[0, :128].float() == 0).all()), "an all-zero group must quantize to zeros"
        xd = dequant(x_q, x_s, 1, 128)
        for per_row in (False, True):
            block_n = 1 if per_row else 128
            w = randn(n, k) * 0.05
            w_q, w_s = quantize_weight(w, block_n, per_row)
            ref = xd @ dequant(w_q, w_s, block_n, 128).t()
            bias = randn(n)
            what = "per-row" if per_row else "128x128 blocks"
            y32 = F8.fp8_gemm(x_q, x_s, w_q, w_s, block_n, torch.float32)
            check(f"gemm {what} M={m} N={n} K={k} fp32", y32, ref, -sum_rtol, 1e-5)
            yb = F8.fp8_gemm(x_q, x_s, w_q, w_s, block_n, torch.bfloat16, bias.bfloat16())
            check(f"gemm {what} M={m} N={n} K={k} bf16 + bias", yb, ref + bias.bfloat16().float(), -sum_rtol, 2.0**-8)
            x3 = x.reshape(1, m, k)
            y3 = F8.fp8_linear(x3, w_q, w_s, block_n)
            check(f"fp8_linear {what} M={m} N={n} K={k}", y3.reshape(m, n), ref, -sum_rtol, 1e-5)
            if device == "cpu":  # the op's torch implementation (layers/fp8.py), which the CPU tests run
                from minisgl.layers.fp8 import fp8_linear as torch_op

                check(f"torch op {what} M={m} N={n} K={k}", torch_op(x3, w_q, w_s, block_n).reshape(m, n), y3.reshape(m, n).float(),
                      -sum_rtol, 1e-5)  # fmt: skip
    return failures


def main() -> int:
    import os

    assert os.environ.get("TRITON_INTERPRET") == "1"
    from minisgl.kernel.interpreter import patch_interpreter

    patch_interpreter()  # float8_e4m3fn conversions as on the GPU
    failures = run_checks(INTERPRETER_SHAPES, "cpu")
    print("FAILED: " + ", ".join(failures) if failures else "all fp8 kernel checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
