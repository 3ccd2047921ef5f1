"""Weight-only quantized matmuls for the CPU decode path.

Two formats, both run by torch's own CPU kernels (measured on the dev CPU, AVX-512/AMX, 2
threads: at one to four rows they read 3-4x fewer bytes than bf16 and are 2-3x faster; past about
eight rows they are slower than oneDNN's bf16 GEMM, so callers keep the dense weight for prefill
and large decode batches, see `QuantLinear`):

- int4, group-wise asymmetric: w = (q - 8) * scale + zero per `group` input columns, q in [0, 15]
  (`_weight_int4pack_mm_for_cpu`). GGUF's Q4_1 block (d, m, 32 nibbles: w = d * q + m) is this
  with scale = d, zero = m + 8 d: the codes carry over without loss.
- int8, per output channel symmetric: w = q * scale (`_weight_int8pack_mm`). GGUF's Q8_0 has a
  scale per 32-block; it is re-quantized per row (a half-step of the row scale at most).

Scales are stored in the activation dtype (bf16 for speed; fp32 gives an exact reference path,
20x slower).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

import torch

QuantMethod = Literal["int4", "int8"]
INT4_GROUP = 32
# Rows (tokens) above which the dense weight beats the quantized kernel on this CPU.
DEFAULT_DENSE_ABOVE = 8
# Rows up to which the C bf16 skinny GEMM (kernel/cpu/gemv.c) beats oneDNN's bf16 linear here.
DEFAULT_GEMV_MAX_ROWS = 8


def _check_cpu(t: torch.Tensor) -> None:
    if t.device.type != "cpu":
        raise ValueError(f"weight-only quantization runs on CPU only, got a tensor on {t.device}")


@dataclass
class Int4Weight:
    packed: torch.Tensor  # opaque layout from _convert_weight_to_int4pack_for_cpu
    scales_zeros: torch.Tensor  # [K / group, N, 2] (scale, zero), activation dtype
    group: int
    out_features: int

    @staticmethod
    def from_codes(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int, dtype: torch.dtype) -> "Int4Weight":
        """codes [N, K] ints in [0, 15]; scale, zero [N, K / group]: w = (codes - 8) * scale + zero."""
        _check_cpu(codes)
        n, k = codes.shape
        if k % group or k % 16:
            raise ValueError(f"int4 needs in_features divisible by the group ({group}) and 16, got {k}")
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)
        sz = torch.stack([scale.t(), zero.t()], dim=-1).to(dtype).contiguous()
        return Int4Weight(packed, sz, group, n)

    @staticmethod
    def from_q4_1(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor, dtype: torch.dtype) -> "Int4Weight":
        """GGUF Q4_1: codes [N, K], d and m [N, K / 32]: w = d * codes + m."""
        d, m = d.float(), m.float()
        return Int4Weight.from_codes(codes, d, m + 8 * d, 32, dtype)

    @staticmethod
    def quantize(w: torch.Tensor, group: int = INT4_GROUP) -> "Int4Weight":
        """Round-to-nearest over [min, max] of each group (the Q4_1 recipe: on weights that were
        Q4_1 to begin with this recovers the same codes)."""
        n, k = w.shape
        g = w.float().reshape(n, k // group, group)
        lo, hi = g.amin(-1), g.amax(-1)
        d = (hi - lo) / 15
        safe = torch.where(d > 0, d, torch.ones_like(d))
        codes = torch.clamp(torch.round((g - lo[..., None]) / safe[..., None]), 0, 15).reshape(n, k)
        return Int4Weight.from_q4_1(codes, d, lo, w.dtype)

    def dequantize(self) -> torch.Tensor:
        """The dense [N, K] weight this represents, in float32 (for tests)."""
        k = self.scales_zeros.shape[0] * self.group
        eye = torch.eye(k, dtype=self.scales_zeros.dtype)
        return self.mm(eye).float().t().contiguous()

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group, self.scales_zeros)

    @property
    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size() + self.scales_zeros.numel() * self.scales_zeros.element_size()


@dataclass
class Int8Weight:
    codes: torch.Tensor  # [N, K] int8
    scales: torch.Tensor  # [N], activation dtype

    @staticmethod
    def quantize(w: torch.Tensor) -> "Int8Weight":
        _check_cpu(w)
        wf = w.float()
        scale = wf.abs().amax(-1) / 127
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        codes = torch.clamp(torch.round(wf / safe[:, None]), -127, 127).to(torch.int8)
        return Int8Weight(codes.contiguous(), scale.to(w.dtype))

    def dequantize(self) -> torch.Tensor:
        return self.codes.float() * self.scales.float()[:, None]

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, self.codes, self.scales)

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + self.scales.numel() * self.scales.element_size()


QuantWeight = Int4Weight | Int8Weight


def quantize_weight(w: torch.Tensor, method: QuantMethod) -> QuantWeight:
    if method == "int4":
        return Int4Weight.quantize(w)
    if method == "int8":
        return Int8Weight.quantize(w)
    raise ValueError(f"unknown quantization {method!r}; supported: int4, int8")


def pack_bf16(w: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's blocked layout of a bf16 weight, or None where unavailable. F.linear on a plain
    bf16 weight reorders it into this layout on every call; packed once, a GEMM reads the weight
    once (the same arithmetic: results are bitwise equal)."""
    if w.dtype != torch.bfloat16 or w.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(w, 1)
    except (RuntimeError, AttributeError):
        return None


