"""Paged attention kernels in Triton (CUDA only; imported only when the triton backend is chosen).

The KV pool of one layer is `[num_slots, Hk, D]`; a request's keys are found through its page
table row: `page_table[row, pos]` is the pool slot of token `pos`. Because the table holds one
slot per token, the kernels work for any page size (a page is just `page_size` consecutive slots).

Decode (one query token per request) is split-K ("flash decoding"):
  stage 1, grid (B, Hk, S): each program takes one KV head, all the query heads that share it
      (GQA: the group is padded to 16 rows so the scores are one tensor-core dot) and one of the
      request's `num_splits[b]` chunks of its context; it writes the chunk's normalised output and
      its log-sum-exp (base 2) to float32 scratch.
  stage 2, grid (B, Hq): combines the chunks with their log-sum-exp weights.
The split count per request is chosen on the host (metadata), bounded by the grid's S, so the
launch shape depends only on the batch size: a CUDA graph captured per batch size replays it.

Extend/prefill, grid (B, Hq, query blocks): queries `[cached_len, device_len)` of a request
attend to keys `[0, position]` (causal with the cached-prefix offset), keys read from the pool
(this step's K/V are stored before attention runs). Blocks above the diagonal are skipped.

An fp8_e4m3 pool (kv_cache_dtype) is stored through `to_kv_cache` (the pool's reference bytes) and
widened exactly as tiles load: to the model dtype in extend, to fp16 in a bf16 model's decode.
Decode over fp8 with a GQA group of at most CC_MAX_GROUP runs a CUDA-core kernel instead of stage
1 (`_decode_cc_kernel`, same grid, same outputs): no tensor-core dot, whose operand layout change
costs per-byte shared-memory loads on an 8-bit tile.

All softmax arithmetic is float32 in base 2 (the scale is pre-multiplied by log2(e)). Float32
inputs use IEEE dots (not TF32) so float32 models match the reference exactly enough for greedy
comparisons.

Per-layer options (Gemma; ModelConfig.window_of, attn_logit_softcapping): a sliding window
`window` (NO_WINDOW: none) is a lower bound on the key range, position > q_pos - window (decode
splits [seq_len - window, seq_len) instead of [0, seq_len); an extend block starts at its first
query's bound and masks per row); SOFTCAP > 0 applies cap * tanh(s / cap) to each score s before
the softmax (a compile-time constant: a model without it runs the kernels it ran before).
Attention sinks (GPT-OSS, HAS_SINKS): a logit per query head added to the softmax denominator
where the softmax completes (exp2(sink * log2(e) - m) beside the running sum), weighing no value.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minisgl.kernel.pdl import launch_kwargs, pdl_for
from minisgl.utils.env import read_env

LOG2E = 1.4426950408889634
# Extends longer than this take 128-row query tiles (a 32k prompt in 8k chunks: 357 against 306
# TFLOP/s). At most the mixed-step graphs' default token cap, so a captured step and the same
# step run eagerly always pick the same tile.
LONG_EXTEND = 2048
# fp16 decode dots over an fp8 pool (see _decode_partial_kernel): q * 2^-4 keeps |q| < 2^20 finite
F16_Q_SCALE: tl.constexpr = tl.constexpr(0.0625)
# Decode over an fp8 pool in a bf16 model runs fp16 dots (q scaled by F16_Q_SCALE): widening to
# bf16 with bf16 dots measured slower (docs/PERFORMANCE.md, "Decode over fp8 runs its dots in fp16").
# Which decode kernel reads an fp8 pool in a 16-bit model: the CUDA-core kernel (_decode_cc_kernel)
# for GQA groups of at most CC_MAX_GROUP, the tensor-core kernel otherwise ("auto"). Not a user
# switch: the kernel tests set "dot" or "cc" here to run either kernel at any group.
# (The tensor-core kernel reading the pool as int32 words, widened before the layout change, was
# measured and dropped; docs/PERFORMANCE.md.)
FP8_DECODE = "auto"
# The CUDA-core kernel wins at groups 1 and 2 and loses from 4 on (H200, docs/PERFORMANCE.md): its
# arithmetic grows with the group, the padded dot's does not.
CC_MAX_GROUP = 2
# the CUDA-core kernel's tile: (keys per tile, num_warps) and its page-table / K-V prefetch depth
# (see _decode_cc_kernel), whatever the batch: a mixed step's decode rows and a graph replay take
# the same tile. tools/kv_fp8_sweep.py sets them.
CC_TILE = (64, 4)
CC_PREFETCH = 2
# Triton's interpreter runs no inline PTX: the CUDA-core kernel widens fp8 from the bits there
_INTERPRET = read_env().triton_interpret
LOG2E_C: tl.constexpr = tl.constexpr(LOG2E)  # (what the kernels may read of it)
# the `window` of a layer without one: every position is > q_pos - NO_WINDOW (int32-safe)
NO_WINDOW = 1 << 30


# (SOFTCAP > 0: each kernel applies cap * tanh(s / cap) to its scores, which it holds as
# s * log2(e), the base-2 softmax's: cap2 * tanh(x / cap2) with cap2 = cap * log2(e); tanh as
# 2 sigmoid(2y) - 1, which the interpreter runs too (it has no libdevice): ~1e-7 absolute)


@triton.jit
def _decode_partial_kernel(
    Q,
    K,
    V,
    PageTable,
    Rows,
    SeqLens,
    NumSplits,
    Order,
    MidO,
    MidLse,
    qk_scale,
    window,
    stride_qt,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_pt,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    Sinks,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
    DIRECT: tl.constexpr,
    HAS_ORDER: tl.constexpr,
    USE_PDL: tl.constexpr = False,
    F16_DOT: tl.constexpr = False,
    SOFTCAP: tl.constexpr = 0.0,
    HAS_SINKS: tl.constexpr = False,
    Trans=None,  # (always passed) [main slots] int64: the page table's slot -> a K/V slot (a hybrid pool's sliding layer; read with HAS_TRANS)
    HAS_TRANS: tl.constexpr = False,
):
    if USE_PDL:  # minisgl/kernel/pdl.py: every program waits for the prologue's K/V and q
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    # Heads vary fastest in the grid and requests come in `Order` (longest first): programs start
    # in grid order, so the longest sequences start first and the short ones fill the tail
    # (longest-processing-time-first; with mixed lengths a long request started last would
    # otherwise leave most SMs idle at the end of the kernel).
    kvh = tl.program_id(0)
    if HAS_ORDER:
        b = tl.load(Order + tl.program_id(1)).to(tl.int32)
    else:
        b = tl.program_id(1)
    split = tl.program_id(2)
    n_split = tl.load(NumSplits + b).to(tl.int32)
    if split < n_split:
        seq_len = tl.load(SeqLens + b).to(tl.int32)
        row = tl.load(Rows + b).to(tl.int64)
        lo = tl.maximum(seq_len - window, 0)  # the query (position seq_len - 1) sees keys >= lo
        split_len = tl.cdiv(seq_len - lo, n_split)
        start = lo + split * split_len
        end = tl.minimum(start + split_len, seq_len)

        offs_h = tl.arange(0, BLOCK_H)
        mask_h = offs_h < GROUP
        heads = kvh * GROUP + offs_h
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < HEAD_DIM
        q = tl.load(
            Q + b.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
            mask=mask_h[:, None] & mask_d[None, :],
            other=0.0,
        )
        # fp8 pool, bf16 model: the dots run in fp16, which e4m3 widens to in one instruction per
        # two values (to bf16 it takes three and a shared-memory detour); q is scaled by an exact
        # power of two into fp16's range (qk_scale carries it back), p in [0, 1] fits as it is
        kdt = tl.float16 if F16_DOT else Q.dtype.element_ty
        if F16_DOT:
            q = (q.to(tl.float32) * F16_Q_SCALE).to(tl.float16)

        m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
        pt_row = PageTable + row * stride_pt
        for n0 in range(start, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < end
            slots = tl.load(pt_row + offs_n, mask=mask_n, other=0).to(tl.int64)
            if HAS_TRANS:
                slots = tl.load(Trans + slots, mask=mask_n, other=0)
            kv_mask = mask_n[:, None] & mask_d[None, :]
            k = tl.load(K + slots[:, None] * stride_ks + kvh * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
            k = k.to(kdt)  # fp8 pool: exact widening (no-op otherwise)
            qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
            if SOFTCAP > 0:
                qk = (SOFTCAP * LOG2E_C) * (2.0 * tl.sigmoid(qk * (2.0 / (SOFTCAP * LOG2E_C))) - 1.0)
            qk = tl.where(mask_n[None, :], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            p = tl.exp2(qk - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            v = tl.load(V + slots[:, None] * stride_vs + kvh * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
            v = v.to(kdt)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            l_i = l_i * alpha + tl.sum(p, 1)
            m_i = m_new

        if DIRECT and HAS_SINKS:  # the whole softmax is here: the sink joins its denominator
            sink = tl.load(Sinks + heads, mask=mask_h, other=0.0).to(tl.float32) * LOG2E_C
            l_i += tl.exp2(sink - m_i)
        has = l_i > 0.0  # an empty chunk (start >= seq_len) contributes weight 0, never NaN
        safe_l = tl.where(has, l_i, 1.0)
        out = acc / safe_l[:, None]
        if DIRECT:  # one chunk per request (the grid has one split): this is the final output
            o_ptr = MidO + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
            tl.store(o_ptr, out.to(MidO.dtype.element_ty), mask=mask_h[:, None] & mask_d[None, :])
        else:
            lse = tl.where(has, m_i + tl.log2(safe_l), float("-inf"))
            o_ptr = MidO + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + split * stride_os + offs_d[None, :]
            tl.store(o_ptr, out, mask=mask_h[:, None] & mask_d[None, :])
            tl.store(MidLse + b.to(tl.int64) * stride_lb + heads * stride_lh + split, lse, mask=mask_h)


@triton.jit
def _e4m3x4_to_f32(w, ASM: tl.constexpr):
    """The four float32 values of int32 words of four e4m3 bytes (byte j is element 4i + j).

    ASM (GPU): two `cvt.rn.f16x2.e4m3x2` per word, then fp16 -> fp32, on the word as loaded (Triton's
    own fp8 cast unpacks the bytes and re-packs pairs: ~2x the instructions). Otherwise (Triton's
    interpreter runs no PTX) the same exact values from the bits; an e4m3 NaN byte (never stored:
    the pool saturates) would read as 480 there."""
    if ASM:
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .b16 lo, hi, a0, a1, b0, b1;
            .reg .b32 a, b;
            mov.b32 {lo, hi}, $4;
            cvt.rn.f16x2.e4m3x2 a, lo;
            cvt.rn.f16x2.e4m3x2 b, hi;
            mov.b32 {a0, a1}, a;
            mov.b32 {b0, b1}, b;
            cvt.f32.f16 $0, a0;
            cvt.f32.f16 $1, a1;
            cvt.f32.f16 $2, b0;
            cvt.f32.f16 $3, b1;
            }""",
            constraints="=f,=f,=f,=f,r",
            args=[w],
            dtype=(tl.float32, tl.float32, tl.float32, tl.float32),
            is_pure=True,
            pack=1,
        )
    else:
        return _e4m3_bits(w, 0), _e4m3_bits(w, 8), _e4m3_bits(w, 16), _e4m3_bits(w, 24)


