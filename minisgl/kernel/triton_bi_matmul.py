"""A batch-invariant matrix product on CUDA (`--deterministic`): y = x @ w.T (+ bias) in one launch.

cuBLAS picks its kernel, tile and split of the reduction (split-K) by the problem's shape, so a
row of `x @ w.T` rounds differently when x has 1 or 300 rows. This kernel fixes everything that
decides the order of a row's sum once per weight shape, never by the number of rows: every
output tile is BLOCK_M x BLOCK_N, its K loop walks BLOCK_K columns at a time from column 0 in
order, one tensor-core dot per step accumulating in float32, and there is no split of K. A row's
result then depends only on that row and the weight; rows past M are masked (zeros), which adds
nothing to the others. The bias is added in float32 before the one rounding to the output dtype.

BLOCK_M stays 64 at every M (it also fixes the tensor-core instruction: Hopper's wgmma needs 64
rows), so a decode step of one row computes a 64-row tile: wasted math, but a decode step is bound
by reading the weight, which each N tile reads once. BLOCK_N narrows for a small N so that a
decode step still spreads over enough programs to stream the weight at speed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minisgl.kernel.triton_tiles import grouped_tile

BLOCK_M = 64
BLOCK_K = 64
GROUP_M = 8  # M tiles that walk one band of N tiles together (the band's weight stays in L2)
WIDE_N_TILES = 264  # BLOCK_N 64 once N gives at least this many tiles of 64 (2 per H200 SM), else 32


@triton.jit
def _bi_matmul_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K]
    b_ptr,  # [N] or a dummy
    y_ptr,  # [M, N]
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    IEEE: tl.constexpr,  # float32 inputs: exact products (not TF32)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = grouped_tile(pid, num_m, num_n, GROUP_M)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + rk) < K
        x = tl.load(x_ptr + rm[:, None] * stride_xm + (k0 + rk)[None, :] * stride_xk, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + rn[:, None] * stride_wn + (k0 + rk)[None, :] * stride_wk, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def block_n_for(n: int) -> int:
    """The column tile of a weight with `n` output features (a function of the weight alone)."""
    return 64 if triton.cdiv(n, 64) >= WIDE_N_TILES else 32


def bi_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [..., K]; weight: [N, K]; bias: [N] or None. Returns [..., N] in x's dtype, each row's
    bits independent of the other rows (see the module docstring)."""
    lead = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1])
    m, k = flat.shape
    n = weight.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y.view(*lead, n)
    block_n = block_n_for(n)
    grid = (triton.cdiv(m, BLOCK_M) * triton.cdiv(n, block_n),)
    _bi_matmul_kernel[grid](
        flat, weight, bias if bias is not None else y, y, m, n, k,
        flat.stride(0), flat.stride(1), weight.stride(0), weight.stride(1), y.stride(0),
        HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32,
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=BLOCK_K, GROUP_M=GROUP_M, num_warps=4, num_stages=4,
    )  # fmt: skip
    return y.view(*lead, n)
