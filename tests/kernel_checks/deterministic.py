"""The deterministic mode's CUDA kernels on random inputs. The attention kernel
(minisgl/kernel/triton_deterministic.py) on paged K/V: against float64 attention, and
batch-invariant (a query alone gives the same bits as inside a larger launch, at a different
place, with another chunking). The GEMM (minisgl/kernel/triton_bi_matmul.py): against a float64
product, and (on the GPU) a row alone gives the same bits as inside 3, 70 or 300 rows. On CUDA
(tests/test_deterministic.py, MINISGL_TEST_DEVICE=cuda) and, float32 only, on the CPU through
`TRITON_INTERPRET=1 python -m kernel_checks.deterministic`."""

from __future__ import annotations

import os
import sys

import torch


def check(dev: torch.device) -> bool:
    """Prints one line per case; True when every case is within tolerance and batch-invariant."""
    from minisgl.kernel.triton_deterministic import deterministic_attention

    gen = torch.Generator().manual_seed(0)
    ok = True
    cuda = dev.type == "cuda"
    cases = [(4, 2, 32, torch.float32), (2, 2, 24, torch.float32)] + ([(16, 4, 128, torch.bfloat16)] if cuda else [])
    for hq, hk, d, dtype in cases:
        slots, rows_n, width = 600, 4, 256
        k = torch.randn(slots, hk, d, generator=gen).to(dev, dtype)
        v = torch.randn(slots, hk, d, generator=gen).to(dev, dtype)
        table = torch.stack([torch.randperm(slots, generator=gen)[:width] for _ in range(rows_n)]).to(dev, torch.int32)
        lens = [1, 70, 129, 256] if cuda else [1, 20, 65, 130]  # (the interpreter is slow)
        rows = torch.tensor([r for r, n in enumerate(lens) for _ in range(n)], device=dev)
        pos = torch.tensor([p for n in lens for p in range(n)], device=dev)
        q = torch.randn(len(rows), hq, d, generator=gen).to(dev, dtype)
        full = deterministic_attention(q, k, v, table, rows, pos)
        # reference: plain softmax attention per query in float64
        ref = torch.empty(q.shape, dtype=torch.float64)
        for i in range(len(rows)):
            keys = k[table[rows[i], : pos[i] + 1].long()].double().repeat_interleave(hq // hk, 1)  # [L, Hq, D]
            vals = v[table[rows[i], : pos[i] + 1].long()].double().repeat_interleave(hq // hk, 1)
            w = torch.softmax((keys * q[i].double()[None]).sum(-1) / d**0.5, 0)  # [L, Hq]
            ref[i] = (w[..., None] * vals).sum(0).cpu()
        err = (full.double().cpu() - ref).abs().max().item()
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
        same = True
        for sel in (slice(0, 1), slice(5, 9), slice(30, 120), slice(len(rows) - 1, len(rows))):
            part = deterministic_attention(q[sel].contiguous(), k, v, table, rows[sel].contiguous(), pos[sel].contiguous())
            same &= torch.equal(part, full[sel])
        print(f"Hq={hq} Hk={hk} D={d} {dtype}: max err vs float64 {err:.2e} (tol {tol}), batch-invariant: {same}")
        ok &= err < tol and same
    return ok


def check_matmul(dev: torch.device) -> bool:
    """Prints one line per case; True when every case is within tolerance and batch-invariant."""
    from minisgl.kernel.triton_bi_matmul import bi_matmul

    gen = torch.Generator().manual_seed(1)
    cuda = dev.type == "cuda"
    # (rows, K, N, dtype): on CUDA Qwen3-0.6B's qkv, down and a wide (BLOCK_N 64) shape, bf16 and fp32
    cases = [(300, 1024, 4096, torch.bfloat16), (300, 3072, 1024, torch.bfloat16), (300, 1024, 20000, torch.bfloat16),
             (130, 200, 96, torch.float32)] if cuda else [(70, 80, 40, torch.float32), (70, 130, 96, torch.float32)]  # fmt: skip
    ok = True
    for m, k, n, dtype in cases:
        x = torch.randn(m, k, generator=gen).to(dev, dtype)
        w = (torch.randn(n, k, generator=gen) / k**0.5).to(dev, dtype)
        b = torch.randn(n, generator=gen).to(dev, dtype)
        full = bi_matmul(x, w, b)
        ref = (x.double() @ w.double().t() + b.double()).cpu()
        err = (full.double().cpu() - ref).abs().max().item()
        tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
        same = True
        for lo, hi in ((0, 1), (m - 1, m), (5, 8), (2, 66), (0, m // 2)):
            same &= torch.equal(bi_matmul(x[lo:hi], w, b), full[lo:hi])
        print(f"GEMM M={m} K={k} N={n} {dtype}: max err vs float64 {err:.2e} (tol {tol}), batch-invariant: {same}")
        # (the interpreter computes a tile's dot with numpy's BLAS, whose rounding depends on a
        # row's place in the tile: there only the values are checked, the bits on the GPU)
        ok &= err < tol and (same or not cuda)
    return ok


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":
        from minisgl.kernel.interpreter import patch_interpreter

        patch_interpreter()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ok = check(dev) & check_matmul(dev)
    print("deterministic kernels:", "ok" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
