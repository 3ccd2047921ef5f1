"""The W4A16 int4 GEMM (minisgl/kernel/triton_int4.py) against a dequantize-then-matmul oracle in
float32: `TRITON_INTERPRET=1 python -m kernel_checks.int4` (from tests/, the repo root on
PYTHONPATH; tests/test_int4_kernels_interpret.py runs it; tests/test_int4_cuda.py calls
`run_checks` on the GPU at real shapes).

For groups of 32, 64 and 128, symmetric (zero 8) and asymmetric codes, float32 activations
(an IEEE float32 dot: held to the oracle's own summation error) and bfloat16 ones with a bias
(the kernel rounds each dequantized weight to bf16 for the tensor-core dot: held to the oracle on
those rounded weights, and loosely to the exact one), at decode row counts (16-row tiles, K split
over 1, 2 and 4 CTAs with the float32 reduce) and prefill ones (64 x 64, 64 x 128 and 128 x 128
tiles, N and M not multiples of the tile); `w4a16_linear` on a 3-D input; and (CPU) the op's torch
implementation in layers/int4.py (what the CPU end-to-end tests run) against the kernel.
"""

from __future__ import annotations

import sys
from typing import Iterable, List, Tuple

import torch

Shape = Tuple[int, int, int]  # (M, N, K)
# (M, N, K, group): decode with K split over 2, 1, 1 and 4 CTAs (16-row tiles), then 64 x 64 tiles,
# 64 x 128 ones in 3 x 2 grouped tiles, 128 x 128 ones; every group, symmetric and asymmetric
INTERPRETER_CASES: List[Tuple[int, int, int, int]] = [(1, 96, 256, 32), (1, 96, 256, 128), (16, 64, 384, 64), (3, 160, 512, 32),
                                                      (40, 72, 256, 128), (130, 136, 128, 64), (300, 48, 128, 32)]  # fmt: skip


def make_weight(n: int, k: int, group: int, sym: bool, gen: torch.Generator, device: str):  # -> Int4Packed (float32 scales)
    """A random int4 weight: codes, and per-group scales and zeros (zero 8 where symmetric, else 0..16)."""
    from minisgl.layers.int4 import Int4Packed, pack_codes

    codes = torch.randint(0, 16, (n, k), generator=gen, device=device)
    scale = torch.rand(n, k // group, generator=gen, device=device) * 0.02 + 0.001
    # (asymmetric zeros up to 16: GPTQ v1's stored 15 reads as 16)
    zero = torch.full_like(scale, 8.0) if sym else torch.randint(0, 17, (n, k // group), generator=gen, device=device).float()
    return Int4Packed(pack_codes(codes), scale, zero, group)


def run_checks(shapes: Iterable[Shape], device: str, seed: int = 0, sum_rtol: float = 1e-5,
               groups: Tuple[int, ...] = (32, 64, 128)) -> List[str]:  # fmt: skip
    """Failures (empty: all passed); each comparison printed. Every shape with every group that
    divides its K (see `run_cases`)."""
    return run_cases([(m, n, k, g) for m, n, k in shapes for g in groups if k % g == 0], device, seed, sum_rtol)


def run_cases(cases: Iterable[Tuple[int, int, int, int]], device: str, seed: int = 0, sum_rtol: float = 1e-5) -> List[str]:
    """Failures (empty: all passed); each comparison printed. Results are held to `sum_rtol` x max
    |ref| (the summation order differs from the oracle's) plus the output dtype's rounding."""
    from minisgl.kernel import triton_int4 as K

    gen = torch.Generator(device=device).manual_seed(seed)
    failures: List[str] = []

    def check(name: str, got: torch.Tensor, ref: torch.Tensor, sum_tol: float, rtol: float) -> None:
        err = (got.float() - ref).abs()
        bound = sum_tol * float(ref.abs().max()) + rtol * ref.abs()
        ok = bool((err <= bound).all()) and got.shape == ref.shape
        print(f"{'ok  ' if ok else 'FAIL'} {name}: max |diff| {err.max().item():.3g}, max |ref| {ref.abs().max().item():.3g}")
        if not ok:
            failures.append(name)

    for i, (m, n, k, group) in enumerate(cases):
        sym = i % 2 == 0  # (each group both ways over the cases)
        what = f"M={m} N={n} K={k} g{group} {'sym' if sym else 'asym'}"
        w = make_weight(n, k, group, sym, gen, device)
        x = torch.randn(m, k, generator=gen, device=device)
        bias = torch.randn(n, generator=gen, device=device)
        # float32: the exact dequantized weight, an IEEE float32 dot
        w32 = w.to(torch.device(device), torch.float32)
        ref = x @ w32.dense().t()
        y = K.w4a16_gemm(x, w32.qweight, w32.scale, w32.zero, group)
        check(f"fp32 {what} (split {K.gemm_config(m, n, k, group, fp32=True).split_k})", y, ref, sum_rtol, 1e-5)
        # bfloat16 + bias: the weight dequantized from bf16 scales, rounded to bf16 for the dot
        # (one row: the GEMV, which multiplies the float32 values, no rounding)
        wb = w.to(torch.device(device), torch.bfloat16)
        xb, bb = x.bfloat16(), bias.bfloat16()
        dense = wb.dense()
        ref_rounded = xb.float() @ (dense if m == 1 else dense.bfloat16().float()).t() + bb.float()
        yb = K.w4a16_gemm(xb, wb.qweight, wb.scale, wb.zero, group, bb)
        assert yb.dtype == torch.bfloat16
        check(f"bf16 + bias {what}", yb, ref_rounded, sum_rtol, 2.0**-8)
        check(f"bf16 vs exact weights {what}", yb, xb.float() @ dense.t() + bb.float(), 2.0**-6, 2.0**-7)
        if i in (0, 4):  # the 3-D entry point, and the op's torch implementation (layers/int4.py)
            x3 = xb.reshape(1, m, k)
            y3 = K.w4a16_linear(x3, wb.qweight, wb.scale, wb.zero, group, bb)
            check(f"w4a16_linear 3-D {what}", y3.reshape(m, n), ref_rounded, sum_rtol, 2.0**-8)
            if device == "cpu":
                from minisgl.layers.int4 import int4_linear

                got = int4_linear(x3, wb.qweight, wb.scale, wb.zero, group, bb).reshape(m, n)
                check(f"torch op vs kernel {what}", got, yb.float(), sum_rtol, 2.0**-8)
    return failures


def main() -> int:
    import os

    assert os.environ.get("TRITON_INTERPRET") == "1"
    from minisgl.kernel.interpreter import patch_interpreter

    patch_interpreter()  # float32 -> bf16 rounds to nearest even, as on the GPU
    failures = run_cases(INTERPRETER_CASES, "cpu")
    print("FAILED: " + ", ".join(failures) if failures else "all int4 kernel checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
