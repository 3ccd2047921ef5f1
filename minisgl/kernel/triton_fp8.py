"""FP8 (e4m3) W8A8 linear layers on CUDA: a per-token-group activation quantizer and a
block-scaled FP8 GEMM, both Triton.

    x_q[m, k], x_s[m, k // 128] = quantize_groups(x)   # scale = absmax / 448 per 128 columns
    y[m, n] = sum_kb (x_q[m, kb] . w_q[n, kb]) * x_s[m, kb] * w_s[n // block_n, kb]

The weight scale is per (block_n rows x 128 columns) block (the `weight_block_size` [128, 128]
checkpoints) or per output row (block_n = 1, one scale column broadcast over K: per-channel and
per-tensor checkpoints, online `--quantization fp8`). Each K step of the GEMM is one 128-wide
tensor-core dot on the FP8 operands, accumulated in float32 after its two scales; the output is
rounded once to the model dtype. K must be a multiple of 128 (the loader keeps such layers only).

Both kernels are CUDA-graph capturable: no host syncs, and the only allocations (x_q, x_s, y)
have shapes that depend on the input's shape alone. Imported lazily (layers/fp8.py), CUDA only at
run time; tests/kernel_checks/fp8.py runs them through Triton's interpreter on the CPU.
"""

from __future__ import annotations

from typing import Tuple

import torch
import triton
import triton.language as tl

from minisgl.kernel.triton_tiles import grouped_tile

GROUP = 128  # activation group along K == the weight scale block along K
FP8_MAX = 448.0  # largest finite float8_e4m3fn
_EPS = 1e-10  # floor of a group's absmax (an all-zero group quantizes to zeros, scale > 0)


@triton.jit
def _quant_groups_kernel(x_ptr, q_ptr, s_ptr, stride_xm, stride_qm, stride_sm, GROUP_K: tl.constexpr, EPS: tl.constexpr,
                         QMAX: tl.constexpr):  # fmt: skip
    m = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    offs = g * GROUP_K + tl.arange(0, GROUP_K)
    x = tl.load(x_ptr + m * stride_xm + offs).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=0), EPS)
    s = amax / QMAX
    q = tl.minimum(tl.maximum(x / s, -QMAX), QMAX)
    tl.store(q_ptr + m * stride_qm + offs, q.to(q_ptr.dtype.element_ty))
    tl.store(s_ptr + m * stride_sm + g, s)


def quantize_groups(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(x_q float8_e4m3fn [M, K], x_s float32 [M, K / 128]) of a [M, K] activation (K % 128 == 0,
    unit stride along K): per row and 128-column group, scale = absmax / 448 and x_q = x / scale
    saturated to +-448 and rounded to nearest e4m3."""
    m, k = x.shape
    if k % GROUP or x.stride(-1) != 1:
        raise ValueError(f"FP8 activation groups need K % {GROUP} == 0 and unit stride, got {tuple(x.shape)} stride {x.stride()}")
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((m, k // GROUP), dtype=torch.float32, device=x.device)
    if m:
        _quant_groups_kernel[(m, k // GROUP)](x, q, s, x.stride(0), q.stride(0), s.stride(0), GROUP_K=GROUP, EPS=_EPS, QMAX=FP8_MAX)
    return q, s


@triton.jit
def _fp8_gemm_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, bias_ptr, M, N, K, stride_am, stride_asm, stride_bn, stride_bsn,
                     stride_bsk, stride_cm, SCALE_BN: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = grouped_tile(pid, num_m, num_n, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    a_ptrs = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + offs_n.to(tl.int64)[None, :] * stride_bn + offs_k[:, None]  # [BLOCK_K, BLOCK_N] view of W^T
    as_ptrs = as_ptr + offs_m.to(tl.int64) * stride_asm
    bs_ptrs = bs_ptr + (offs_n // SCALE_BN).to(tl.int64) * stride_bsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        a = tl.load(a_ptrs, mask=mask_m[:, None], other=0.0)
        b = tl.load(b_ptrs, mask=mask_n[None, :], other=0.0)
        a_s = tl.load(as_ptrs + kb, mask=mask_m, other=0.0)
        b_s = tl.load(bs_ptrs + kb * stride_bsk, mask=mask_n, other=0.0)
        acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def gemm_config(m: int, n: int, block_n: int) -> Tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, GROUP_M, num_warps, num_stages) for M rows, N outputs and weight scales
    per `block_n` rows: decode (M <= 16) streams the weight in narrow column tiles so that every SM
    has some (Triton runs these dots as exact e4m3 -> fp16 conversions into mma.sync: M is below
    wgmma's 64); from 17 rows on, FP8 wgmma tiles. At 128 x 128 a per-row scale vector costs
    register spills (tests/kernel_checks/sm90.py), so per-row scales take 128 x 64 there."""
    if m <= 16:
        return 16, (64 if n >= 8192 else 32), 1, 4, 4
    if m <= 64:
        return 64, 64, 8, 4, 4
    if m <= 256:
        return 64, 128, 8, 4, 3
    return (128, 128, 8, 8, 3) if block_n > 1 else (128, 64, 8, 8, 3)


def fp8_gemm(x_q: torch.Tensor, x_s: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor, block_n: int,
             out_dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """y [M, N] in out_dtype = the block-scaled product of x_q [M, K] (scales x_s [M, K / 128])
    and w_q [N, K] (scales w_s [ceil(N / block_n), K / 128], or [.., 1]: one per row block,
    broadcast over K), plus bias."""
    m, k = x_q.shape
    n = w_q.shape[0]
    if w_q.shape[1] != k or k % GROUP:
        raise ValueError(f"FP8 GEMM shapes x {tuple(x_q.shape)}, w {tuple(w_q.shape)}: K must match and be a multiple of {GROUP}")
    if w_s.shape[0] != -(-n // block_n) or w_s.shape[1] not in (1, k // GROUP):
        raise ValueError(f"FP8 weight scale {tuple(w_s.shape)} does not fit weight {tuple(w_q.shape)} with {block_n}-row blocks")
    y = torch.empty((m, n), dtype=out_dtype, device=x_q.device)
    if m == 0:
        return y
    bm, bn, gm, warps, stages = gemm_config(m, n, block_n)
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    stride_bsk = w_s.stride(1) if w_s.shape[1] > 1 else 0
    _fp8_gemm_kernel[grid](
        x_q, x_s, w_q, w_s, y, bias if bias is not None else y, m, n, k, x_q.stride(0), x_s.stride(0), w_q.stride(0),
        w_s.stride(0), stride_bsk, y.stride(0), SCALE_BN=block_n, HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn,
        BLOCK_K=GROUP, GROUP_M=gm, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return y


def fp8_linear(x: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor, block_n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ bias) for an FP8 weight: x [..., K] in the model dtype -> [..., N] in that dtype."""
    flat = x.reshape(-1, x.shape[-1])
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    x_q, x_s = quantize_groups(flat)
    return fp8_gemm(x_q, x_s, w_q, w_s, block_n, x.dtype, bias).view(*x.shape[:-1], w_q.shape[0])
