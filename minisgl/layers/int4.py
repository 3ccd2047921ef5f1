"""Int4 weights kept as 4-bit codes on CUDA (W4A16): what a linear layer holds and how the loader
shards it.

A linear layer with an int4 weight holds `weight` int32 [N, K / 8] (the codes packed along K in
order: code k of a row in bits [4 (k % 8), 4 (k % 8) + 4) of word k // 8), `weight_scale` and
`weight_zero` [N, K / G] in the model dtype (integers, [0, 16]) and `weight_group` G in {32, 64, 128}, so
w[o, i] = weight_scale[o, i // G] * (code[o, i] - weight_zero[o, i // G]); its forward runs the
Triton W4A16 GEMM (kernel/triton_int4.py).

Every 4-bit checkpoint form maps onto that exactly (`Int4Packed.from_groups`, from the loader's
`IntGroups`: AWQ's output-packed nibbles, GPTQ's input-packed words with v1's zero offset, and
compressed-tensors' offset codes all become the same unsigned codes and zeros first): groups of
32, 64 or 128 are kept as they are, larger multiples of 128 (per-channel: G = K) repeat their
scale and zero per 128 columns (the same values). The loader shards `Int4Packed` like a dense
tensor (`narrow` in [N, K] coordinates: column-parallel layers split output rows with their scale
and zero rows, row-parallel ones split K on group boundaries) and merges q/k/v and gate/up by
concatenation. A cut inside a group, K not a multiple of the group, or a group that is none of
the above cannot be kept: `Int4Unaligned`, and the loader dequantizes that layer (logged).

The scale is rounded to the model dtype (a bf16 model: 8 significant bits, the rounding a dense
bf16 weight gets anyway); the zero is an integer in [0, 16] (16: GPTQ v1's stored 15 plus its
offset), exact in any float dtype.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn

GROUPS = (32, 64, 128)  # the group sizes along K the GEMM takes (kernel/triton_int4.GROUPS)
ONLINE_GROUP = 128  # `--quantization int4`: asymmetric groups of 128 along K
PACK = 8  # codes per int32 word


class Int4Unaligned(ValueError):
    """An int4 weight cannot stay int4 with this cut or group size."""


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """Unsigned 4-bit codes [N, K] (K % 8 == 0) -> int32 [N, K / 8], code k in bits [4 (k % 8), +4) of word k // 8."""
    n, k = codes.shape
    shifts = torch.arange(PACK, device=codes.device, dtype=torch.int64) * 4
    words = (codes.to(torch.int64).reshape(n, k // PACK, PACK) << shifts).sum(-1)
    return (words - (words >= 2**31).to(torch.int64) * 2**32).to(torch.int32)  # as int32 bits


def unpack_codes(qweight: torch.Tensor) -> torch.Tensor:
    """int32 [N, K / 8] -> the unsigned codes [N, K] (int32)."""
    shifts = torch.arange(PACK, device=qweight.device, dtype=torch.int32) * 4
    return ((qweight[..., None] >> shifts) & 0xF).reshape(qweight.shape[0], -1)


@dataclass
class Int4Packed:
    """w[o, i] = scale[o, i // group] * (code[o, i] - zero[o, i // group]), codes packed in `qweight`."""

    qweight: torch.Tensor  # [N, K / 8] int32
    scale: torch.Tensor  # [N, K / group], float32 until `to` casts it to the model dtype
    zero: torch.Tensor  # [N, K / group], integer values in [0, 16]
    group: int

    @property
    def shape(self) -> torch.Size:
        """The [N, K] of the dense weight this represents (what the loader's sharding sees)."""
        return torch.Size((self.qweight.shape[0], self.qweight.shape[1] * PACK))

    @staticmethod
    def from_groups(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int, bits: int) -> "Int4Packed":
        """The checkpoint's groups (models/checkpoint_quant.IntGroups: unsigned codes [N, K], scale
        and zero [N, K / group]) in this layout; Int4Unaligned where there is none."""
        k = codes.shape[1]
        if bits != 4:
            raise Int4Unaligned(f"{bits}-bit codes (the int4 GEMM takes 4 bits)")
        if k % group:
            raise Int4Unaligned(f"in_features {k} is not a multiple of the group size {group}")
        if group not in GROUPS:
            if group % GROUPS[-1]:
                raise Int4Unaligned(f"group size {group} (the int4 GEMM takes {', '.join(map(str, GROUPS))} or multiples of 128)")
            rep = group // GROUPS[-1]  # per-channel or wide groups: the same scale and zero per 128 columns
            scale, zero, group = scale.repeat_interleave(rep, 1), zero.repeat_interleave(rep, 1), GROUPS[-1]
        # integers in [0, 16]: GPTQ v1 reads a stored 15 as zero 16 (its zero - 1 wrapped), as every v1 reader does
        if not torch.equal(zero, zero.round()) or bool(((zero < 0) | (zero > 16)).any()):
            raise Int4Unaligned("zero points that are not integers in [0, 16]")
        return Int4Packed(pack_codes(codes), scale.float().contiguous(), zero.float().contiguous(), group)

    def regroup(self, group: int) -> "Int4Packed":
        """The same values with smaller groups (`group` divides this one's): scales and zeros repeated."""
        if group == self.group:
            return self
        rep = self.group // group
        return Int4Packed(self.qweight, self.scale.repeat_interleave(rep, 1), self.zero.repeat_interleave(rep, 1), group)

    def narrow(self, dim: int, start: int, length: int) -> "Int4Packed":
        dim = dim % 2
        if dim == 0:
            return Int4Packed(self.qweight.narrow(0, start, length), self.scale.narrow(0, start, length),
                              self.zero.narrow(0, start, length), self.group)  # fmt: skip
        g = self.group
        if start % g or length % g:
            raise Int4Unaligned(f"columns [{start}, {start + length}) of {self.shape[1]} cut the {g}-column groups")
        return Int4Packed(self.qweight.narrow(1, start // PACK, length // PACK), self.scale.narrow(1, start // g, length // g),
                          self.zero.narrow(1, start // g, length // g), g)  # fmt: skip

    def to(self, device: torch.device, dtype: torch.dtype) -> "Int4Packed":
        """On `device`, contiguous, scales and zeros in the model dtype `dtype`."""
        return Int4Packed(self.qweight.to(device).contiguous(), self.scale.to(device, dtype).contiguous(),
                          self.zero.to(device, dtype).contiguous(), self.group)  # fmt: skip

    def dense(self) -> torch.Tensor:
        """The [N, K] float32 weight this represents."""
        s = self.scale.float().repeat_interleave(self.group, 1)
        z = self.zero.float().repeat_interleave(self.group, 1)
        return (unpack_codes(self.qweight).float() - z) * s

    @staticmethod
    def cat(parts: Iterable["Int4Packed"]) -> "Int4Packed":
        """Parts stacked along the rows (a merged projection), in the smallest group of any part
        (GROUPS are powers of two: it divides the others)."""
        ps = list(parts)
        g = min(p.group for p in ps)
        ps = [p.regroup(g) for p in ps]
        return Int4Packed(torch.cat([p.qweight for p in ps]), torch.cat([p.scale for p in ps]), torch.cat([p.zero for p in ps]), g)

    def install(self, module: nn.Module) -> None:
        """Make this the int4 weight of linear layer `module` (its scales, zeros and group; the
        packed codes themselves arrive through the state dict as `weight`)."""
        module.weight_scale = self.scale  # type: ignore[assignment]
        module.weight_zero = self.zero  # type: ignore[assignment]
        module.weight_group = self.group  # type: ignore[assignment]


def keeps_int4(device: torch.device, deterministic: bool, quantization: str | None) -> bool:
    """Whether 4-bit checkpoints (AWQ, GPTQ, compressed-tensors) keep their codes on this engine:
    on CUDA with Triton (the W4A16 GEMM), not in deterministic mode (its GEMMs must be
    batch-invariant; the dequantized weight's are), where `--quantization int4` asks for it.
    Opt-in, as FP8 is, until the kernels have run on a GPU (tests/test_int4_cuda.py decides):
    `auto` dequantizes them, as before. Elsewhere (the CPU: its own int4 decode GEMM,
    engine/cpu_decode.py) they are dequantized at load."""
    if quantization != "int4":
        return False
    return device.type == "cuda" and not deterministic and importlib.util.find_spec("triton") is not None


def int4_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int,
                bias: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """The W4A16 linear op: x W^T (+ bias). CUDA: the Triton kernel (kernel/triton_int4.py);
    elsewhere the same arithmetic in float32 torch ops (the reference: the dequantized weight
    rounded to x's dtype, as the kernel feeds its tensor-core dots, then a float32 product; one
    row as the kernel's GEMV, on the float32 values unrounded)."""
    if x.is_cuda:
        from minisgl.kernel.triton_int4 import w4a16_linear

        return w4a16_linear(x, qweight, scale, zero, group, bias)
    flat = x.reshape(-1, x.shape[-1])
    w = Int4Packed(qweight, scale, zero, group).dense()
    w = w if flat.shape[0] == 1 else w.to(x.dtype).float()
    y = flat.float() @ w.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).view(*x.shape[:-1], qweight.shape[0])


def quantize_groups(w: torch.Tensor, group: int = ONLINE_GROUP) -> Int4Packed:
    """Online int4 (`--quantization int4` on CUDA): per (row, `group` columns) asymmetric min/max
    codes: scale = (max - min) / 15, zero = round(-min / scale) in [0, 15], code = round(w / scale)
    + zero clamped to [0, 15] (the range always holds 0, so zero rows and biases stay exact)."""
    n, k = w.shape
    g = w.float().reshape(n, k // group, group)
    lo, hi = g.amin(-1).clamp(max=0.0), g.amax(-1).clamp(min=0.0)
    scale = ((hi - lo) / 15.0).clamp(min=1e-8)
    zero = torch.round(-lo / scale).clamp(0, 15)
    codes = (torch.round(g / scale[..., None]) + zero[..., None]).clamp(0, 15).reshape(n, k)
    return Int4Packed(pack_codes(codes), scale, zero, group)
