"""Gumbel-max sampling from softmax(logits / T) that reads the logits once (Triton, CUDA).

token = argmax_j (logits_j / T + g_j) with g_j standard Gumbel noise is an exact draw from
softmax(logits / T), and it needs neither the softmax nor a cumulative sum: one pass over the
logits, in their own dtype. Rows with T <= GREEDY_T (the sampler's MIN_T, given to greedy requests
in mixed batches) take a plain argmax without noise, lowest index on ties like torch.argmax.

Noise. Philox (`tl.randint4x`) keyed by the row's 64-bit seed: one counter gives four 32-bit
words. Column c of a row uses word (c // QUARTER) % 4 of counter (c // TILE) * QUARTER + c % QUARTER
(TILE = 4 * QUARTER columns), so a row's noise depends only on its seed, never on the batch size,
the launch split or the other rows: a seeded request reproduces its draws in any batch. A word r
gives v = (r + 1/2) / 2^32, strictly inside (0, 1) and finely spaced near 0, the end that decides
the upper tail; then E = -log(1 - v) (exponential, a series for small v where 1 - v would round)
and g = -log(E). g lies in about [-2.8, 22.9]: finite, so -inf logits stay -inf and never win.

Work split. Kernel 1 runs on a (block of rows, vocab chunk) grid and writes each chunk's best
(score, index) to scratch; kernel 2 reduces the chunks of each row. A single row still spreads over
~150 programs at a 151,936 vocabulary; many rows merge up to 4 rows x 8 tiles per program. The
kernel is bound by arithmetic (Philox, two logs per element), not by its one read of the logits.
No host sync; launch shapes and outputs come from tensor shapes only, so it is CUDA-graph safe.
The row count is not specialised on (do_not_specialize): a new batch size compiles at most one of
the few (rows, tiles) variants the split picks from, once.

CUDA only (or Triton's interpreter with TRITON_INTERPRET=1, which the tests use). Import it only
behind `minisgl.kernel.fused.use_fused`, which never imports triton on a CPU path.
"""

from __future__ import annotations

from typing import Tuple

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from minisgl.utils.env import read_env

INTERPRET = read_env().triton_interpret
GREEDY_T = 1e-6  # rows at or below this temperature take the argmax (sample.MIN_T)
QUARTER = 256  # part of the noise layout (see above): changing it changes every seeded draw
TILE = 4 * QUARTER
_MAX_TILES = 8  # per program, when there are rows enough to fill the GPU
_MAX_ROWS = 4  # per program, likewise
_MIN_PROGRAMS = 1024  # keep at least this many programs (~8 per SM on an H200) when merging work
_CHUNK_WARPS = 4


@triton.jit
def _log(x, FAST: tl.constexpr):
    # The kernel is bound by arithmetic (Philox and two logs per element), not by memory: the
    # hardware lg2 (relative error ~2^-22, ample for noise) is far cheaper than libdevice's logf.
    if FAST:
        return libdevice.fast_logf(x)
    return tl.log(x)  # the interpreter has no fast_logf


@triton.jit
def _gumbel(r, FAST: tl.constexpr):
    """Standard Gumbel noise from 32 random bits (uint32), finite for every input."""
    v = (r.to(tl.float32) + 0.5) * 2.3283064365386963e-10  # (r + 1/2) / 2^32
    v = tl.minimum(v, 0.99999994)  # r near 2^32 rounds v to 1.0 in float32: keep 1 - v > 0
    # E = -log(1 - v): the series is exact to float32 for v < 0.01, where 1 - v loses v's digits
    series = v * (1.0 + v * (0.5 + v * (0.33333334 + v * 0.25)))
    e = tl.where(v < 0.01, series, -_log(1.0 - v, FAST))
    return -_log(e, FAST)


@triton.jit
def _update_best(best_v, best_i, rows_base, row_mask, cols, n_cols, r, inv_t, noise, FAST: tl.constexpr):
    mask = row_mask[:, None] & (cols < n_cols)[None, :]
    x = tl.load(rows_base[:, None] + cols[None, :], mask=mask, other=float("-inf")).to(tl.float32)
    score = x * inv_t[:, None] + noise[:, None] * _gumbel(r, FAST)
    # strict >: columns only grow along a lane, so each lane keeps its first maximum
    better = score > best_v
    return tl.where(better, score, best_v), tl.where(better, cols[None, :], best_i)