@triton.jit
def _e4m3_bits(w, shift: tl.constexpr):
    byte = (w >> shift) & 255
    e = (byte >> 3) & 15
    m = (byte & 7).to(tl.float32)
    mag = tl.where(e == 0, m * 0.001953125, (m + 8.0) * tl.exp2((e - 10).to(tl.float32)))  # subnormal: m * 2^-9
    return tl.where(byte >= 128, -mag, mag)


@triton.jit
def _decode_cc_kernel(
    Q,
    K,
    V,
    PageTable,
    Rows,
    SeqLens,
    NumSplits,
    Order,
    MidO,
    MidLse,
    qk_scale,
    window,
    stride_qt,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_pt,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    KEYS: tl.constexpr,
    STREAMS: tl.constexpr,
    BLOCK_W: tl.constexpr,
    DIRECT: tl.constexpr,
    HAS_ORDER: tl.constexpr,
    USE_PDL: tl.constexpr = False,
    PREFETCH: tl.constexpr = 2,
    ASM: tl.constexpr = True,
    SOFTCAP: tl.constexpr = 0.0,
):
    """Decode over an fp8 pool on CUDA cores, for small GQA groups (no tl.dot: a group of 2 would
    pad to 16 rows, and the dot operands' layout change costs per-byte shared-memory loads).

    K/V are read as int32 words (4 e4m3 values; the pool viewed as int32, strides in words). A
    tile is [heads, STREAMS, KEYS, words]: 8 lanes cover a key's D (4 words = 16 bytes each, one
    16-byte load), 4 lanes x num_warps cover STREAMS, KEYS repeat in registers. Each stream keeps
    its own online softmax (m, l, acc), so the max and the PV sum of a tile never leave the
    thread; only q.k reduces over D (3 butterfly shuffles). D is kept as 4 interleaved parts
    (element 4i + j in part j), q and the outputs likewise. The tile never changes layout: nothing
    goes through shared memory in the loop. The streams are combined once at the end.
    """
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    kvh = tl.program_id(0)
    if HAS_ORDER:
        b = tl.load(Order + tl.program_id(1)).to(tl.int32)
    else:
        b = tl.program_id(1)
    split = tl.program_id(2)
    n_split = tl.load(NumSplits + b).to(tl.int32)
    if split < n_split:
        seq_len = tl.load(SeqLens + b).to(tl.int32)
        row = tl.load(Rows + b).to(tl.int64)
        lo = tl.maximum(seq_len - window, 0)  # the query (position seq_len - 1) sees keys >= lo
        split_len = tl.cdiv(seq_len - lo, n_split)
        start = lo + split * split_len
        end = tl.minimum(start + split_len, seq_len)
        BLOCK_N: tl.constexpr = KEYS * STREAMS

        offs_h = tl.arange(0, BLOCK_H)[:, None, None, None]
        heads = kvh * GROUP + offs_h
        offs_w = tl.arange(0, BLOCK_W)[None, None, None, :]
        mask_w = offs_w < HEAD_DIM // 4
        # key n0 + r * STREAMS + s of a tile goes to stream s (dim 1), register r (dim 2)
        offs_s = tl.arange(0, STREAMS)
        offs_r = tl.arange(0, KEYS)
        offs_t = offs_s[None, :, None, None] + offs_r[None, None, :, None] * STREAMS
        offs_t3 = offs_s[None, :, None] + offs_r[None, None, :] * STREAMS
        q_ptr = Q + b.to(tl.int64) * stride_qt + heads * stride_qh + 4 * offs_w
        q_mask = (offs_h < GROUP) & mask_w
        # the scale is folded into q: one multiply per q value, not per score
        q0 = tl.load(q_ptr, mask=q_mask, other=0.0).to(tl.float32) * qk_scale
        q1 = tl.load(q_ptr + 1, mask=q_mask, other=0.0).to(tl.float32) * qk_scale
        q2 = tl.load(q_ptr + 2, mask=q_mask, other=0.0).to(tl.float32) * qk_scale
        q3 = tl.load(q_ptr + 3, mask=q_mask, other=0.0).to(tl.float32) * qk_scale
        m_i = tl.full([BLOCK_H, STREAMS], -1.0e30, dtype=tl.float32)  # finite: an empty stream never NaNs
        l_i = tl.zeros([BLOCK_H, STREAMS], dtype=tl.float32)
        acc0 = tl.zeros([BLOCK_H, STREAMS, 1, BLOCK_W], dtype=tl.float32)
        acc1 = tl.zeros([BLOCK_H, STREAMS, 1, BLOCK_W], dtype=tl.float32)
        acc2 = tl.zeros([BLOCK_H, STREAMS, 1, BLOCK_W], dtype=tl.float32)
        acc3 = tl.zeros([BLOCK_H, STREAMS, 1, BLOCK_W], dtype=tl.float32)
        pt_row = PageTable + row * stride_pt
        k_base = K + kvh * stride_kh + offs_w
        v_base = V + kvh * stride_vh + offs_w

        # PREFETCH 1: tile i + 1's K/V loads are issued before tile i's arithmetic; 2: and its page
        # table entries one tile earlier still (the K/V addresses wait on them, in-order issue)
        if PREFETCH >= 1:
            slots = tl.load(pt_row + start + offs_t, mask=start + offs_t < end, other=0).to(tl.int64)
            kw_nxt = tl.load(k_base + slots * stride_ks, mask=mask_w, other=0)
            vw_nxt = tl.load(v_base + slots * stride_vs, mask=mask_w, other=0)
            if PREFETCH == 2:
                nxt = start + BLOCK_N + offs_t
                slots = tl.load(pt_row + nxt, mask=nxt < end, other=0).to(tl.int64)
        for n0 in range(start, end, BLOCK_N):
            if PREFETCH >= 1:
                kw = kw_nxt
                vw = vw_nxt
                nxt = n0 + BLOCK_N + offs_t
                if PREFETCH == 1:
                    slots = tl.load(pt_row + nxt, mask=nxt < end, other=0).to(tl.int64)
                kw_nxt = tl.load(k_base + slots * stride_ks, mask=(nxt < end) & mask_w, other=0)
                vw_nxt = tl.load(v_base + slots * stride_vs, mask=(nxt < end) & mask_w, other=0)
                if PREFETCH == 2:
                    nxt2 = nxt + BLOCK_N
                    slots = tl.load(pt_row + nxt2, mask=nxt2 < end, other=0).to(tl.int64)
            else:
                cur = n0 + offs_t
                slots = tl.load(pt_row + cur, mask=cur < end, other=0).to(tl.int64)
                kw = tl.load(k_base + slots * stride_ks, mask=(cur < end) & mask_w, other=0)
                vw = tl.load(v_base + slots * stride_vs, mask=(cur < end) & mask_w, other=0)
            k0, k1, k2, k3 = _e4m3x4_to_f32(kw, ASM)
            qk = tl.sum(q0 * k0 + q1 * k1 + q2 * k2 + q3 * k3, axis=3)  # [H, STREAMS, KEYS]
            if SOFTCAP > 0:
                qk = (SOFTCAP * LOG2E_C) * (2.0 * tl.sigmoid(qk * (2.0 / (SOFTCAP * LOG2E_C))) - 1.0)
            qk = tl.where(n0 + offs_t3 < end, qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, axis=2))
            p3 = tl.exp2(qk - m_new[:, :, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p3, axis=2)
            p = p3[:, :, :, None]
            m_i = m_new
            a4 = alpha[:, :, None, None]
            v0, v1, v2, v3 = _e4m3x4_to_f32(vw, ASM)
            acc0 = acc0 * a4 + tl.sum(p * v0, axis=2, keep_dims=True)
            acc1 = acc1 * a4 + tl.sum(p * v1, axis=2, keep_dims=True)
            acc2 = acc2 * a4 + tl.sum(p * v2, axis=2, keep_dims=True)
            acc3 = acc3 * a4 + tl.sum(p * v3, axis=2, keep_dims=True)

        # combine the streams (once per program: the only cross-warp reduction)
        m = tl.max(m_i, axis=1)  # [H]
        wt = tl.exp2(m_i - m[:, None])
        l_sum = tl.sum(l_i * wt, axis=1)
        has = l_sum > 0.0  # an empty chunk (start >= seq_len) contributes weight 0, never NaN
        safe_l = tl.where(has, l_sum, 1.0)
        wt4 = (wt / safe_l[:, None])[:, :, None, None]
        o_ptr = MidO + b.to(tl.int64) * stride_ob + heads * stride_oh + 4 * offs_w
        if not DIRECT:
            o_ptr += split * stride_os
        odt = MidO.dtype.element_ty
        tl.store(o_ptr, tl.sum(acc0 * wt4, axis=1, keep_dims=True).to(odt), mask=q_mask)
        tl.store(o_ptr + 1, tl.sum(acc1 * wt4, axis=1, keep_dims=True).to(odt), mask=q_mask)
        tl.store(o_ptr + 2, tl.sum(acc2 * wt4, axis=1, keep_dims=True).to(odt), mask=q_mask)
        tl.store(o_ptr + 3, tl.sum(acc3 * wt4, axis=1, keep_dims=True).to(odt), mask=q_mask)
        if not DIRECT:
            lse = tl.where(has, m + tl.log2(safe_l), float("-inf"))
            hh = kvh * GROUP + tl.arange(0, BLOCK_H)
            tl.store(MidLse + b.to(tl.int64) * stride_lb + hh * stride_lh + split, lse, mask=tl.arange(0, BLOCK_H) < GROUP)


@triton.jit
def _decode_reduce_kernel(
    MidO,
    MidLse,
    NumSplits,
    Out,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    stride_outt,
    stride_outh,
    Sinks,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr = False,
    HAS_SINKS: tl.constexpr = False,
):
    if USE_PDL:  # wait for the partial results (minisgl/kernel/pdl.py)
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    b = tl.program_id(0)
    h = tl.program_id(1)
    n_split = tl.load(NumSplits + b).to(tl.int32)
    offs_s = tl.arange(0, BLOCK_S)
    mask_s = offs_s < n_split
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    lse = tl.load(MidLse + b.to(tl.int64) * stride_lb + h * stride_lh + offs_s, mask=mask_s, other=float("-inf"))
    m = tl.max(lse, 0)  # chunk 0 is never empty: finite
    w = tl.exp2(lse - m)
    o = tl.load(
        MidO + b.to(tl.int64) * stride_ob + h * stride_oh + offs_s[:, None] * stride_os + offs_d[None, :],
        mask=mask_s[:, None] & mask_d[None, :],
        other=0.0,
    )
    denom = tl.sum(w, 0)
    if HAS_SINKS:  # the sink's weight on the same scale, exp2(sink * log2(e) - m)
        denom += tl.exp2(tl.load(Sinks + h).to(tl.float32) * LOG2E_C - m)
    out = tl.sum(o * w[:, None], 0) / denom
    tl.store(Out + b.to(tl.int64) * stride_outt + h * stride_outh + offs_d, out.to(Out.dtype.element_ty), mask=mask_d)


@triton.jit
def _extend_kernel(
    Q,
    K,
    V,
    Out,
    PageTable,
    Rows,
    QStart,
    CachedLens,
    ExtendLens,
    qk_scale,
    window,
    stride_qt,
    stride_qh,
    stride_outt,
    stride_outh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_pt,
    Sinks,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
    HEAVY_FIRST: tl.constexpr = False,
    SOFTCAP: tl.constexpr = 0.0,
    HAS_SINKS: tl.constexpr = False,
    Trans=None,  # (always passed) as the decode kernel's
    HAS_TRANS: tl.constexpr = False,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    # A query block's work grows with its position (causal): with HEAVY_FIRST the last blocks,
    # which see the most keys, start first and the light ones fill the tail of the launch.
    if HEAVY_FIRST:
        mb = tl.num_programs(2) - 1 - tl.program_id(2)
    else:
        mb = tl.program_id(2)
    ext = tl.load(ExtendLens + b).to(tl.int32)
    if mb * BLOCK_M < ext:
        cached = tl.load(CachedLens + b).to(tl.int32)
        q0 = tl.load(QStart + b).to(tl.int64)
        row = tl.load(Rows + b).to(tl.int64)
        kvh = h // GROUP

        offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_m = offs_m < ext
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < HEAD_DIM
        tok = q0 + offs_m
        q = tl.load(
            Q + tok[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
            mask=mask_m[:, None] & mask_d[None, :],
            other=0.0,
        )
        q_pos = cached + offs_m
        kv_end = cached + tl.minimum((mb + 1) * BLOCK_M, ext)  # keys past the block's last query are masked anyway

        # the block's first query sees keys > its position - window: no earlier key block is read
        kv_start = tl.maximum(cached + mb * BLOCK_M - window + 1, 0)
        # finite: with a window a row may see no key of the first block read (-inf - -inf is NaN);
        # without one key 0 is visible to every row and this changes no bit
        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        pt_row = PageTable + row * stride_pt
        for n0 in range(kv_start, kv_end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < kv_end
            slots = tl.load(pt_row + offs_n, mask=mask_n, other=0).to(tl.int64)
            if HAS_TRANS:
                slots = tl.load(Trans + slots, mask=mask_n, other=0)
            kv_mask = mask_n[:, None] & mask_d[None, :]
            k = tl.load(K + slots[:, None] * stride_ks + kvh * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
            k = k.to(Q.dtype.element_ty)  # fp8 pool: exact widening to the model dtype (no-op otherwise)
            qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
            if SOFTCAP > 0:
                qk = (SOFTCAP * LOG2E_C) * (2.0 * tl.sigmoid(qk * (2.0 / (SOFTCAP * LOG2E_C))) - 1.0)
            visible = (offs_n[None, :] <= q_pos[:, None]) & (offs_n[None, :] > q_pos[:, None] - window) & mask_n[None, :]
            qk = tl.where(visible, qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            p = tl.exp2(qk - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            v = tl.load(V + slots[:, None] * stride_vs + kvh * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
            v = v.to(Q.dtype.element_ty)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            l_i = l_i * alpha + tl.sum(p, 1)
            m_i = m_new

        if HAS_SINKS:
            l_i += tl.exp2(tl.load(Sinks + h).to(tl.float32) * LOG2E_C - m_i)
        out = acc / l_i[:, None]
        tl.store(
            Out + tok[:, None] * stride_outt + h * stride_outh + offs_d[None, :],
            out.to(Out.dtype.element_ty),
            mask=mask_m[:, None] & mask_d[None, :],
        )


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def decode_tile(batch_size: int, dtype: torch.dtype) -> int:
    """BLOCK_N for decode. Measured on the H200 (Qwen3-0.6B heads, tools/tune_triton_attention.py):
    128-token tiles win at batch >= 128 and for long chunks at small batch, 64 in between."""
    if dtype == torch.float32:
        return 32
    return 64 if 16 < batch_size < 128 else 128


def use_cc_decode(q_dtype: torch.dtype, kv_dtype: torch.dtype, group: int, head_dim: int) -> bool:
    """Whether decode runs the CUDA-core kernel (fp8 pool, 16-bit model, small GQA group)."""
    if kv_dtype != torch.float8_e4m3fn or q_dtype not in (torch.bfloat16, torch.float16) or head_dim % 16:
        return False
    return FP8_DECODE == "cc" or (FP8_DECODE == "auto" and group <= CC_MAX_GROUP)


def _decode_cc(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    num_splits: torch.Tensor,
    order: torch.Tensor | None,
    dst: torch.Tensor,
    dst_strides: tuple[int, int, int],
    mid_lse: torch.Tensor,
    sm_scale: float,
    pdl: bool,
    window: int,
    softcap: float,
) -> None:
    B, Hq, D = q.shape
    Hk = k_cache.shape[1]
    group = Hq // Hk
    S = mid_lse.shape[2]
    block_n, num_warps = CC_TILE
    lanes_d = min(32, triton.next_power_of_2(D) // 16)  # 16 bytes (4 words) per lane across D
    streams = 32 // lanes_d * num_warps
    keys = max(1, block_n // streams)
    # the pool as int32 words of 4 e4m3 values (slot and head strides in words); the interpreter
    # keeps the fp8 view and widens from bits (the same int32 words, read through a bitcast)
    kw, vw = k_cache.view(torch.int32), v_cache.view(torch.int32)
    _decode_cc_kernel[(Hk, B, S)](
        q, kw, vw, page_table, rows, seq_lens, num_splits, rows if order is None else order, dst, mid_lse,
        sm_scale * LOG2E, window,
        q.stride(0), q.stride(1),
        kw.stride(0), kw.stride(1), vw.stride(0), vw.stride(1),
        page_table.stride(0),
        *dst_strides,
        mid_lse.stride(0), mid_lse.stride(1),
        GROUP=group, HEAD_DIM=D, BLOCK_H=triton.next_power_of_2(group), KEYS=keys, STREAMS=streams,
        BLOCK_W=triton.next_power_of_2(D) // 4, DIRECT=S == 1, HAS_ORDER=order is not None, USE_PDL=pdl,
        PREFETCH=CC_PREFETCH, ASM=not _INTERPRET, SOFTCAP=softcap, num_warps=num_warps, num_stages=1,
        **launch_kwargs(pdl),
    )  # fmt: skip


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    num_splits: torch.Tensor,
    mid_o: torch.Tensor,
    mid_lse: torch.Tensor,
    out: torch.Tensor,
    sm_scale: float,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int | None = None,
    order: torch.Tensor | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    translation: torch.Tensor | None = None,
) -> None:
    """q/out: [B, Hq, D]; k/v_cache: [slots, Hk, D]; rows/seq_lens/num_splits: [B];
    order: [B] the batch rows in the order their programs should start (longest first), or None;
    mid_o: [B, Hq, S, D] float32, mid_lse: [B, Hq, S] float32 (S = the grid's split bound).
    With S == 1 the first stage writes `out` directly and the scratch is not touched.
    block_n / num_warps / num_stages are the tensor-core kernel's; the CUDA-core one (an fp8 pool,
    `use_cc_decode`) takes CC_TILE. window: the layer's sliding window (None: none); softcap: the
    score soft-cap (None: none); sinks: [Hq] attention sinks (None: none; read as float32), which join the
    denominator where the softmax completes (the direct first stage or the reduce; the CUDA-core
    fp8 kernel has no sinks: the tensor-core one runs then); translation: [main slots] int64, the
    page table's slot -> a slot of k/v_cache (a hybrid pool's sliding layer, kvcache/window.py; the
    CUDA-core fp8 kernel has none: the tensor-core one runs then)."""
    B, Hq, D = q.shape
    Hk = k_cache.shape[1]
    group = Hq // Hk
    S = mid_o.shape[2]
    block_d = max(16, triton.next_power_of_2(D))  # tl.dot needs an inner dim >= 16
    fp32 = q.dtype == torch.float32
    if block_n is None:
        block_n = decode_tile(B, q.dtype)
    if num_stages is None:
        num_stages = 2 if fp32 else 3
    direct = S == 1
    pdl = pdl_for(B)
    f16_dot = k_cache.dtype == torch.float8_e4m3fn and q.dtype == torch.bfloat16
    dst = out if direct else mid_o
    dst_strides = (out.stride(0), out.stride(1), 0) if direct else (mid_o.stride(0), mid_o.stride(1), mid_o.stride(2))
    win, cap = window if window is not None else NO_WINDOW, float(softcap or 0.0)
    has_sinks = sinks is not None
    sinks_arg = sinks if sinks is not None else mid_lse  # (a pointer the kernels never read)
    if use_cc_decode(q.dtype, k_cache.dtype, group, D) and not has_sinks and translation is None:
        _decode_cc(q, k_cache, v_cache, page_table, rows, seq_lens, num_splits, order, dst, dst_strides, mid_lse,
                   sm_scale, pdl, win, cap)  # fmt: skip
    else:
        _decode_partial_kernel[(Hk, B, S)](
            q, k_cache, v_cache, page_table, rows, seq_lens, num_splits, rows if order is None else order, dst, mid_lse,
            sm_scale * LOG2E / (F16_Q_SCALE.value if f16_dot else 1.0), win,
            q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
            page_table.stride(0),
            *dst_strides,
            mid_lse.stride(0), mid_lse.stride(1), sinks_arg,
            GROUP=group, HEAD_DIM=D, BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n,
            BLOCK_D=block_d, PRECISION=_precision(q.dtype), DIRECT=direct, HAS_ORDER=order is not None,
            USE_PDL=pdl, F16_DOT=f16_dot, SOFTCAP=cap, HAS_SINKS=has_sinks, Trans=rows if translation is None else translation,
            HAS_TRANS=translation is not None, num_warps=num_warps, num_stages=num_stages, **launch_kwargs(pdl),
        )  # fmt: skip
    if direct:
        return
    _decode_reduce_kernel[(B, Hq)](
        mid_o, mid_lse, num_splits, out,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1), sinks_arg,
        HEAD_DIM=D, BLOCK_S=max(2, triton.next_power_of_2(S)), BLOCK_D=block_d, USE_PDL=pdl, HAS_SINKS=has_sinks,
        num_warps=4 if fp32 or block_d >= 128 else 2, **launch_kwargs(pdl),
    )  # fmt: skip


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    rows: torch.Tensor,
    q_start: torch.Tensor,
    cached_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    max_extend_len: int,
    out: torch.Tensor,
    sm_scale: float,
    config: tuple[int, int, int, int] | None = None,
    heavy_first: bool = True,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    translation: torch.Tensor | None = None,
) -> None:
    """q/out: [T, Hq, D] (requests' new tokens back to back); per-request [B] metadata.
    config: (BLOCK_M, BLOCK_N, num_warps, num_stages) to override the default tiles;
    heavy_first: start the query blocks nearest the end of each chunk first (see the kernel);
    window / softcap / sinks / translation: as decode_attention's."""
    T, Hq, D = q.shape
    B = rows.shape[0]
    Hk = k_cache.shape[1]
    block_d = max(16, triton.next_power_of_2(D))  # tl.dot needs an inner dim >= 16
    fp32 = q.dtype == torch.float32
    if config is not None:
        block_m, block_n, warps, stages = config
    elif fp32 or block_d > 128:
        block_m, block_n, warps, stages = 32, 32, 4, 2
    elif max_extend_len > LONG_EXTEND:  # long chunks: benchmark/long_context.py's sweep (H200)
        block_m, block_n, warps, stages = 128, 64, 4, 3
    else:  # measured best of the sweep in tools/tune_triton_attention.py (H200)
        block_m, block_n, warps, stages = 64, 64, 4, 3
    grid = (B, Hq, triton.cdiv(max_extend_len, block_m))
    _extend_kernel[grid](
        q, k_cache, v_cache, out, page_table, rows, q_start, cached_lens, extend_lens,
        sm_scale * LOG2E, window if window is not None else NO_WINDOW,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        page_table.stride(0), sinks if sinks is not None else q,
        GROUP=Hq // Hk, HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        PRECISION=_precision(q.dtype), HEAVY_FIRST=heavy_first, SOFTCAP=float(softcap or 0.0), HAS_SINKS=sinks is not None,
        Trans=rows if translation is None else translation, HAS_TRANS=translation is not None, num_warps=warps,
        num_stages=stages,
    )  # fmt: skip


@triton.jit
def to_kv_cache(x, dtype: tl.constexpr):
    """`x` (model dtype) as the pool stores it. fp8: the pool's reference store (kvcache/pool.py),
    widen to float32, saturate at +-448 (e4m3fn has no infinity: an overflow would be NaN), round to
    nearest; bitwise the same bytes as `KVCachePool._store_quantized`."""
    if dtype == tl.float8e4nv:
        return tl.clamp(x.to(tl.float32), -448.0, 448.0).to(dtype)
    else:
        return x.to(dtype)


@triton.jit
def _store_kv_kernel(
    K, V, KCache, VCache, Loc,
    stride_kt, stride_vt, stride_kcs, stride_vcs,
    N: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    slot = tl.load(Loc + t).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    k = tl.load(K + t.to(tl.int64) * stride_kt + offs, mask=mask)
    tl.store(KCache + slot * stride_kcs + offs, to_kv_cache(k, KCache.dtype.element_ty), mask=mask)
    v = tl.load(V + t.to(tl.int64) * stride_vt + offs, mask=mask)
    tl.store(VCache + slot * stride_vcs + offs, to_kv_cache(v, VCache.dtype.element_ty), mask=mask)


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out_loc: torch.Tensor) -> None:
    """One launch for both K and V (the torch fallback takes three): k/v [T, Hk, D] -> pool slots.
    A float8_e4m3fn cache stores what the pool's reference fp8 store stores (`to_kv_cache`)."""
    T, Hk, D = k.shape
    if k.stride(2) != 1 or k.stride(1) != D:
        k = k.contiguous()
    if v.stride(2) != 1 or v.stride(1) != D:
        v = v.contiguous()
    if T == 0:
        return
    n = Hk * D
    _store_kv_kernel[(T,)](
        k, v, k_cache, v_cache, out_loc, k.stride(0), v.stride(0), k_cache.stride(0), v_cache.stride(0),
        N=n, BLOCK=triton.next_power_of_2(n), num_warps=4 if n >= 1024 else 2,
    )  # fmt: skip
