"""Decode attention over a latent KV pool (DeepSeek's MLA, absorbed form) in Triton.

The pool of one layer is `[num_slots, 1, LAT + ROPE]`: per token the compressed latent c
(kv_lora_rank = LAT values) and the shared rotary key (ROPE values); the value is c itself.
The query of each head is absorbed into the same space, [q_nope W_UK | q_pe]. Each head's
output is softmax(q . row * scale) . c over the request's keys, [B, H, LAT].

Split-K ("flash decoding"), grid (head blocks, B, S): a program takes BLOCK_H heads (every head
reads the same latent rows: one load of a key tile serves them all) and one of S equal chunks of
its request's keys, found through `page_table[row, pos]`; per key tile two dots give the scores
(latent and rotary parts) and one more the weighted sum of the latent. The chunk's normalised
output and base-2 log-sum-exp go to float32 scratch, which torch ops combine (no host sync: the
launch depends on B and S only). Float32 inputs use IEEE dots.

The torch attention backend calls it for latent decode steps on CUDA over a pool in the model
dtype or fp8_e4m3 (widened exactly to the model dtype as tiles load; `attention/torch_backend.py`);
the CPU and prefill keep its gather + SDPA.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit(do_not_specialize=["n_split"])
def _mla_decode_kernel(
    Q,
    KV,
    PageTable,
    Rows,
    SeqLens,
    MidO,
    MidLse,
    qk_scale,
    n_split,
    stride_qb,
    stride_qh,
    stride_kv,
    stride_pt,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    NUM_HEADS: tl.constexpr,
    LAT: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PRECISION: tl.constexpr,
):
    hb = tl.program_id(0)
    b = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(SeqLens + b).to(tl.int32)
    row = tl.load(Rows + b).to(tl.int64)
    split_len = tl.cdiv(seq_len, n_split)
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = heads < NUM_HEADS
    offs_l = tl.arange(0, BLOCK_L)
    mask_l = offs_l < LAT
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < ROPE
    q_base = Q + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh
    q_lat = tl.load(q_base + offs_l[None, :], mask=mask_h[:, None] & mask_l[None, :], other=0.0)
    q_rope = tl.load(q_base + LAT + offs_r[None, :], mask=mask_h[:, None] & mask_r[None, :], other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_L], dtype=tl.float32)
    pt_row = PageTable + row * stride_pt
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        slots = tl.load(pt_row + offs_n, mask=mask_n, other=0).to(tl.int64)
        kv_row = KV + slots[:, None] * stride_kv
        # (an fp8 pool widens exactly to the model dtype; a no-op otherwise)
        c = tl.load(kv_row + offs_l[None, :], mask=mask_n[:, None] & mask_l[None, :], other=0.0).to(Q.dtype.element_ty)
        k_pe = tl.load(kv_row + LAT + offs_r[None, :], mask=mask_n[:, None] & mask_r[None, :], other=0.0).to(Q.dtype.element_ty)
        qk = tl.dot(q_lat, tl.trans(c), input_precision=PRECISION)
        qk += tl.dot(q_rope, tl.trans(k_pe), input_precision=PRECISION)
        qk = tl.where(mask_n[None, :], qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision=PRECISION)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new

    has = l_i > 0.0  # an empty chunk (start >= seq_len) has weight 0, never NaN
    safe_l = tl.where(has, l_i, 1.0)
    o_ptr = MidO + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + split * stride_os + offs_l[None, :]
    tl.store(o_ptr, acc / safe_l[:, None], mask=mask_h[:, None] & mask_l[None, :])
    lse = tl.where(has, m_i + tl.log2(safe_l), float("-inf"))
    tl.store(MidLse + b.to(tl.int64) * stride_lb + heads * stride_lh + split, lse, mask=mask_h)


def num_splits_for(batch_size: int, max_len: int, num_sms: int, block_n: int = 32) -> int:
    """Chunks per request: about two programs per SM over the batch, at most one per key tile."""
    want = max(1, (2 * num_sms + batch_size - 1) // batch_size)
    return max(1, min(want, (max_len + block_n - 1) // block_n, 64))


def mla_decode(
    q: torch.Tensor,
    latent: torch.Tensor,
    page_table: torch.Tensor,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    v_dim: int,
    num_splits: int,
) -> torch.Tensor:
    """q [B, H, LAT + ROPE] (absorbed queries) over the latent pool `latent` [slots, 1, LAT + ROPE]
    (q's dtype or float8_e4m3fn) of the requests' page-table `rows` [B] and `seq_lens` [B] ->
    [B, H, v_dim (= LAT)] in q's dtype."""
    B, H, D = q.shape
    assert latent.shape[-1] == D and latent.stride(-1) == 1 and q.stride(-1) == 1 and 0 < v_dim < D
    rope = D - v_dim
    fp32 = q.dtype == torch.float32
    block_h = 16  # tl.dot needs >= 16 rows
    block_n = 32 if fp32 or v_dim > 256 else 64
    mid_o = torch.empty(B, H, num_splits, v_dim, dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(B, H, num_splits, dtype=torch.float32, device=q.device)
    kv = latent.reshape(latent.shape[0], D)
    grid = (triton.cdiv(H, block_h), B, num_splits)
    _mla_decode_kernel[grid](
        q, kv, page_table, rows, seq_lens, mid_o, mid_lse, sm_scale * LOG2E, num_splits,
        q.stride(0), q.stride(1), kv.stride(0), page_table.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        NUM_HEADS=H, LAT=v_dim, ROPE=rope, BLOCK_H=block_h, BLOCK_N=block_n,
        BLOCK_L=max(16, triton.next_power_of_2(v_dim)), BLOCK_R=max(16, triton.next_power_of_2(rope)),
        PRECISION="ieee" if fp32 else "tf32", num_warps=4 if v_dim <= 128 else 8, num_stages=2,
    )  # fmt: skip
    if num_splits == 1:
        return mid_o[:, :, 0].to(q.dtype)
    # combine the chunks by their log-sum-exp (base 2); empty chunks weigh 0
    top = mid_lse.amax(dim=-1, keepdim=True)
    w = torch.exp2(mid_lse - top)
    out = (mid_o * w.unsqueeze(-1)).sum(dim=2) / w.sum(dim=-1, keepdim=True)
    return out.to(q.dtype)