@triton.jit(do_not_specialize=["n_rows"])
def _gumbel_chunk_kernel(
    Logits,
    Temps,
    Seeds,
    BestVal,
    BestIdx,
    n_rows,
    n_cols,
    stride_row,
    n_chunks,
    GREEDY: tl.constexpr,
    QUARTER: tl.constexpr,
    TILES: tl.constexpr,
    ROWS: tl.constexpr,
    FAST: tl.constexpr,
):
    # program (i, c): rows [i * ROWS, (i + 1) * ROWS) x tiles [c * TILES, (c + 1) * TILES)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    chunk = tl.program_id(1)
    row_mask = rows < n_rows
    t = tl.load(Temps + rows, mask=row_mask, other=1.0)
    seed = tl.load(Seeds + rows, mask=row_mask, other=0)
    greedy = t <= GREEDY
    inv_t = tl.where(greedy, 1.0, 1.0 / t)
    noise = tl.where(greedy, 0.0, 1.0)  # g is finite, so 0 * g is exactly 0
    rows_base = Logits + rows.to(tl.int64) * stride_row
    lane = tl.arange(0, QUARTER)
    first_tile = chunk * TILES
    # Per-lane running best; a lane that never beats -inf keeps a valid column of this chunk.
    best_v = tl.full([ROWS, QUARTER], float("-inf"), tl.float32)
    best_i = tl.zeros([ROWS, QUARTER], tl.int32) + (first_tile * (4 * QUARTER) + lane)[None, :]
    for k in range(TILES):
        tile = first_tile + k
        # the row's seed keys Philox: each row draws from its own stream
        r0, r1, r2, r3 = tl.randint4x(seed[:, None], (tile * QUARTER + lane)[None, :])
        cols = tile * (4 * QUARTER) + lane
        best_v, best_i = _update_best(best_v, best_i, rows_base, row_mask, cols, n_cols, r0, inv_t, noise, FAST)
        cols += QUARTER
        best_v, best_i = _update_best(best_v, best_i, rows_base, row_mask, cols, n_cols, r1, inv_t, noise, FAST)
        cols += QUARTER
        best_v, best_i = _update_best(best_v, best_i, rows_base, row_mask, cols, n_cols, r2, inv_t, noise, FAST)
        cols += QUARTER
        best_v, best_i = _update_best(best_v, best_i, rows_base, row_mask, cols, n_cols, r3, inv_t, noise, FAST)
    # Across lanes the lowest column among the maxima wins (lane order is not column order).
    top = tl.max(best_v, axis=1)
    idx = tl.min(tl.where(best_v == top[:, None], best_i, 2147483647), axis=1)
    out = rows.to(tl.int64) * n_chunks + chunk
    tl.store(BestVal + out, top, mask=row_mask)
    tl.store(BestIdx + out, idx, mask=row_mask)


