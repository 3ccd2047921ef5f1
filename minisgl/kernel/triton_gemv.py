"""Skinny-M linear layers for decode: y = x @ W^T with few rows in x (M <= 64), fused with what
sits around the projection in a decoder layer.

At batch 1-64 a decode GEMM is a weight read: Qwen3-0.6B's four projections are 4-12 MB each,
and the kernels cuBLAS picks for them reach well under half of the H200's bandwidth, with a
separate RMSNorm and SiLU kernel around them (docs/PERFORMANCE.md). One program here owns BLOCK_N output features
over the whole K (no split-K: no partial buffer, no second kernel, no atomics), streams its
weight rows once, and applies in the same launch:

* PRE_NORM: RMSNorm of the input (with the residual add when HAS_RES), the way layers/norm.py
  rounds it; program 0 also writes the new residual stream. Every program recomputes the
  statistics of its rows from x (M x K elements, a few KiB from L2), which is cheaper than a
  launch.
* GATED: the weight is [gate | up] stacked on N (MergedColumnParallelLinear); the output is
  silu(gate) * up, rounded where layers/activation.py rounds.

Rounding: the product is accumulated in float32 and rounded once to the model dtype, as cuBLAS
does; only the summation order differs. Launch shapes depend on tensor shapes only and outputs
are allocated from shapes: CUDA-graph safe. M is not specialised on (a new batch size compiles
nothing); the tile config is, and `minisgl/kernel/skinny.py` picks it per shape at init.

CUDA (or TRITON_INTERPRET=1) only: import through `minisgl.kernel.skinny`, never on a CPU path.
"""

from __future__ import annotations

from typing import NamedTuple, Tuple

import torch
import triton
import triton.language as tl

from minisgl.kernel.pdl import launch_kwargs, pdl_enabled


