"""Fused MoE in Triton: grouped GEMMs over (token, expert) pairs sorted by expert.

For T tokens routed to top-k experts there are M = T * k pairs; pair p = t * k + j is token t's
j-th choice. The computation is out[t] = sum_j w[t, j] * W2[e] @ silu_and_mul(W13[e] @ x[t]).

1. Align (3 small kernels + a memset, no host sync): count pairs per expert (atomics), round each
   expert's count up to a multiple of BLOCK_M and prefix-sum those into segment starts, then
   scatter every pair into its expert's segment. `sorted_ids[BLOCK_M * b : BLOCK_M * (b + 1)]`
   then holds pairs of one expert, `block_expert[b]`, padded with the sentinel M. The number of
   blocks is bounded from shapes alone (M + min(E, M) * (BLOCK_M - 1) rows), so the launch is
   the same for every routing; blocks past the real total exit at once. The order of pairs within
   an expert's segment depends on atomic timing, which changes no result: each output row of a
   GEMM tile depends only on its own input row, and every pair writes its own output row.
2. w13 GEMM, grid (row blocks x column blocks of I): gathers x rows of the block's tokens,
   multiplies by the expert's gate and up rows (two accumulators) and applies SiLU-and-mul in the
   epilogue, writing the [M, I] intermediate (one row per pair).
3. w2 GEMM: intermediate rows @ W2[e]^T, times the pair's routing weight, to [M, H].
4. Sum over the k slots: [T, k, H].sum(1).

The epilogues round to the model dtype where the torch reference materialises a tensor (the
GEMM outputs, silu, the weighted product), so bf16 results agree with TorchMoeBackend to bf16
rounding and float32 results (IEEE dots, no TF32) to summation order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from minisgl.kernel.triton_tiles import grouped_tile
from minisgl.moe.base import BaseMoeBackend, ClampedSwiglu, MoeCap
from minisgl.utils.env import read_env

INTERPRET = read_env().triton_interpret


@dataclass(frozen=True)
class MoeConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3


def smem_bytes(cfg: MoeConfig, elem_size: int = 2) -> int:
    """Shared memory the gated (w13) GEMM's pipeline needs, roughly."""
    return (cfg.block_m + 2 * cfg.block_n) * cfg.block_k * elem_size * cfg.num_stages


def default_config(num_pairs: int, num_experts: int, dtype: torch.dtype) -> MoeConfig:
    """Tile sizes by the average number of pairs per expert (decode: ~1, prefill: hundreds)."""
    per_expert = num_pairs / max(1, num_experts)
    if dtype == torch.float32:
        if per_expert <= 4:
            return MoeConfig(16, 64, 32, 1, 4, 2)
        return MoeConfig(64, 64, 32, 8, 4, 2)
    # shared memory per stage of the gated GEMM: (BLOCK_M + 2 * BLOCK_N) * BLOCK_K * 2 bytes;
    # all of these stay under ~120 KB in total, well inside an H100/H200's 227 KB
    if per_expert <= 2:
        return MoeConfig(16, 64, 128, 1, 4, 3)
    if per_expert <= 16:
        return MoeConfig(16, 128, 64, 1, 4, 3)
    if per_expert <= 64:
        return MoeConfig(32, 128, 64, 4, 4, 3)
    return MoeConfig(64, 128, 64, 8, 8, 3)