@triton.jit(do_not_specialize=["n_rows"])
def _argmax_chunks_kernel(BestVal, BestIdx, Out, n_rows, n_chunks, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    c = tl.arange(0, BLOCK)
    mask = (rows < n_rows)[:, None] & (c < n_chunks)[None, :]
    offs = rows.to(tl.int64)[:, None] * n_chunks + c[None, :]
    v = tl.load(BestVal + offs, mask=mask, other=float("-inf"))
    i = tl.load(BestIdx + offs, mask=mask, other=2147483647)
    top = tl.max(v, axis=1)
    # chunks are in column order, so the lowest index among equal maxima is torch.argmax's pick;
    # a row of -inf scores ties everywhere and gets column 0
    idx = tl.min(tl.where(v == top[:, None], i, 2147483647), axis=1)
    tl.store(Out + rows, idx.to(tl.int64), mask=rows < n_rows)


def _launch_split(rows: int, n_tiles: int) -> Tuple[int, int]:
    """(rows, tiles) per program. A single row must still fill the GPU, so few rows get one tile
    per program; with many rows, programs take more tiles, then more rows, which amortises each
    program's setup and shrinks the scratch, while at least _MIN_PROGRAMS programs remain."""
    block_rows, tiles = 1, 1

    def programs(r: int, t: int) -> int:
        return triton.cdiv(rows, r) * triton.cdiv(n_tiles, t)

    while tiles < min(_MAX_TILES, n_tiles) and programs(block_rows, 2 * tiles) >= _MIN_PROGRAMS:
        tiles *= 2
    while block_rows < _MAX_ROWS and programs(2 * block_rows, tiles) >= _MIN_PROGRAMS:
        block_rows *= 2
    return block_rows, tiles


def gumbel_sample(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    seeds: torch.Tensor,
    split: Tuple[int, int] | None = None,
) -> torch.Tensor:
    """One token per row drawn from softmax(logits / T) (argmax where T <= GREEDY_T).

    logits: [B, V] bf16/fp16/fp32, any row stride; temperatures: [B] float32; seeds: [B] int64.
    Returns [B] int64. A row's draw depends only on its logits, temperature and seed. `split`
    forces (rows, tiles) per program, powers of two (tests and tuning; the draws do not change)."""
    assert logits.dim() == 2, "logits must be [batch, vocab]"
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    n_rows, n_cols = logits.shape
    assert n_cols < 2**31 - 4 * TILE, "column indices are int32"
    temperatures = temperatures.to(torch.float32).contiguous()
    seeds = seeds.to(torch.int64).contiguous()
    out = torch.empty(n_rows, dtype=torch.int64, device=logits.device)
    if n_rows == 0:
        return out
    n_tiles = triton.cdiv(n_cols, TILE)
    block_rows, tiles = split or _launch_split(n_rows, n_tiles)
    n_chunks = triton.cdiv(n_tiles, tiles)
    best_val = torch.empty(n_rows, n_chunks, dtype=torch.float32, device=logits.device)
    best_idx = torch.empty(n_rows, n_chunks, dtype=torch.int32, device=logits.device)
    grid = (triton.cdiv(n_rows, block_rows), n_chunks)
    _gumbel_chunk_kernel[grid](
        logits, temperatures, seeds, best_val, best_idx, n_rows, n_cols, logits.stride(0), n_chunks,
        GREEDY=GREEDY_T, QUARTER=QUARTER, TILES=tiles, ROWS=block_rows, FAST=not INTERPRET, num_warps=_CHUNK_WARPS,
    )  # fmt: skip
    block = triton.next_power_of_2(n_chunks)
    reduce_rows = max(1, min(64, 1024 // block))
    _argmax_chunks_kernel[(triton.cdiv(n_rows, reduce_rows),)](
        best_val, best_idx, out, n_rows, n_chunks, ROWS=reduce_rows, BLOCK=block, num_warps=1
    )
    return out


def _variant(n_rows: int, n_tiles: int) -> Tuple[int, int, int, int]:
    """What a launch over n_rows rows compiles for: (rows, tiles) per program, the reduce block and
    the chunk count's specialisation (Triton specialises int arguments on == 1 and % 16)."""
    block_rows, tiles = _launch_split(n_rows, n_tiles)
    n_chunks = triton.cdiv(n_tiles, tiles)
    return block_rows, tiles, triton.next_power_of_2(n_chunks), 1 if n_chunks == 1 else 16 if n_chunks % 16 == 0 else 0


def warmup(max_rows: int, vocab_size: int, dtype: torch.dtype, device: torch.device) -> int:
    """Launch every kernel variant a batch of 1..max_rows rows can pick, so that none is compiled
    (or loaded from Triton's disk cache, tens of ms each) in the middle of serving as the batch
    grows and shrinks. Returns the number of variants."""
    n_tiles = triton.cdiv(vocab_size, TILE)
    firsts: dict = {}
    for n in range(1, max_rows + 1):
        firsts.setdefault(_variant(n, n_tiles), n)
    logits = torch.zeros(max_rows, vocab_size, dtype=dtype, device=device)
    temps = torch.ones(max_rows, dtype=torch.float32, device=device)
    seeds = torch.zeros(max_rows, dtype=torch.int64, device=device)
    for n in firsts.values():
        gumbel_sample(logits[:n], temps[:n], seeds[:n])
    return len(firsts)