GemvFn = Callable[[int, int, int, int, int, int, int | None, int, int], int]


class QuantLinear:
    """y = x W^T (+ b) that reads the quantized weight for small row counts (memory-bound decode)
    and the dense one above `dense_above` rows (compute-bound: prefill, large batches); the dense
    weight in oneDNN's packed layout when `packed` is given. With `gemv` (the C bf16 skinny GEMM,
    kernel/cpu) dense calls of <= `gemv_max_rows` rows read the plain bf16 weight in place; with
    `amx` (the C AMX GEMM) the larger ones do too (torch's GEMM where a kernel declines)."""

    def __init__(self, dense: torch.Tensor, quant: QuantWeight | None, bias: torch.Tensor | None = None,
                 dense_above: int = DEFAULT_DENSE_ABOVE, packed: torch.Tensor | None = None,
                 gemv: GemvFn | None = None, gemv_max_rows: int = DEFAULT_GEMV_MAX_ROWS,
                 nthreads: int = 1, amx: GemvFn | None = None) -> None:  # fmt: skip
        self.dense, self.quant, self.bias = dense, quant, bias
        self.dense_above = dense_above
        self.packed = packed
        ok = dense.dtype == torch.bfloat16 and dense.is_contiguous() and dense.device.type == "cpu"
        ok = ok and (bias is None or (bias.dtype == torch.bfloat16 and bias.is_contiguous()))
        self.gemv = gemv if ok else None
        self.amx = amx if ok and packed is None else None
        self.gemv_max_rows = gemv_max_rows
        self.nthreads = nthreads

    def _c_gemm(self, fn: GemvFn, x: torch.Tensor) -> torch.Tensor | None:
        """y from one of the C kernels (same signature), None where it declined the shape."""
        if x.dim() != 2 or x.stride(-1) != 1:
            x = x.reshape(-1, x.shape[-1]).contiguous()
        m, (n, k) = x.shape[0], self.dense.shape
        y = x.new_empty(m, n)
        bias = self.bias.data_ptr() if self.bias is not None else None
        ok = fn(x.data_ptr(), x.stride(0), m, self.dense.data_ptr(), n, k, bias, y.data_ptr(), self.nthreads)
        return y if ok else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is None or x.shape[0] > self.dense_above:
            if x.dtype == torch.bfloat16:
                fn = self.gemv if x.shape[0] <= self.gemv_max_rows else None
                y = self._c_gemm(fn or self.amx, x) if (fn or self.amx) is not None else None  # type: ignore[arg-type]
                if y is not None:
                    return y
            if self.packed is not None:
                return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
            return torch.nn.functional.linear(x, self.dense, self.bias)
        y = self.quant.mm(x)
        return y + self.bias if self.bias is not None else y