# ---- alignment ---------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["num_pairs", "max_rows"])
def _count_kernel(Ids, Counts, SortedIds, num_pairs, max_rows, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    # every slot starts as padding (the sentinel num_pairs)
    tl.store(SortedIds + offs, tl.zeros([BLOCK], dtype=tl.int32) + num_pairs, mask=offs < max_rows)
    m = offs < num_pairs
    e = tl.load(Ids + offs, mask=m, other=0).to(tl.int32)
    tl.atomic_add(Counts + e, tl.full([BLOCK], 1, tl.int32), mask=m)


@triton.jit
def _segment_kernel(Counts, Total, num_experts, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    offs = tl.arange(0, BLOCK_E)
    m = offs < num_experts
    c = tl.load(Counts + offs, mask=m, other=0)
    padded = (c + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    end = tl.cumsum(padded, 0)
    # Counts becomes the write cursor: each expert's segment start
    tl.store(Counts + offs, end - padded, mask=m)
    tl.store(Total, tl.sum(padded, 0))


@triton.jit(do_not_specialize=["num_pairs"])
def _scatter_kernel(Ids, Cursor, SortedIds, BlockExpert, num_pairs, BLOCK_M: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < num_pairs
    e = tl.load(Ids + offs, mask=m, other=0).to(tl.int32)
    slot = tl.atomic_add(Cursor + e, tl.full([BLOCK], 1, tl.int32), mask=m)
    tl.store(SortedIds + slot, offs, mask=m)
    # all pairs of a block share its expert, so concurrent writes store the same value
    tl.store(BlockExpert + slot // BLOCK_M, e, mask=m)


def max_padded_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    rows = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return triton.cdiv(rows, block_m) * block_m


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (sorted_ids int32 [max_rows], block_expert int32 [max_rows / block_m], total int32 [1])."""
    ids = topk_ids.reshape(-1)
    if not ids.is_contiguous():
        ids = ids.contiguous()
    num_pairs = ids.numel()
    max_rows = max_padded_rows(num_pairs, num_experts, block_m)
    dev = ids.device
    sorted_ids = torch.empty(max_rows, dtype=torch.int32, device=dev)
    block_expert = torch.empty(max_rows // block_m, dtype=torch.int32, device=dev)
    counts_total = torch.zeros(num_experts + 1, dtype=torch.int32, device=dev)
    counts, total = counts_total[:num_experts], counts_total[num_experts:]
    block = 1024
    _count_kernel[(triton.cdiv(max_rows, block),)](ids, counts, sorted_ids, num_pairs, max_rows, BLOCK=block)
    _segment_kernel[(1,)](counts, total, num_experts, BLOCK_M=block_m, BLOCK_E=triton.next_power_of_2(num_experts))
    _scatter_kernel[(triton.cdiv(num_pairs, block),)](ids, counts, sorted_ids, block_expert, num_pairs,
                                                     BLOCK_M=block_m, BLOCK=block)  # fmt: skip
    return sorted_ids, block_expert, total


def moe_align_torch(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same layout with torch ops only (deterministic order within an expert); a reference."""
    ids = topk_ids.reshape(-1).long()
    num_pairs = ids.numel()
    max_rows = max_padded_rows(num_pairs, num_experts, block_m)
    sorted_e, order = torch.sort(ids, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device).scatter_add_(0, ids, torch.ones_like(ids))
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = torch.cumsum(padded, 0)
    start = torch.cumsum(counts, 0) - counts
    rank = torch.arange(num_pairs, device=ids.device) - start[sorted_e]
    dest = (pad_end - padded)[sorted_e] + rank
    sorted_ids = torch.full((max_rows,), num_pairs, dtype=torch.int32, device=ids.device)
    sorted_ids[dest] = order.to(torch.int32)
    block_starts = torch.arange(max_rows // block_m, device=ids.device) * block_m
    block_expert = torch.searchsorted(pad_end, block_starts, right=True).clamp_max(num_experts - 1).to(torch.int32)
    return sorted_ids, block_expert, pad_end[-1:].to(torch.int32)


# ---- grouped GEMM ------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["num_pairs", "num_m_blocks"])
def _moe_gemm_kernel(
    A, W, Out, SortedIds, BlockExpert, Total, TopkW, Bias,
    num_pairs, num_m_blocks,
    stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_om, stride_on, stride_be,
    N: tl.constexpr, K: tl.constexpr, A_ROW_DIV: tl.constexpr, GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    HAS_BIAS: tl.constexpr = False, SWIGLU: tl.constexpr = False, SWIGLU_ALPHA: tl.constexpr = 0.0,
    SWIGLU_LIMIT: tl.constexpr = 0.0,
):  # fmt: skip
    """Out[p, :N] for the pairs p of one row block: GATED -> silu(A W[e,:N]^T) * (A W[e,N:2N]^T),
    else (A W[e]^T) * TopkW[p] when MUL_WEIGHT. A's row for pair p is p // A_ROW_DIV. GATED with
    HAS_BIAS adds Bias[e, :N] / Bias[e, N:2N] to the two products; SWIGLU replaces
    silu-and-mul by GPT-OSS's clamped SwiGLU (moe/base.py ClampedSwiglu)."""
    pid = tl.program_id(0)
    num_n_blocks = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = grouped_tile(pid, num_m_blocks, num_n_blocks, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(Total):
        return

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(SortedIds + offs_m)
    row_ok = pairs < num_pairs
    a_rows = (pairs // A_ROW_DIV).to(tl.int64)
    expert = tl.load(BlockExpert + pid_m).to(tl.int64)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_wn = offs_n % N  # wrap instead of masking the weight loads; the store is masked
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = A + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    w_ptrs = W + expert * stride_we + offs_wn[None, :].to(tl.int64) * stride_wn + offs_k[:, None] * stride_wk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if GATED:
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            w = tl.load(w_ptrs)
        else:
            k_ok = offs_k < K - k0
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
        if UPCAST:  # the CPU interpreter cannot dot bfloat16
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
        if GATED:
            if EVEN_K:
                wu = tl.load(w_ptrs + N * stride_wn)
            else:
                wu = tl.load(w_ptrs + N * stride_wn, mask=k_ok[:, None], other=0.0)
            if UPCAST:
                wu = wu.to(tl.float32)
            acc_up = tl.dot(a, wu, acc_up, input_precision=PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk

    dt = Out.dtype.element_ty
    if GATED:
        if HAS_BIAS:
            b_ptrs = Bias + expert * stride_be + offs_wn
            acc += tl.load(b_ptrs).to(tl.float32)[None, :]
            acc_up += tl.load(b_ptrs + N).to(tl.float32)[None, :]
        g = acc.to(dt).to(tl.float32)
        u = acc_up.to(dt).to(tl.float32)
        if SWIGLU:
            g = tl.minimum(g, SWIGLU_LIMIT)
            u = tl.minimum(tl.maximum(u, -SWIGLU_LIMIT), SWIGLU_LIMIT)
            glu = (g * tl.sigmoid(g * SWIGLU_ALPHA)).to(dt).to(tl.float32)
            res = ((u + 1.0) * glu).to(dt)
        else:
            s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
            res = (s * u).to(dt)
    elif MUL_WEIGHT:
        wt = tl.load(TopkW + pairs, mask=row_ok, other=0.0).to(tl.float32)
        res = (acc.to(dt).to(tl.float32) * wt[:, None]).to(dt)
    else:
        res = acc.to(dt)
    out_ptrs = Out + pairs.to(tl.int64)[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out_ptrs, res, mask=row_ok[:, None] & (offs_n < N)[None, :])


def _gemm(
    a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, sorted_ids: torch.Tensor, block_expert: torch.Tensor,
    total: torch.Tensor, topk_w: torch.Tensor, num_pairs: int, n: int, a_row_div: int, gated: bool, mul_weight: bool,
    cfg: MoeConfig, bias: torch.Tensor | None = None, activation: ClampedSwiglu | None = None,
) -> None:  # fmt: skip
    k = a.shape[1]
    # small test shapes: don't tile wider than the problem (tl.dot needs >= 16)
    block_n = max(16, min(cfg.block_n, triton.next_power_of_2(n)))
    block_k = max(16, min(cfg.block_k, triton.next_power_of_2(k)))
    num_m_blocks = block_expert.numel()
    grid = (num_m_blocks * triton.cdiv(n, block_n),)
    _moe_gemm_kernel[grid](
        a, w, out, sorted_ids, block_expert, total, topk_w, bias if bias is not None else topk_w,
        num_pairs, num_m_blocks,
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2), out.stride(0), out.stride(1),
        bias.stride(0) if bias is not None else 0,
        N=n, K=k, A_ROW_DIV=a_row_div, GATED=gated, MUL_WEIGHT=mul_weight,
        BLOCK_M=cfg.block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=cfg.group_m,
        EVEN_K=k % block_k == 0, PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        UPCAST=INTERPRET and a.dtype == torch.bfloat16, HAS_BIAS=bias is not None,
        SWIGLU=activation is not None, SWIGLU_ALPHA=activation.alpha if activation is not None else 0.0,
        SWIGLU_LIMIT=activation.limit if activation is not None else 0.0,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    config: Optional[MoeConfig] = None,
    b13: torch.Tensor | None = None,
    activation: ClampedSwiglu | None = None,
) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H] (gate rows, then up rows), w2 [E, H, I], topk_* [T, k] -> [T, H];
    b13 [E, 2I] a bias on the w13 products, activation None: SiLU-and-mul."""
    num_tokens, hidden = x.shape
    num_experts, two_i, _ = w13.shape
    inter = two_i // 2
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(x)
    if x.stride(-1) != 1:
        x = x.contiguous()
    cfg = config or default_config(num_pairs, num_experts, x.dtype)
    sorted_ids, block_expert, total = moe_align(topk_ids, num_experts, cfg.block_m)
    weights = topk_weights.reshape(-1)
    if not weights.is_contiguous():
        weights = weights.contiguous()
    cache1 = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    if b13 is not None and b13.stride(-1) != 1:
        b13 = b13.contiguous()
    _gemm(x, w13, cache1, sorted_ids, block_expert, total, weights, num_pairs, inter, top_k, True, False, cfg, b13, activation)
    cache2 = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    _gemm(cache1, w2, cache2, sorted_ids, block_expert, total, weights, num_pairs, hidden, 1, False, True, cfg)
    if top_k == 1:
        return cache2
    return cache2.view(num_tokens, top_k, hidden).sum(dim=1)


class TritonMoeBackend(BaseMoeBackend):
    """Fused Triton MoE on CUDA (or under TRITON_INTERPRET=1); the torch reference elsewhere."""

    caps = MoeCap.DECODE_GRAPH  # fixed launches for every routing (see the module docstring)
    expert_features = ("expert_bias", "clamped_swiglu")

    def __init__(self, config: Optional[MoeConfig] = None) -> None:
        self.config = config
        self._fallback: Optional[BaseMoeBackend] = None

    def forward(
        self,
        x: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        b13: torch.Tensor | None = None,
        activation: ClampedSwiglu | None = None,
    ) -> torch.Tensor:
        if not (x.is_cuda or INTERPRET) or w13.dtype != x.dtype or w2.dtype != x.dtype:
            if self._fallback is None:
                from minisgl.moe.torch_moe import TorchMoeBackend

                self._fallback = TorchMoeBackend()
            return self._fallback.forward(x, w13, w2, topk_weights, topk_ids, b13, activation)
        return fused_moe(x, w13, w2, topk_weights, topk_ids, self.config, b13, activation)
