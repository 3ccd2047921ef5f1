"""Triton kernels for the small per-layer ops: RMSNorm (optionally fused with the residual add),
SiLU-and-mul and rotary embedding.

CUDA only (or Triton's CPU interpreter with TRITON_INTERPRET=1, which the tests use). Never import
this module on a CPU path: go through `minisgl.kernel.fused`, which checks `x.is_cuda` first.

Every kernel reproduces the rounding of the torch reference it replaces (layers/norm.py,
layers/activation.py, layers/rotary.py): the arithmetic is float32, and wherever the reference
materialises a tensor in the model dtype the kernel casts to that dtype at the same point. In
float32 the casts are no-ops and the results differ from torch only by the order of a sum. Launch
shapes depend only on tensor shapes and every output is allocated from shapes alone, so the ops
are CUDA-graph safe. Row counts are not specialised on (do_not_specialize), so a new batch size
does not compile a new kernel.
"""

from __future__ import annotations

from typing import Tuple

import torch
import triton
import triton.language as tl

from minisgl.kernel.pdl import launch_kwargs, pdl_for
from minisgl.kernel.triton_attention import to_kv_cache
from minisgl.utils.env import read_env

INTERPRET = read_env().triton_interpret


def _num_warps(block_elems: int) -> int:
    return max(1, min(16, block_elems // 256))


# ---- RMSNorm (+ residual) -----------------------------------------------------------------------


@triton.jit(do_not_specialize=["n_rows"])
def _rmsnorm_kernel(
    X,
    R,
    W,
    Out,
    ResOut,
    n_rows,
    n_inner,
    N,
    eps,
    sx0,
    sx1,
    sr0,
    sr1,
    so0,
    so1,
    sro0,
    sro1,
    HAS_RES: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # A "row" is one normalised vector; rows are addressed as (row // n_inner, row % n_inner)
    # so per-head norms work on [T, H, D] views whose T stride is not H * D (q/k split from qkv).
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_mask = rows < n_rows
    r0 = (rows // n_inner).to(tl.int64)
    r1 = (rows % n_inner).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    col_mask = cols < N
    mask = row_mask[:, None] & col_mask[None, :]
    x = tl.load(X + (r0 * sx0 + r1 * sx1)[:, None] + cols[None, :], mask=mask, other=0.0)
    if HAS_RES:
        res = tl.load(R + (r0 * sr0 + r1 * sr1)[:, None] + cols[None, :], mask=mask, other=0.0)
        # the reference adds in the model dtype: x = x + residual
        s = (x.to(tl.float32) + res.to(tl.float32)).to(ResOut.dtype.element_ty)
        tl.store(ResOut + (r0 * sro0 + r1 * sro1)[:, None] + cols[None, :], s, mask=mask)
        xf = s.to(tl.float32)
    else:
        xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=1) / N
    # correctly rounded 1/sqrt (div_rn does not broadcast a scalar: give it a full tensor)
    rstd = tl.div_rn(tl.full([ROWS], 1.0, tl.float32), tl.sqrt_rn(var + eps))
    y = (xf * rstd[:, None]).to(Out.dtype.element_ty)  # hidden.to(input_dtype)
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    out = (w[None, :] * y.to(tl.float32)).to(Out.dtype.element_ty)  # weight * hidden
    tl.store(Out + (r0 * so0 + r1 * so1)[:, None] + cols[None, :], out, mask=mask)


def _as_rows(x: torch.Tensor) -> Tuple[torch.Tensor, int, int, int, int]:
    """View x as (rows of the last dim) addressed by two strides: returns (x, n_rows, n_inner, s0, s1)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dim() == 1:
        return x, 1, 1, 0, 0
    if x.dim() == 2:
        return x, x.shape[0], 1, x.stride(0), 0
    if x.dim() > 3:
        x = x.reshape(-1, x.shape[-2], x.shape[-1])  # a view whenever the leading dims allow it
    return x, x.shape[0] * x.shape[1], x.shape[1], x.stride(0), x.stride(1)


def _norm_launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    shape, n = x.shape, x.shape[-1]
    out = torch.empty(shape, dtype=x.dtype, device=x.device)
    xr, n_rows, n_inner, sx0, sx1 = _as_rows(x)
    outr, _, _, so0, so1 = _as_rows(out)
    if residual is not None:
        res_out = torch.empty(shape, dtype=x.dtype, device=x.device)
        rr, _, _, sr0, sr1 = _as_rows(residual)
        ror, _, _, sro0, sro1 = _as_rows(res_out)
    else:
        res_out, rr, ror, sr0, sr1, sro0, sro1 = None, xr, outr, 0, 0, 0, 0
    if n_rows == 0:
        return out, res_out
    block = triton.next_power_of_2(n)
    rows = max(1, min(64, 2048 // block))
    grid = (triton.cdiv(n_rows, rows),)
    _rmsnorm_kernel[grid](
        xr, rr, weight, outr, ror, n_rows, n_inner, n, eps,
        sx0, sx1, sr0, sr1, so0, so1, sro0, sro1,
        HAS_RES=residual is not None, ROWS=rows, BLOCK=block, num_warps=_num_warps(rows * block),
    )  # fmt: skip
    return out, res_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype), one kernel."""
    return _norm_launch(x, None, weight, eps)[0]


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """s = x + residual; returns (rms_norm(s), s) in one kernel (inputs are not modified)."""
    out, res_out = _norm_launch(x, residual, weight, eps)
    assert res_out is not None
    return out, res_out


# ---- SiLU and mul -------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["n_rows"])
def _silu_and_mul_kernel(X, Out, n_rows, I, sx, so, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    g = tl.load(X + row * sx + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(X + row * sx + I + cols, mask=mask, other=0.0).to(tl.float32)
    dt = Out.dtype.element_ty
    s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)  # F.silu(gate) in the model dtype
    tl.store(Out + row * so + cols, (s * u).to(dt), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up] along the last dim -> silu(gate) * up."""
    two_i = x.shape[-1]
    inter = two_i // 2
    out = torch.empty(*x.shape[:-1], inter, dtype=x.dtype, device=x.device)
    x2 = x.reshape(-1, two_i)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    n_rows = x2.shape[0]
    if n_rows == 0 or inter == 0:
        return out
    block = min(1024, triton.next_power_of_2(inter))
    grid = (n_rows, triton.cdiv(inter, block))
    _silu_and_mul_kernel[grid](x2, out.view(-1, inter), n_rows, inter, x2.stride(0), inter, BLOCK=block,
                               num_warps=_num_warps(block))  # fmt: skip
    return out


# ---- rotary ------------------------------------------------------------------------------------


@triton.jit
def _rope_heads(
    X, O, t, hb, n_heads, sxt, sxh, sot, soh, c, s, half_offs, half_mask,
    HALF: tl.constexpr, ROT: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_REST: tl.constexpr,
):  # fmt: skip
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < n_heads
    mask = hmask[:, None] & half_mask[None, :]
    xb = X + t * sxt + heads[:, None].to(tl.int64) * sxh
    ob = O + t * sot + heads[:, None].to(tl.int64) * soh
    x1 = tl.load(xb + half_offs[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(xb + HALF + half_offs[None, :], mask=mask, other=0.0).to(tl.float32)
    dt = O.dtype.element_ty
    # reference: x * cos + rotate_half(x) * sin, each product and the sum in the model dtype
    a1 = (x1 * c[None, :]).to(dt).to(tl.float32)
    b1 = (x2 * s[None, :]).to(dt).to(tl.float32)
    a2 = (x2 * c[None, :]).to(dt).to(tl.float32)
    b2 = (x1 * s[None, :]).to(dt).to(tl.float32)
    tl.store(ob + half_offs[None, :], (a1 - b1).to(dt), mask=mask)
    tl.store(ob + HALF + half_offs[None, :], (a2 + b2).to(dt), mask=mask)
    if BLOCK_REST > 0:  # partial rotary: the dims past rotary_dim pass through
        rest = ROT + tl.arange(0, BLOCK_REST)
        rmask = hmask[:, None] & (rest < HEAD_DIM)[None, :]
        tl.store(ob + rest[None, :], tl.load(xb + rest[None, :], mask=rmask, other=0.0), mask=rmask)


@triton.jit
def _rope_kernel(
    Pos, Q, K, Cos, Sin, QO, KO,
    n_q_heads, n_k_heads, sqt, sqh, skt, skh, sqot, sqoh, skot, skoh, s_cos,
    HALF: tl.constexpr, ROT: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    n_qb = tl.cdiv(n_q_heads, BLOCK_H)
    pos = tl.load(Pos + t).to(tl.int64)
    half_offs = tl.arange(0, BLOCK_HALF)
    half_mask = half_offs < HALF
    dt = QO.dtype.element_ty
    # the cos/sin table is float32; the reference casts it to the model dtype first
    c = tl.load(Cos + pos * s_cos + half_offs, mask=half_mask, other=0.0).to(dt).to(tl.float32)
    s = tl.load(Sin + pos * s_cos + half_offs, mask=half_mask, other=0.0).to(dt).to(tl.float32)
    if hb < n_qb:
        _rope_heads(Q, QO, t, hb, n_q_heads, sqt, sqh, sqot, sqoh, c, s, half_offs, half_mask,
                    HALF, ROT, HEAD_DIM, BLOCK_H, BLOCK_REST)  # fmt: skip
    else:
        _rope_heads(K, KO, t, hb - n_qb, n_k_heads, skt, skh, skot, skoh, c, s, half_offs, half_mask,
                    HALF, ROT, HEAD_DIM, BLOCK_H, BLOCK_REST)  # fmt: skip


def apply_rotary(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hk, D] (HF rotate-half layout) by the float32 cos/sin table
    [max_pos, rotary_dim] rows at `positions` (int32 or int64). Returns new contiguous tensors."""
    t, hq, d = q.shape
    hk = k.shape[1]
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    q_out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    k_out = torch.empty((t, hk, d), dtype=k.dtype, device=k.device)
    if t == 0:
        return q_out, k_out
    half = rotary_dim // 2
    block_h = min(16, triton.next_power_of_2(max(hq, hk)))
    block_half = triton.next_power_of_2(half)
    block_rest = triton.next_power_of_2(d - rotary_dim) if d > rotary_dim else 0
    grid = (t, triton.cdiv(hq, block_h) + triton.cdiv(hk, block_h))
    _rope_kernel[grid](
        positions, q, k, cos, sin, q_out, k_out,
        hq, hk, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), cos.stride(0),
        HALF=half, ROT=rotary_dim, HEAD_DIM=d, BLOCK_H=block_h, BLOCK_HALF=block_half, BLOCK_REST=block_rest,
        num_warps=_num_warps(block_h * block_half * 2),
    )  # fmt: skip
    return q_out, k_out


# ---- the attention prologue: q/k norm + rotary + KV store ----------------------------------------


@triton.jit
def _prologue_heads(
    X, Out, t_out, heads, hmask, sxh, so_h, w1, w2, c, s, half_offs, half_mask, eps,
    HALF: tl.constexpr, HEAD_DIM: tl.constexpr, HAS_NORM: tl.constexpr, ROTATE: tl.constexpr,
    BLOCK_H: tl.constexpr, DT: tl.constexpr,
):  # fmt: skip
    # DT: the model dtype, where the torch path rounds; Out may be an fp8 KV pool (stored as the
    # pool's reference fp8 store stores the model-dtype K/V)
    mask = hmask[:, None] & half_mask[None, :]
    xb = X + heads[:, None].to(tl.int64) * sxh
    ob = Out + t_out + heads[:, None].to(tl.int64) * so_h
    x1 = tl.load(xb + half_offs[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(xb + HALF + half_offs[None, :], mask=mask, other=0.0).to(tl.float32)
    dt = DT
    if ROTATE:  # q or k; v passes through unchanged
        if HAS_NORM:  # per-head RMSNorm, rounded where layers/norm.py rounds
            var = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HEAD_DIM
            rstd = tl.div_rn(tl.full([BLOCK_H], 1.0, tl.float32), tl.sqrt_rn(var + eps))
            x1 = (w1[None, :] * (x1 * rstd[:, None]).to(dt).to(tl.float32)).to(dt).to(tl.float32)
            x2 = (w2[None, :] * (x2 * rstd[:, None]).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        # rotate-half rotary, rounded where layers/rotary.py rounds
        a1 = (x1 * c[None, :]).to(dt).to(tl.float32)
        b1 = (x2 * s[None, :]).to(dt).to(tl.float32)
        a2 = (x2 * c[None, :]).to(dt).to(tl.float32)
        b2 = (x1 * s[None, :]).to(dt).to(tl.float32)
        x1 = a1 - b1
        x2 = a2 + b2
    tl.store(ob + half_offs[None, :], to_kv_cache(x1.to(dt), Out.dtype.element_ty), mask=mask)
    tl.store(ob + HALF + half_offs[None, :], to_kv_cache(x2.to(dt), Out.dtype.element_ty), mask=mask)


@triton.jit
def _attn_prologue_kernel(
    QKV, Pos, QW, KW, Cos, Sin, QOut, KCache, VCache, Loc,
    n_q_heads, n_kv_heads, s_qkv, s_qo, s_kc, s_vc, s_cos, eps,
    HALF: tl.constexpr, HEAD_DIM: tl.constexpr, HAS_NORM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, USE_PDL: tl.constexpr = False,
):  # fmt: skip
    # program (t, hb): head block hb of token t, over [q blocks | k blocks | v blocks]
    if USE_PDL:  # see minisgl/kernel/pdl.py: wait for the QKV projection before any access
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    n_qb = tl.cdiv(n_q_heads, BLOCK_H)
    n_kb = tl.cdiv(n_kv_heads, BLOCK_H)
    half_offs = tl.arange(0, BLOCK_HALF)
    half_mask = half_offs < HALF
    dt = QOut.dtype.element_ty
    pos = tl.load(Pos + t).to(tl.int64)
    # the cos/sin table is float32; the reference casts it to the model dtype first
    c = tl.load(Cos + pos * s_cos + half_offs, mask=half_mask, other=0.0).to(dt).to(tl.float32)
    s = tl.load(Sin + pos * s_cos + half_offs, mask=half_mask, other=0.0).to(dt).to(tl.float32)
    row = QKV + t * s_qkv
    if hb < n_qb:
        heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        w1 = c
        w2 = c
        if HAS_NORM:
            w1 = tl.load(QW + half_offs, mask=half_mask, other=0.0).to(tl.float32)
            w2 = tl.load(QW + HALF + half_offs, mask=half_mask, other=0.0).to(tl.float32)
        _prologue_heads(row, QOut, t * s_qo, heads, heads < n_q_heads, HEAD_DIM, HEAD_DIM, w1, w2, c, s,
                        half_offs, half_mask, eps, HALF, HEAD_DIM, HAS_NORM, True, BLOCK_H, dt)  # fmt: skip
    else:
        slot = tl.load(Loc + t).to(tl.int64)
        if hb < n_qb + n_kb:
            heads = (hb - n_qb) * BLOCK_H + tl.arange(0, BLOCK_H)
            w1 = c
            w2 = c
            if HAS_NORM:
                w1 = tl.load(KW + half_offs, mask=half_mask, other=0.0).to(tl.float32)
                w2 = tl.load(KW + HALF + half_offs, mask=half_mask, other=0.0).to(tl.float32)
            _prologue_heads(row + n_q_heads * HEAD_DIM, KCache, slot * s_kc, heads, heads < n_kv_heads,
                            HEAD_DIM, HEAD_DIM, w1, w2, c, s, half_offs, half_mask, eps,
                            HALF, HEAD_DIM, HAS_NORM, True, BLOCK_H, dt)  # fmt: skip
        else:
            heads = (hb - n_qb - n_kb) * BLOCK_H + tl.arange(0, BLOCK_H)
            _prologue_heads(row + (n_q_heads + n_kv_heads) * HEAD_DIM, VCache, slot * s_vc, heads,
                            heads < n_kv_heads, HEAD_DIM, HEAD_DIM, c, c, c, s, half_offs, half_mask, eps,
                            HALF, HEAD_DIM, False, False, BLOCK_H, dt)  # fmt: skip


def attention_prologue(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out_loc: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> torch.Tensor:
    """One kernel for what runs between the QKV projection and attention: split qkv [T, (Hq + 2Hk) D],
    per-head RMSNorm of q and k (Qwen3; skipped when the weights are None), rotary over the whole
    head (rotate-half layout, float32 cos/sin tables), and K/V stored into the pool slots `out_loc`
    of k_cache/v_cache [slots, Hk, D] (model dtype, or float8_e4m3fn stored as the pool's reference
    fp8 store stores the model-dtype K/V). Returns q [T, Hq, D]; same rounding as the torch path."""
    T = qkv.shape[0]
    assert qkv.stride(-1) == 1 and head_dim % 2 == 0
    assert k_cache.stride(1) == head_dim and v_cache.stride(1) == head_dim
    q_out = torch.empty((T, num_q_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if T == 0:
        return q_out
    half = head_dim // 2
    block_h = min(16, triton.next_power_of_2(max(num_q_heads, num_kv_heads)))
    block_half = triton.next_power_of_2(half)
    has_norm = q_norm_weight is not None and k_norm_weight is not None
    n_blocks = triton.cdiv(num_q_heads, block_h) + 2 * triton.cdiv(num_kv_heads, block_h)
    _attn_prologue_kernel[(T, n_blocks)](
        qkv, positions, q_norm_weight if has_norm else cos, k_norm_weight if has_norm else cos, cos, sin,
        q_out, k_cache, v_cache, out_loc,
        num_q_heads, num_kv_heads, qkv.stride(0), q_out.stride(0), k_cache.stride(0), v_cache.stride(0),
        cos.stride(0), eps,
        HALF=half, HEAD_DIM=head_dim, HAS_NORM=has_norm, BLOCK_H=block_h, BLOCK_HALF=block_half,
        USE_PDL=pdl_for(T), num_warps=_num_warps(block_h * block_half * 2), **launch_kwargs(pdl_for(T)),
    )  # fmt: skip
    return q_out
