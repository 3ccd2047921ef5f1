"""The skinny-M GEMV kernels (minisgl/kernel/triton_gemv.py) through Triton's interpreter: `TRITON_INTERPRET=1 python -m kernel_checks.gemv`
(tests/test_triton_gemv_interpret.py runs it); tools/gemv_tune.py checks and times them on a GPU.
The ops that take them inside a decoder layer (layers/norm_linear.py) are tests/test_norm_linear.py's."""

from __future__ import annotations

import sys


def main() -> int:
    """Every comparison printed; 1 when any failed."""
    import os

    assert os.environ.get("TRITON_INTERPRET") == "1"
    import torch
    import torch.nn.functional as F

    from minisgl.kernel.interpreter import patch_interpreter

    patch_interpreter()

    from minisgl.kernel.triton_gemv import GemvConfig, gemv
    from minisgl.layers.activation import silu_and_mul_torch
    from minisgl.layers.norm import rms_norm_torch

    torch.manual_seed(0)
    failures = []

    def check(name, got, ref, dtype):
        got, ref = got.float(), ref.float()
        # float32: only the summation order differs. bf16: one rounding of the product, which
        # may land one ulp away from torch's; the gated path rounds twice more after it.
        atol, rtol = (1e-4, 1e-4) if dtype == torch.float32 else (2e-2, 2e-2)
        ok = got.shape == ref.shape and bool(torch.isfinite(got).all()) and torch.allclose(got, ref, atol=atol, rtol=rtol)
        err = (got - ref).abs().max().item() if got.shape == ref.shape else float("nan")
        print(f"{'ok  ' if ok else 'FAIL'} {name:56s} {str(dtype):15s} max|err| {err:.3g}")
        if not ok:
            failures.append(name)

    K_, N_ = 96, 40  # two K tiles of 64 (the second partial), N tiles of 16 (the last partial)
    for dtype in (torch.float32, torch.bfloat16):
        for m, cfg in (
            (1, GemvConfig(1, 16, 64, 4, 2)),
            (1, GemvConfig(1, 4, 32, 4, 1)),
            (3, GemvConfig(4, 2, 32, 4, 1)),
            (3, GemvConfig(16, 16, 64, 4, 2)),
        ):
            if cfg.block_m > 1 and dtype != torch.float32:
                continue  # the interpreter's bf16 tl.dot is broken; tools/gemv_tune.py checks these tiles on a GPU
            x = torch.randn(m, K_, dtype=dtype)
            r = torch.randn(m, K_, dtype=dtype)
            nw = (torch.rand(K_) + 0.5).to(dtype)
            w = (torch.randn(2 * N_, K_) / K_**0.5).to(dtype)
            tag = f"m={m} bm={cfg.block_m} bn={cfg.block_n} bk={cfg.block_k}"
            out, res = gemv(x, w, cfg)
            check(f"plain {tag}", out, F.linear(x, w), dtype)
            assert res is None
            s = x + r
            h = rms_norm_torch(s, nw, 1e-6)
            out, res = gemv(x, w, cfg, residual=r, norm_weight=nw, eps=1e-6)
            check(f"norm+residual {tag}", out, F.linear(h, w), dtype)
            check(f"norm+residual: new residual {tag}", res, s, dtype)
            out, res = gemv(x, w, cfg, norm_weight=nw, eps=1e-6)
            check(f"norm, no residual {tag}", out, F.linear(rms_norm_torch(x, nw, 1e-6), w), dtype)
            out, res = gemv(x, w, cfg, residual=r, norm_weight=nw, eps=1e-6, gated=True)
            check(f"norm+residual+silu gate {tag}", out, silu_and_mul_torch(F.linear(h, w)), dtype)
            check(f"gated: new residual {tag}", res, s, dtype)
            assert out.shape == (m, N_)

    print("FAILURES:", failures)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
