"""Weight-only quantized matmuls for the CPU decode path.

Both formats are GGUF's own 32-column blocks, stored as one record per weight row (the layout
kernel/cpu/qgemv.c streams; see its header):

- int4 (Q4_1): w = d * q + m, q in [0, 15], fp16 d and m per block: [codes][d x G][m x G], K padded
  to a multiple of 64 and the 64 codes of each block pair in the kernel's order (`_Q4_LO`);
- int8 (Q8_0): w = d * q, q in [-127, 127], fp16 d per block: [q + 128 bytes][d x G], K padded to
  64 and each pair's 64 codes in the same kernel order as int4's nibbles (`_Q4_LO`, then + 16).

GGUF files carry over code for code (nothing re-rounded); `quantize` rounds any dense weight to
the same grids (round to nearest). bf16 activations run the C kernel (fp32 sums, one bf16
rounding); elsewhere (fp32 activations: the exact test path; CPUs without AVX512-BF16) int4 runs
torch's `_weight_int4pack_mm_for_cpu` on a layout built on first use, and int8 a dequantized copy
(the same values, no bandwidth saved). Past about eight rows a GEMM is compute-bound and the dense
weight wins, so callers keep it for prefill and large decode batches, see `QuantLinear`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Dict, Literal

import torch

QuantMethod = Literal["int4", "int8"]
BLOCK = 32  # GGUF's block of input columns sharing a scale
INT4_GROUP = BLOCK
# Rows (tokens) above which the dense weight (on the AMX GEMM) beats the quantized kernel, measured
# on whole decode steps of the embedded model (docs/PERFORMANCE.md, "CPU forward").
DEFAULT_DENSE_ABOVE = 4
# Rows up to which the C bf16 skinny GEMM (kernel/cpu/gemv.c) beats the AMX GEMM (amx.c, which
# reads the weight in place for few rows), the same measurement; at one row the skinny GEMM's
# pure weight stream.
DEFAULT_GEMV_MAX_ROWS = 1
# Without AMX the larger calls would take torch's GEMM (oneDNN re-packs a plain weight on every
# call): there the skinny GEMM wins up to 4 rows (the 4 projections of the embedded model's layer,
# AVX512-BF16 EPYC without AMX: 1.94x / 1.47x / 1.34x / 1.13x torch at 1 / 2 / 3 / 4 rows, 0.94x
# at 5; docs/PERFORMANCE.md), which also lets the C decode loop take batches and verify steps of
# up to 4 rows there.
NO_AMX_GEMV_MAX_ROWS = 4
# On AVX2 + FMA without AVX512-BF16 (skinny_avx2.c, gemm_avx2.c) the GEMV stays ahead of the
# packed GEMM (which converts and transposes the whole weight per call) up to about 12-16 rows:
# the embedded model's layer on a 2-core Zen VM, 1.75 vs 2.71 ms at 8 rows, 2.68 vs 2.82 at 12.
AVX2_GEMV_MAX_ROWS = 8
# The AMX GEMM declines above this many rows (kernel/cpu/amx.c: oneDNN is faster there).
AMX_MAX_ROWS = 640
# gemv_max_rows of a GEMM fixed to the skinny kernel for every row count (`--deterministic`)
ALL_ROWS = 1 << 62


# (x, ldx, rows, weight, n, k, bias | None, y, threads) -> 1 ran / 0 declined: the C GEMMs' signature
GemvFn = Callable[[int, int, int, int, int, int, int | None, int, int], int]


def _check_cpu(t: torch.Tensor) -> None:
    if t.device.type != "cpu":
        raise ValueError(f"weight-only quantization runs on CPU only, got a tensor on {t.device}")


def _check_k(k: int) -> None:
    if k % BLOCK:
        raise ValueError(f"quantized weights need in_features divisible by {BLOCK}, got {k}")


# Byte w of a 64-code block pair holds code _Q4_LO[w] (low nibble) and _Q4_LO[w] + 16 (high):
# qgemv.c's q4_pos, the order in which its VDPBF16PS lanes take them.
_Q4_LO = torch.tensor([((w >> 1) & 1) * 32 + 2 * (w >> 2) + (w & 1) for w in range(32)])


def _fp16_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float16).contiguous().view(torch.uint8)


def _qgemv(name: str) -> Any:
    from minisgl.kernel.cpu import cpu_kernels

    k = cpu_kernels()
    return getattr(k.lib, name) if k is not None and k.has_qgemv else None


def _gemm_takes_any_shape() -> bool:
    """Whether the many-row C GEMM is gemm_avx2.c's, which takes every shape (AMX's does not)."""
    from minisgl.kernel.cpu import cpu_kernels

    k = cpu_kernels()
    return k is not None and k.has_avx2_gemm


def _c_gemm(fn: GemvFn, x: torch.Tensor, weight: int, n: int, k: int, bias: int | None, nthreads: int) -> torch.Tensor | None:
    """y [rows, n] from one of the C GEMMs (their shared signature) over the weight at address
    `weight`, None where the kernel declined the shape."""
    if x.dim() != 2 or x.stride(-1) != 1:
        x = x.reshape(-1, x.shape[-1]).contiguous()
    y = torch.empty((x.shape[0], n), dtype=x.dtype)
    ok = fn(x.data_ptr(), x.stride(0), x.shape[0], weight, n, k, bias, y.data_ptr(), nthreads)
    return y if ok else None


@dataclass
class _Records:
    """What both formats share: one record per weight row, streamed by a qgemv.c kernel."""

    records: torch.Tensor  # uint8 [N, record bytes]
    in_features: int
    KERNEL: ClassVar[str] = ""  # qgemv.c's entry point for bf16 activations

    @property
    def out_features(self) -> int:
        return self.records.shape[0]

    @property
    def nbytes(self) -> int:
        return self.records.numel()

    def c_kernel(self) -> GemvFn | None:
        """The C kernel for bf16 activations over these records (gemv.c's signature), if built."""
        return _qgemv(self.KERNEL)

    @classmethod
    def c_kernel_available(cls) -> bool:
        return _qgemv(cls.KERNEL) is not None

    def mm(self, x: torch.Tensor, nthreads: int = 1) -> torch.Tensor:
        """x W^T: the C kernel for bf16 activations, `torch_mm` where it is missing or declines."""
        if x.dtype == torch.bfloat16 and (fn := self.c_kernel()) is not None:
            y = _c_gemm(fn, x, self.records.data_ptr(), self.out_features, self.in_features, None, nthreads)
            if y is not None:
                return y
        return self.torch_mm(x)

    def torch_mm(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


@dataclass
class Int4Weight(_Records):
    # records: [N, Kp/2 + 4 Kp/32], Kp = K padded to 64: codes, fp16 d, m
    KERNEL: ClassVar[str] = "qgemv_q4_bf16"
    _torch: Dict[torch.dtype, Any] = field(default_factory=dict, repr=False)  # fallback layouts

    @staticmethod
    def from_q4_1(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> "Int4Weight":
        """GGUF Q4_1: codes [N, K] in [0, 15], d and m [N, K / 32] (fp16 values): w = d * codes + m."""
        _check_cpu(codes)
        n, k = codes.shape
        _check_k(k)
        pad = -k % 64  # a zero block (d = m = 0) completes the last pair
        codes = torch.nn.functional.pad(codes.to(torch.uint8), (0, pad)).reshape(n, -1, 64)
        packed = (codes[..., _Q4_LO] | (codes[..., _Q4_LO + 16] << 4)).reshape(n, -1)
        d, m = (torch.nn.functional.pad(t.float(), (0, pad // BLOCK)) for t in (d, m))
        return Int4Weight(torch.cat([packed, _fp16_bytes(d), _fp16_bytes(m)], dim=1).contiguous(), k)

    @staticmethod
    def quantize(w: torch.Tensor, group: int = INT4_GROUP) -> "Int4Weight":
        """Round-to-nearest over [min, max] of each block (the Q4_1 recipe: on weights that were
        Q4_1 to begin with this recovers the same codes)."""
        if group != BLOCK:
            raise ValueError(f"int4 blocks are {BLOCK} columns, got group={group}")
        n, k = w.shape
        _check_k(k)
        g = w.float().reshape(n, k // BLOCK, BLOCK)
        lo = g.amin(-1).half().float()
        d = ((g.amax(-1) - lo) / 15).half().float()
        safe = torch.where(d > 0, d, torch.ones_like(d))
        codes = torch.clamp(torch.round((g - lo[..., None]) / safe[..., None]), 0, 15).reshape(n, k)
        return Int4Weight.from_q4_1(codes, d, lo)

    def blocks(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(codes [N, K] uint8, d, m [N, K / 32] fp32) as stored."""
        k = self.in_features
        kp = -(-k // 64) * 64
        g, n = kp // BLOCK, self.out_features
        packed = self.records[:, : kp // 2].reshape(n, -1, 32)
        codes = torch.empty(n, kp // 64, 64, dtype=torch.uint8)
        codes[..., _Q4_LO], codes[..., _Q4_LO + 16] = packed & 0x0F, packed >> 4
        d = self.records[:, kp // 2 : kp // 2 + 2 * g].contiguous().view(torch.float16).float()
        m = self.records[:, kp // 2 + 2 * g :].contiguous().view(torch.float16).float()
        return codes.reshape(n, kp)[:, :k], d[:, : k // BLOCK], m[:, : k // BLOCK]

    def dequantize(self) -> torch.Tensor:
        """The dense [N, K] weight this represents, in float32 (d * q + m, as gguf-py computes)."""
        codes, d, m = self.blocks()
        return codes.float() * d.repeat_interleave(BLOCK, 1) + m.repeat_interleave(BLOCK, 1)

    def _torch_layout(self, dtype: torch.dtype) -> Any:
        if dtype not in self._torch:
            codes, d, m = self.blocks()
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)
            # torch's form: w = (q - 8) * scale + zero, so zero = m + 8 d
            sz = torch.stack([d.t(), (m + 8 * d).t()], dim=-1).to(dtype).contiguous()
            self._torch[dtype] = (packed, sz)
        return self._torch[dtype]

    def torch_mm(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T off the C kernel (fp32 activations, or no AVX512-BF16): torch's int4 kernel."""
        packed, sz = self._torch_layout(x.dtype)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, BLOCK, sz)


@dataclass
class Int8Weight(_Records):
    # records: [N, Kp + 2 Kp/32], Kp = K padded to 64: codes + 128, fp16 d
    KERNEL: ClassVar[str] = "qgemv_q8_bf16"
    _dense: Dict[torch.dtype, torch.Tensor] = field(default_factory=dict, repr=False)  # fallback

    @staticmethod
    def from_q8_0(codes: torch.Tensor, d: torch.Tensor) -> "Int8Weight":
        """GGUF Q8_0: codes [N, K] int8, d [N, K / 32] (fp16 values): w = d * codes."""
        _check_cpu(codes)
        n, k = codes.shape
        _check_k(k)
        pad = -k % 64  # a zero block (d = 0) completes the last pair
        u = torch.nn.functional.pad(codes.to(torch.int16) + 128, (0, pad), value=128).reshape(n, -1, 64)
        order = torch.cat([_Q4_LO, _Q4_LO + 16])
        raw = u[..., order].to(torch.uint8).reshape(n, -1)
        d = torch.nn.functional.pad(d.float(), (0, pad // BLOCK))
        return Int8Weight(torch.cat([raw, _fp16_bytes(d)], dim=1).contiguous(), k)

    @staticmethod
    def quantize(w: torch.Tensor) -> "Int8Weight":
        _check_cpu(w)
        n, k = w.shape
        _check_k(k)
        g = w.float().reshape(n, k // BLOCK, BLOCK)
        d = (g.abs().amax(-1) / 127).half().float()
        safe = torch.where(d > 0, d, torch.ones_like(d))
        codes = torch.clamp(torch.round(g / safe[..., None]), -127, 127).reshape(n, k)
        return Int8Weight.from_q8_0(codes, d)

    def blocks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes [N, K] int8, d [N, K / 32] fp32) as stored."""
        k = self.in_features
        kp, n = -(-k // 64) * 64, self.out_features
        raw = self.records[:, :kp].reshape(n, -1, 64).to(torch.int16) - 128
        codes = torch.empty_like(raw)
        codes[..., torch.cat([_Q4_LO, _Q4_LO + 16])] = raw
        d = self.records[:, kp:].contiguous().view(torch.float16).float()
        return codes.reshape(n, kp)[:, :k].to(torch.int8), d[:, : k // BLOCK]

    def dequantize(self) -> torch.Tensor:
        codes, d = self.blocks()
        return codes.float() * d.repeat_interleave(BLOCK, 1)

    def torch_mm(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T off the C kernel: a dequantized copy (the same values, no bandwidth saved)."""
        if x.dtype not in self._dense:
            self._dense[x.dtype] = self.dequantize().to(x.dtype)
        return torch.nn.functional.linear(x, self._dense[x.dtype])


QuantWeight = Int4Weight | Int8Weight


def quantize_weight(w: torch.Tensor, method: QuantMethod) -> QuantWeight:
    if method == "int4":
        return Int4Weight.quantize(w)
    if method == "int8":
        return Int8Weight.quantize(w)
    raise ValueError(f"unknown quantization {method!r}; supported: int4, int8")


def vnni_pack(w: torch.Tensor) -> torch.Tensor:
    """A [n, k] bf16 weight in the AMX tile unit's B layout (kernel/cpu/amx.c gemm_amx_vnni_bf16):
    [n / 16, k / 32, 16, 16, 2], element [b, q, p, c, e] = w[16 b + c, 32 q + 2 p + e]: per 16
    output rows and 32 inputs one 1 KiB tile whose 64-byte row p holds the 16 rows' pair
    (2p, 2p + 1). The C GEMMs read it in place (no per-call re-pack); n % 16 == k % 32 == 0."""
    n, k = w.shape
    return w.view(n // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4).contiguous()


def vnni_unpack(t: torch.Tensor) -> torch.Tensor:
    """The plain [n, k] weight of a `vnni_pack` tensor."""
    nb, kb = t.shape[:2]
    return t.permute(0, 3, 1, 2, 4).reshape(nb * 16, kb * 32)


def vnni_packable(w: torch.Tensor) -> bool:
    return w.dim() == 2 and w.dtype == torch.bfloat16 and w.shape[0] % 16 == 0 and w.shape[1] % 32 == 0


class QuantLinear:
    """y = x W^T (+ b) that reads the quantized weight for small row counts (memory-bound decode)
    and the dense one above `dense_above` rows (compute-bound: prefill, large batches). With
    `gemv` (the C bf16 skinny GEMM, kernel/cpu) dense calls of <= `gemv_max_rows` rows read the
    plain bf16 weight in place; with `gemm` (the C GEMM of many rows: AMX tiles, amx.c, or on a
    CPU without them AVX2 FMAs, gemm_avx2.c) the larger ones do too (torch's GEMM where a kernel
    declines).

    A dense weight in VNNI tiles (`vnni_pack`, 5-D) is read by the kernels given for that layout
    (gemv.c's gemv_vnni_bf16, amx.c's gemm_amx_vnni_bf16, for any row count), and `amx_silu`
    (gemm_amx_vnni_silu_bf16) runs a [gate | up] weight with its SiLU in one pass
    (`silu_and_mul`).

    `batch_invariant` (`--deterministic`, engine/cpu_decode.py bind_cpu_gemms) marks one fixed
    kernel for every row count: the skinny GEMM (gemv_max_rows = ALL_ROWS) on a row-major
    weight, the AMX tiles (gemv_max_rows = 0) on VNNI tiles. Neither splits the reduction nor
    picks its order by the number of rows (each output is one accumulator chain over K in
    order), so a row's result does not depend on the rows beside it (tests/test_deterministic.py
    checks it bitwise)."""

    def __init__(self, dense: torch.Tensor, quant: QuantWeight | None, bias: torch.Tensor | None = None,
                 dense_above: int = DEFAULT_DENSE_ABOVE, gemv: GemvFn | None = None,
                 gemv_max_rows: int = DEFAULT_GEMV_MAX_ROWS, nthreads: int = 1, gemm: GemvFn | None = None,
                 amx_silu: Any = None, batch_invariant: bool = False) -> None:  # fmt: skip
        self.dense, self.quant, self.bias = dense, quant, bias
        self.batch_invariant = batch_invariant
        self.dense_above = dense_above
        self.vnni = dense.dim() == 5
        ok = dense.dtype == torch.bfloat16 and dense.is_contiguous() and dense.device.type == "cpu"
        ok = ok and (bias is None or (bias.dtype == torch.bfloat16 and bias.is_contiguous()))
        self.gemv = gemv if ok else None
        self.gemm = gemm if ok else None
        self.amx_silu = amx_silu if ok and self.vnni and bias is None else None
        self.gemv_max_rows = gemv_max_rows
        self.nthreads = nthreads
        # the quantized weight's C kernel (bf16 activations), bound once: it is the decode hot path
        self.qgemv = quant.c_kernel() if quant is not None and ok else None
        self._bias_ptr = bias.data_ptr() if bias is not None else None
        self._n, self._k = (dense.shape[0] * 16, dense.shape[1] * 32) if self.vnni else dense.shape

    @property
    def out_features(self) -> int:
        return self._n

    @property
    def in_features(self) -> int:
        return self._k

    def _dense_path(self, rows: int) -> bool:
        return self.quant is None or rows > self.dense_above

    def decode_spec(self, rows: int) -> tuple[int | None, int, int, int, int, int, int, int | None, int] | None:
        """kernel/cpu/decode_loop.c's DecodeGemm for batches of up to `rows` rows: the same choice
        of kernel per row count as __call__ (quantized, skinny bf16, AMX), or None where some row
        count up to `rows` would take torch's path (no C kernel, or one that declines the shape)."""
        q_bits = q_rows = 0
        q_ptr = None
        if self.quant is not None:
            if self.qgemv is None or self._k % 32:
                return None
            q_bits, q_rows, q_ptr = (4 if isinstance(self.quant, Int4Weight) else 8), self.dense_above, self.quant.records.data_ptr()
        dense_rows = range(q_rows + 1, rows + 1)  # the row counts the dense weight serves
        gemv_rows = self.gemv_max_rows if self.gemv is not None else 0
        if any(r > gemv_rows for r in dense_rows):  # those take the many-row GEMM: it must take the shape
            # (on a plain weight the AMX GEMM declines above AMX_MAX_ROWS; on VNNI tiles it takes any)
            amx_declines = self._n % 16 or self._k % 32 or (rows > AMX_MAX_ROWS and not self.vnni)
            if self.gemm is None or (not _gemm_takes_any_shape() and amx_declines):
                return None
        return q_ptr, q_bits, q_rows, self.dense.data_ptr(), gemv_rows, self._n, self._k, self._bias_ptr, int(self.vnni)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up for this [gate | up] weight in one pass over its VNNI tiles, where
        __call__ would take the AMX GEMM (the same bits as the GEMM then the SiLU); None where
        that does not apply."""
        b = x.shape[0]
        if self.amx_silu is None or x.dtype != torch.bfloat16 or x.stride(-1) != 1 or b <= self.gemv_max_rows:
            return None
        if not self._dense_path(b):
            return None
        out = x.new_empty(b, self._n // 2)
        ok = self.amx_silu(x.data_ptr(), x.stride(0), b, self.dense.data_ptr(), self._n // 2, self._k, out.data_ptr(),
                           self.nthreads)  # fmt: skip
        return out if ok else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._dense_path(x.shape[0]):
            if x.dtype == torch.bfloat16:
                fn = self.gemv if x.shape[0] <= self.gemv_max_rows else None
                c = fn or self.gemm
                y = _c_gemm(c, x, self.dense.data_ptr(), self._n, self._k, self._bias_ptr, self.nthreads) if c is not None else None
                if y is not None:
                    return y
            # (a VNNI weight's kernels take every shape; this is only a last resort)
            w = vnni_unpack(self.dense) if self.vnni else self.dense
            return torch.nn.functional.linear(x, w, self.bias)
        assert self.quant is not None
        if self.qgemv is not None and x.dtype == torch.bfloat16:
            y = _c_gemm(self.qgemv, x, self.quant.records.data_ptr(), self._n, self._k, self._bias_ptr, self.nthreads)
            if y is not None:
                return y
        y = self.quant.torch_mm(x)  # (the C kernel was tried above, with the bias)
        return y + self.bias if self.bias is not None else y