class GemvConfig(NamedTuple):
    block_m: int  # < 16: broadcast-multiply path (rows in registers); >= 16: tl.dot, rows masked
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@triton.jit
def _load_x(X, R, NW, rows, row_mask, offs_k, k_mask, sx, sr, rstd, PRE_NORM: tl.constexpr, HAS_RES: tl.constexpr):
    """x[rows, offs_k] in the model dtype, normalised (and residual-added) when PRE_NORM."""
    mask = row_mask[:, None] & k_mask[None, :]
    x = tl.load(X + rows[:, None] * sx + offs_k[None, :], mask=mask, other=0.0)
    if PRE_NORM:
        dt = x.dtype
        if HAS_RES:
            r = tl.load(R + rows[:, None] * sr + offs_k[None, :], mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(dt)  # x + residual in the model dtype
        y = (x.to(tl.float32) * rstd[:, None]).to(dt)  # hidden.to(input_dtype)
        w = tl.load(NW + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        x = (w[None, :] * y.to(tl.float32)).to(dt)  # weight * hidden
    return x


@triton.jit(do_not_specialize=["M"])
def _gemv_kernel(
    X, R, NW, W, Out, ResOut,
    M, N, K, sx, sr, sw, so, sro, eps,
    PRE_NORM: tl.constexpr, HAS_RES: tl.constexpr, GATED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    # N is the number of output features (for GATED: the intermediate size; W has 2N rows).
    # BLOCK_M < 16: broadcast-multiply over register tiles (BLOCK_M == 1: [BLOCK_N, BLOCK_K],
    # else [BLOCK_M, BLOCK_N, BLOCK_K]); the weight tiles are double-buffered by hand (the
    # compiler pipelines only loads that feed a dot). BLOCK_M >= 16: tl.dot, pipelined by Triton.
    BCAST: tl.constexpr = BLOCK_M < 16
    pid_n = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M)
    row_mask = rows < M
    rows64 = rows.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    w_rows = offs_n.to(tl.int64) * sw

    # The weights are never written by an earlier kernel: fetch the first tile before waiting
    # for the predecessor (PDL), so the weight stream starts while it drains.
    if BCAST:
        offs_k = tl.arange(0, BLOCK_K)
        wmask = n_mask[:, None] & (offs_k < K)[None, :]
        w = tl.load(W + w_rows[:, None] + offs_k[None, :], mask=wmask, other=0.0)
        wu = w
        if GATED:
            wu = tl.load(W + N * sw + w_rows[:, None] + offs_k[None, :], mask=wmask, other=0.0)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()  # every program, before touching any activation

    rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
    if PRE_NORM:  # first pass: the statistics of each row (of x + residual)
        ss = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_kk = k0 + tl.arange(0, BLOCK_K)
            mask = row_mask[:, None] & (offs_kk < K)[None, :]
            x = tl.load(X + rows64[:, None] * sx + offs_kk[None, :], mask=mask, other=0.0)
            if HAS_RES:
                r = tl.load(R + rows64[:, None] * sr + offs_kk[None, :], mask=mask, other=0.0)
                s = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
                if pid_n == 0:  # one program writes the new residual stream
                    tl.store(ResOut + rows64[:, None] * sro + offs_kk[None, :], s, mask=mask)
                xf = s.to(tl.float32)
            else:
                xf = x.to(tl.float32)
            ss += tl.sum(xf * xf, axis=1)
        # correctly rounded 1/sqrt, as triton_ops._rmsnorm_kernel (div_rn needs a full tensor)
        rstd = tl.div_rn(tl.full([BLOCK_M], 1.0, tl.float32), tl.sqrt_rn(ss / K + eps))

    if BLOCK_M == 1:
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    elif BCAST:
        acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = _load_x(X, R, NW, rows64, row_mask, offs_k, k_mask, sx, sr, rstd, PRE_NORM, HAS_RES)
        if BCAST:
            # issue the next tile's loads before this tile's math (masked off past K: no traffic)
            offs_next = offs_k + BLOCK_K
            nmask = n_mask[:, None] & (offs_next < K)[None, :]
            w_next = tl.load(W + w_rows[:, None] + offs_next[None, :], mask=nmask, other=0.0)
            wu_next = w_next
            if GATED:
                wu_next = tl.load(W + N * sw + w_rows[:, None] + offs_next[None, :], mask=nmask, other=0.0)
            xf = x.to(tl.float32)
            if BLOCK_M == 1:  # x is [1, BLOCK_K]
                acc += w.to(tl.float32) * xf
                if GATED:
                    acc_u += wu.to(tl.float32) * xf
            else:
                acc += xf[:, None, :] * w.to(tl.float32)[None, :, :]
                if GATED:
                    acc_u += xf[:, None, :] * wu.to(tl.float32)[None, :, :]
            w = w_next
            wu = wu_next
        else:
            wmask = n_mask[:, None] & k_mask[None, :]
            w = tl.load(W + w_rows[:, None] + offs_k[None, :], mask=wmask, other=0.0)
            wu = w
            if GATED:
                wu = tl.load(W + N * sw + w_rows[:, None] + offs_k[None, :], mask=wmask, other=0.0)
            if X.dtype.element_ty == tl.float32:  # exact float32 products (tests), not TF32
                acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
                if GATED:
                    acc_u = tl.dot(x, tl.trans(wu), acc_u, input_precision="ieee")
            else:
                acc = tl.dot(x, tl.trans(w), acc)
                if GATED:
                    acc_u = tl.dot(x, tl.trans(wu), acc_u)

    if BLOCK_M == 1:
        y = tl.sum(acc, axis=1)[None, :]  # [1, BLOCK_N]
        yu = tl.sum(acc_u, axis=1)[None, :]
    elif BCAST:
        y = tl.sum(acc, axis=2)
        yu = tl.sum(acc_u, axis=2)
    else:
        y = acc
        yu = acc_u
    dt = Out.dtype.element_ty
    if GATED:  # the GEMM output rounds to the model dtype, then F.silu(gate) * up as the torch path
        g = y.to(dt).to(tl.float32)
        u = yu.to(dt).to(tl.float32)
        sg = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        out = (sg * u).to(dt)
    else:
        out = y.to(dt)
    omask = row_mask[:, None] & n_mask[None, :]
    tl.store(Out + rows64[:, None] * so + offs_n[None, :], out, mask=omask)


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    config: GemvConfig,
    *,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    gated: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor | None]:
    """x [M, K] (rows contiguous), weight [N_w, K] -> (out [M, N], new residual or None).

    With `norm_weight`, x is first RMS-normalised (after adding `residual` if given; the sum is
    returned as the new residual, like RMSNorm.forward_with_residual). With `gated`, weight is
    [gate | up] (N_w = 2 N) and out = silu(x @ gate^T) * (x @ up^T)."""
    m, k = x.shape
    n_w = weight.shape[0]
    n = n_w // 2 if gated else n_w
    assert weight.shape[1] == k and x.stride(1) == 1 and weight.stride(1) == 1
    assert m <= max(config.block_m, 1)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    pre_norm = norm_weight is not None
    has_res = pre_norm and residual is not None
    res_out = torch.empty((m, k), dtype=x.dtype, device=x.device) if has_res else None
    if m == 0:
        return out, res_out
    r = residual if has_res else x
    assert r is not None and r.stride(1) == 1
    ro = res_out if res_out is not None else out
    grid = (triton.cdiv(n, config.block_n),)
    _gemv_kernel[grid](
        x, r, norm_weight if pre_norm else weight, weight, out, ro,
        m, n, k, x.stride(0), r.stride(0), weight.stride(0), out.stride(0), ro.stride(0), eps,
        PRE_NORM=pre_norm, HAS_RES=has_res, GATED=gated,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, USE_PDL=pdl_enabled(),
        num_warps=config.num_warps, num_stages=config.num_stages, **launch_kwargs(),
    )  # fmt: skip
    return out, res_out
