"""Int4 weight-only (W4A16) linear layers on CUDA: one Triton GEMM over packed 4-bit codes.

    y[m, n] = sum_k x[m, k] * scale[n, k // G] * (code[n, k] - zero[n, k // G])   (+ bias[n])

The weight layout (layers/int4.py `Int4Packed`, repacked at load from AWQ, GPTQ and
compressed-tensors, or quantized online by `--quantization int4`):

- `qweight` int32 [N, K / 8]: the unsigned codes packed along K in order, code k of a row in
  bits [4 (k % 8), 4 (k % 8) + 4) of word k // 8 (the in-order packing GPTQ and compressed-tensors
  use along their own axes), so a row's codes are contiguous and a K step reads whole words;
- `scale` and `zero` [N, K / G] in the activation dtype (zero an integer in [0, 16]: exact in
  any float dtype; symmetric formats store 8), G in {32, 64, 128}.

Each K step of the kernel is one group: it loads the group's [G / 8, BLOCK_N] words, splits every
word into its 8 nibbles in registers, dequantizes them in float32 ((code - zero) * scale: the code
becomes a float through its bits, 2^23 + code, instead of an integer conversion), rounds the tile
to the activation dtype and runs one tensor-core dot against the [BLOCK_M, G] activation tile,
accumulated in float32 (float32 activations: an IEEE float32 dot, no TF32). The output is rounded
once to the activation dtype, bias added in float32 first.

Three tile families (`gemm_config`). One row (batch-1 decode, `_w4a16_gemv_kernel`): CUDA-core
FMAs on the float32 values (per group: sum_k (code - zero) x_k, times the scale), with no
tensor-core tile to round to bf16 and stage through shared memory (about 40% fewer instructions
per weight than the tiled kernel at M = 1, whose 16-row mma would be 15/16 padding). Decode
(M <= 16): 16-row tensor-core tiles. Both stream the weight in 32- or 64-row column tiles and,
where those tiles alone would leave SMs idle, split K over several CTAs (`SPLIT_K`) that write
float32 partials into a workspace summed in split order by a second kernel (deterministic; no
atomics). Prefill: 64 x 64 .. 128 x 128 tiles with grouped launch order. Batch 1 reads a
quarter of the bf16 weight's bytes (plus 1/32 for the group-128 scales and zeros).

Both kernels are CUDA-graph capturable: no host syncs, and the only allocations (the workspace and
y) have shapes that depend on the input's shape alone (the SM count is a cached device property).
Imported lazily (layers/int4.py), CUDA only at run time; tests/kernel_checks/int4.py runs them
through Triton's interpreter on the CPU.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from minisgl.kernel.triton_tiles import grouped_tile

GROUPS = (32, 64, 128)  # group sizes along K the kernel takes (one group per K step)
PACK = 8  # 4-bit codes per int32 word
MIN_GROUPS_PER_SPLIT = 4  # a split-K CTA streams at least this many groups (else the reduce costs more than it wins)
MAX_SPLIT = 16


@triton.jit
def _w4a16_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, y_ptr, M, N, K, stride_xm, stride_qn, stride_sn, stride_ym,
                  stride_ys, GROUP: tl.constexpr, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = grouped_tile(pid, num_m, num_n, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    offs_k = tl.arange(0, GROUP)
    offs_w = tl.arange(0, GROUP // 8)
    shifts = tl.arange(0, 8) * 4
    # this CTA's groups along K: split pid_k of SPLIT_K (the last ones may be short or empty)
    n_groups = K // GROUP
    per_split = tl.cdiv(n_groups, SPLIT_K)
    g_start = pid_k * per_split
    g_end = tl.minimum(g_start + per_split, n_groups)
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + (g_start * GROUP + offs_k)[None, :]
    # [G / 8, BLOCK_N] words: the W^T view, so the unpacked tile is the dot's [K, N] operand
    q_ptrs = qw_ptr + offs_n.to(tl.int64)[None, :] * stride_qn + (g_start * (GROUP // 8) + offs_w)[:, None]
    s_ptrs = s_ptr + offs_n.to(tl.int64) * stride_sn + g_start
    z_ptrs = z_ptr + offs_n.to(tl.int64) * stride_sn + g_start
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(g_start, g_end):
        a = tl.load(x_ptrs, mask=mask_m[:, None], other=0.0)
        p = tl.load(q_ptrs, mask=mask_n[None, :], other=0)
        s = tl.load(s_ptrs, mask=mask_n, other=0.0).to(tl.float32)
        z = tl.load(z_ptrs, mask=mask_n, other=0.0).to(tl.float32) + 8388608.0  # 2^23 + zero: exact
        # word row r, nibble j -> K row 8 r + j (codes packed along K in order); OR-ing a code into
        # the mantissa of 2^23 (bits 0x4B000000) gives the float 2^23 + code: no integer conversion
        codes = tl.reshape((p[:, None, :] >> shifts[None, :, None]) & 0xF, (GROUP, BLOCK_N))
        w = ((codes | 0x4B000000).to(tl.float32, bitcast=True) - z[None, :]) * s[None, :]
        if IEEE:
            acc = tl.dot(a, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w.to(a.dtype), acc)
        x_ptrs += GROUP
        q_ptrs += GROUP // 8
        s_ptrs += 1
        z_ptrs += 1
    mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:  # a float32 partial of split pid_k; _splitk_reduce_kernel sums them
        y_ptrs = y_ptr + pid_k.to(tl.int64) * stride_ys + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
        tl.store(y_ptrs, acc, mask=mask)


@triton.jit
def _w4a16_gemv_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, y_ptr, N, K, stride_qn, stride_sn, stride_ys, GROUP: tl.constexpr,
                       SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr):  # fmt: skip
    """One activation row (M = 1, batch-1 decode): CUDA-core FMAs on the float32 values, no
    tensor-core tile to stage through shared memory. Per group: d = code - zero (exact), the
    group's partial sum_k d * x in float32, times the scale; the same split-K as the tiled kernel."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_k = tl.arange(0, GROUP)
    offs_w = tl.arange(0, GROUP // 8)
    shifts = tl.arange(0, 8) * 4
    n_groups = K // GROUP
    per_split = tl.cdiv(n_groups, SPLIT_K)
    g_start = pid_k * per_split
    g_end = tl.minimum(g_start + per_split, n_groups)
    x_ptrs = x_ptr + g_start * GROUP + offs_k
    q_ptrs = qw_ptr + offs_n.to(tl.int64)[None, :] * stride_qn + (g_start * (GROUP // 8) + offs_w)[:, None]
    s_ptrs = s_ptr + offs_n.to(tl.int64) * stride_sn + g_start
    z_ptrs = z_ptr + offs_n.to(tl.int64) * stride_sn + g_start
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for _ in tl.range(g_start, g_end, num_stages=NUM_STAGES):
        x = tl.load(x_ptrs).to(tl.float32)
        p = tl.load(q_ptrs, mask=mask_n[None, :], other=0)
        s = tl.load(s_ptrs, mask=mask_n, other=0.0).to(tl.float32)
        z = tl.load(z_ptrs, mask=mask_n, other=0.0).to(tl.float32) + 8388608.0  # 2^23 + zero: exact
        codes = tl.reshape((p[:, None, :] >> shifts[None, :, None]) & 0xF, (GROUP, BLOCK_N))
        d = (codes | 0x4B000000).to(tl.float32, bitcast=True) - z[None, :]  # code - zero, exact
        acc += tl.sum(d * x[:, None], axis=0) * s
        x_ptrs += GROUP
        q_ptrs += GROUP // 8
        s_ptrs += 1
        z_ptrs += 1
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        tl.store(y_ptr + offs_n, acc.to(y_ptr.dtype.element_ty), mask=mask_n)
    else:
        tl.store(y_ptr + pid_k.to(tl.int64) * stride_ys + offs_n, acc, mask=mask_n)


@triton.jit
def _splitk_reduce_kernel(ws_ptr, bias_ptr, y_ptr, N, stride_ws, stride_wm, stride_ym, SPLIT_K: tl.constexpr,
                          HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    m = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):  # in split order: the same sum on every run
        acc += tl.load(ws_ptr + s * stride_ws + m * stride_wm + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + m * stride_ym + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


class GemmConfig(NamedTuple):
    block_m: int
    block_n: int
    group_m: int
    split_k: int
    num_warps: int
    num_stages: int


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # (the interpreter: an H100 / H200's count, so the CPU checks take the GPU's splits)
    return torch.cuda.get_device_properties(device).multi_processor_count


def gemm_config(m: int, n: int, k: int, group: int, sms: int = 132, fp32: bool = False) -> GemmConfig:
    """The tile for M rows, N outputs, K inputs in groups of `group`, on a GPU of `sms` SMs, for
    16-bit activations (fp32: float32 ones). One row (block_m 1): the CUDA-core GEMV over 32 or 64
    weight rows; decode (M <= 16): 16-row tiles (the mma.sync minimum) over 32 or 64 weight rows;
    prefill: 64 x 64 .. 128 x 128 tiles. Where the column tiles give fewer than 4 CTAs per SM (memory-bound
    decode needs many loads in flight per SM), K is split in powers of two while each split keeps
    at least MIN_GROUPS_PER_SPLIT groups and the partials' traffic stays below the weight's."""
    if m == 1:
        bm, bn, gm, warps, stages = 1, (64 if n >= 8192 else 32), 1, 4, 4
    elif fp32:  # IEEE float32 dots (exactness tests, not speed): the smallest tile, which spills least
        bm, bn, gm, warps, stages = 16, 32, 1, 4, 2
    elif m <= 16:
        bm, bn, gm, warps, stages = 16, (64 if n >= 8192 else 32), 1, 4, 4
    elif m <= 64:
        bm, bn, gm, warps, stages = 64, 64, 8, 4, 3
    elif m <= 256:
        bm, bn, gm, warps, stages = 64, 128, 8, 8, 3  # (4 warps spill with the bias)
    else:
        bm, bn, gm, warps, stages = 128, 128, 8, 8, 3
    tiles = -(-m // bm) * -(-n // bn)
    groups = k // group
    split = 1
    # (the float32 partials cost 8 bytes per output and split, written and read back: at most the
    # half byte per weight the codes cost, 16 * split * M <= K, so that prefill rarely splits)
    while (tiles * split < 4 * sms and groups // (2 * split) >= MIN_GROUPS_PER_SPLIT and split < MAX_SPLIT
           and 16 * 2 * split * m <= k):  # fmt: skip
        split *= 2
    return GemmConfig(bm, bn, gm, split, warps, stages)


def w4a16_gemm(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int,
               bias: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """y [M, N] in x's dtype = x [M, K] (unit stride along K) times the dequantized W [N, K]^T,
    plus bias: qweight int32 [N, K / 8], scale and zero [N, K / group] (see the module doc)."""
    m, k = x.shape
    n = qweight.shape[0]
    if group not in GROUPS or k % group or qweight.shape[1] * PACK != k or x.stride(-1) != 1:
        raise ValueError(f"int4 GEMM shapes x {tuple(x.shape)} stride {x.stride()}, qweight {tuple(qweight.shape)}, "
                         f"group {group}: K must match, be a multiple of the group (one of {GROUPS}), unit stride")  # fmt: skip
    if scale.shape != (n, k // group) or zero.shape != scale.shape:
        raise ValueError(
            f"int4 scale {tuple(scale.shape)} / zero {tuple(zero.shape)} do not fit qweight {tuple(qweight.shape)}, group {group}"
        )
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    cfg = gemm_config(m, n, k, group, _sm_count(x.device), x.dtype == torch.float32)
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n), cfg.split_k)
    out = y if cfg.split_k == 1 else torch.empty((cfg.split_k, m, n), dtype=torch.float32, device=x.device)
    stride_ys = out.stride(0) if cfg.split_k > 1 else 0
    if cfg.block_m == 1:
        _w4a16_gemv_kernel[grid](
            x, qweight, scale, zero, bias if bias is not None else y, out, n, k, qweight.stride(0), scale.stride(0), stride_ys,
            GROUP=group, SPLIT_K=cfg.split_k, HAS_BIAS=bias is not None, BLOCK_N=cfg.block_n, NUM_STAGES=cfg.num_stages,
            num_warps=cfg.num_warps,
        )  # fmt: skip
    else:
        _w4a16_kernel[grid](
            x, qweight, scale, zero, bias if bias is not None else y, out, m, n, k, x.stride(0), qweight.stride(0),
            scale.stride(0), out.stride(-2), stride_ys, GROUP=group, SPLIT_K=cfg.split_k, HAS_BIAS=bias is not None,
            IEEE=x.dtype == torch.float32, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, GROUP_M=cfg.group_m, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )  # fmt: skip
    if cfg.split_k > 1:
        block = 1024
        _splitk_reduce_kernel[(m, triton.cdiv(n, block))](
            out, bias if bias is not None else y, y, n, out.stride(0), out.stride(1), y.stride(0), SPLIT_K=cfg.split_k,
            HAS_BIAS=bias is not None, BLOCK=block, num_warps=4,
        )  # fmt: skip
    return y


def w4a16_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int,
                 bias: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """x W^T (+ bias) for an int4 weight: x [..., K] in the model dtype -> [..., N] in that dtype."""
    flat = x.reshape(-1, x.shape[-1])
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    return w4a16_gemm(flat, qweight, scale, zero, group, bias).view(*x.shape[:-1], qweight.shape[0])
