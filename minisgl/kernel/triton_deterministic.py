"""Batch-invariant paged attention on CUDA (`--deterministic`): one program per (query token,
query head) walks that query's keys in BLOCK-position blocks from position 0, in order, with an
online softmax in fp32. Nothing a program computes depends on the grid (how many queries share
the launch, how the prompt was chunked, whether its prefix was cached), and the block sizes are
compile-time constants, so a query gets the same bits in a decode step and in a prefill. Each
program walks the blocks from the first one its window reaches to the one holding its own
position, bounds it reads from its own position: nothing comes from the host, so a CUDA graph
replays the launch for any lengths. (A block wholly outside a query's keys would be an exact
no-op anyway: its scores are -inf, it adds 0 and rescales by exp(0) = 1.) Slower than the split-K
kernels (no key reuse across queries), which is the price of the mode.
A sliding window (`window`) and soft-capping (SOFTCAP) only mask positions and bend scores, as in
the torch version (attention/deterministic_backend.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 64
NO_WINDOW = 1 << 30  # the `window` of a layer without one


@triton.jit
def _deterministic_attention_kernel(
    q_ptr,  # [T, Hq, D]
    k_ptr,  # [slots, Hk, D]
    v_ptr,
    o_ptr,  # [T, Hq, D]
    page_table_ptr,  # [rows, width] int32 slot of each position
    rows_ptr,  # [T] int64
    positions_ptr,  # [T] int64
    sm_scale,
    window,
    stride_qt,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_pt,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SOFTCAP: tl.constexpr = 0.0,
    Trans=None,  # (always passed) [main slots] int64: main slot -> window slot (a hybrid pool's sliding layer; read with HAS_TRANS)
    HAS_TRANS: tl.constexpr = False,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    kv_h = h // GROUP
    row = tl.load(rows_ptr + t).to(tl.int64)
    pos = tl.load(positions_ptr + t).to(tl.int32)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + t * stride_qt + h * stride_qh + d, mask=d_ok, other=0.0).to(tl.float32) * sm_scale
    m = tl.full((), -1.0e30, tl.float32)  # finite: blocks before the window are no-ops
    denom = tl.zeros((), tl.float32)
    acc = tl.zeros((BLOCK_D,), tl.float32)
    offs = tl.arange(0, BLOCK_N)
    first = tl.maximum(pos - window + 1, 0) // BLOCK_N
    for j in range(first, pos // BLOCK_N + 1):
        cols = j * BLOCK_N + offs
        valid = (cols <= pos) & (cols > pos - window)
        slots = tl.load(page_table_ptr + row * stride_pt + cols, mask=valid, other=0).to(tl.int64)
        if HAS_TRANS:
            slots = tl.load(Trans + slots, mask=valid, other=0)
        k = tl.load(k_ptr + slots[:, None] * stride_ks + kv_h * stride_kh + d[None, :], mask=valid[:, None] & d_ok[None, :], other=0.0)
        scores = tl.sum(k.to(tl.float32) * q[None, :], axis=1)
        if SOFTCAP > 0:
            scores = SOFTCAP * (2.0 * tl.sigmoid(scores * (2.0 / SOFTCAP)) - 1.0)  # tanh (the interpreter has no libdevice)
        scores = tl.where(valid, scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=0))
        p = tl.exp(scores - m_new)
        scale = tl.exp(m - m_new)
        v = tl.load(v_ptr + slots[:, None] * stride_vs + kv_h * stride_vh + d[None, :], mask=valid[:, None] & d_ok[None, :], other=0.0)
        denom = denom * scale + tl.sum(p, axis=0)
        acc = acc * scale + tl.sum(p[:, None] * v.to(tl.float32), axis=0)
        m = m_new
    out = acc / denom
    tl.store(o_ptr + t * stride_ot + h * stride_oh + d, out.to(o_ptr.dtype.element_ty), mask=d_ok)


def deterministic_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    rows: torch.Tensor,
    positions: torch.Tensor,
    sm_scale: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
    translation: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [T, Hq, D]; k/v_cache: [slots, Hk, D]; rows/positions: [T]. Returns [T, Hq, D].
    translation: the page table's slot -> a slot of k/v_cache (a hybrid pool's sliding layer).
    sm_scale: None = head_dim^-0.5; window: the layer's sliding
    window (None: none); softcap: the score soft-cap (None: none)."""
    num_tokens, hq, head_dim = q.shape
    hk = k_cache.shape[1]
    out = torch.empty_like(q)
    if num_tokens == 0:
        return out
    _deterministic_attention_kernel[(num_tokens, hq)](
        q, k_cache, v_cache, out, page_table, rows, positions,
        sm_scale if sm_scale is not None else head_dim**-0.5, window if window is not None else NO_WINDOW,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1), page_table.stride(0),
        GROUP=hq // hk, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_N=BLOCK,
        SOFTCAP=float(softcap or 0.0), Trans=rows if translation is None else translation, HAS_TRANS=translation is not None,
    )  # fmt: skip
    return out
