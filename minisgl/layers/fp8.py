"""FP8 (e4m3) weights kept as FP8 on CUDA: what a linear layer holds and how the loader shards it.

A linear layer with an FP8 weight holds `weight` float8_e4m3fn [N, K] and `weight_scale` float32
[ceil(N / weight_block_n), K / 128] (or [.., 1]: one scale per row block, broadcast over K), so
w[o, i] = weight[o, i] * weight_scale[o // weight_block_n, i // 128]; its forward quantizes the
activation per (row, 128 columns) and runs the block-scaled FP8 GEMM (kernel/triton_fp8.py).

Every FP8 checkpoint form maps onto that exactly: `weight_block_size` [128, 128] as stored;
per-channel (one scale per row, block_n = 1, one column); per-tensor (the one scale repeated per
row). The loader shards `Fp8Weight` like a dense tensor (`narrow`: column-parallel layers split
output rows, row-parallel ones input columns) and merges the parts of q/k/v and gate/up by
concatenation. Where a row boundary (a shard's or a merged part's) falls inside a scale block, the
scales are first repeated per row (block_n = 1, the same values, 1/128 of the weight's bytes per
128-column block); a column boundary not on 128 (the activation groups) cannot be kept:
`Fp8Unaligned`, and the loader dequantizes that layer (logged).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn

GROUP_K = 128  # the activation quantizer's group along K, and the weight scale block along K
FP8_MAX = 448.0
FP8_E4M3 = torch.float8_e4m3fn


class Fp8Unaligned(ValueError):
    """An FP8 weight cannot stay FP8 with this cut (K not on the 128-column groups)."""


@dataclass
class Fp8Weight:
    """w[o, i] = weight[o, i] * scale[o // block_n, i // 128] (scale with one column: [o // block_n, 0])."""

    weight: torch.Tensor  # [N, K] float8_e4m3fn
    scale: torch.Tensor  # [ceil(N / block_n), K / 128 or 1] float32
    block_n: int

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    @staticmethod
    def from_blocks(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> "Fp8Weight":
        """The checkpoint's (bo x bi)-block form (models/checkpoint_quant.Fp8Blocks) as this layout;
        Fp8Unaligned where it has none (K % 128, or column blocks neither 128 wide nor whole rows)."""
        n, k = weight.shape
        bo, bi = block
        if k % GROUP_K:
            raise Fp8Unaligned(f"in_features {k} is not a multiple of {GROUP_K}")
        if bi >= k:  # one scale per row block: per-channel (bo = 1) or per-tensor (bo = n)
            w = Fp8Weight(weight, scale.reshape(-1, 1).float(), bo)
            return w.per_row() if bo >= n and n > 1 else w
        if bi != GROUP_K:
            raise Fp8Unaligned(f"{bo}x{bi} scale blocks (the FP8 GEMM takes 128-column blocks or one scale per row)")
        return Fp8Weight(weight, scale.float(), bo)

    def per_row(self) -> "Fp8Weight":
        """The same values with one scale row per weight row (block_n = 1)."""
        if self.block_n == 1:
            return self
        n = self.weight.shape[0]
        return Fp8Weight(self.weight, self.scale.repeat_interleave(self.block_n, 0)[:n].contiguous(), 1)

    def narrow(self, dim: int, start: int, length: int) -> "Fp8Weight":
        n, k = self.weight.shape
        dim = dim % 2
        if dim == 0:
            aligned = start % self.block_n == 0 and (length % self.block_n == 0 or start + length == n)
            src = self if aligned else self.per_row()
            b = src.block_n
            rows = src.scale.narrow(0, start // b, -(-(start + length) // b) - start // b)
            return Fp8Weight(src.weight.narrow(0, start, length), rows, b)
        if start % GROUP_K or length % GROUP_K:
            raise Fp8Unaligned(f"columns [{start}, {start + length}) of {k} are not on {GROUP_K}-column groups")
        scale = self.scale if self.scale.shape[1] == 1 else self.scale.narrow(1, start // GROUP_K, length // GROUP_K)
        return Fp8Weight(self.weight.narrow(1, start, length), scale, self.block_n)

    def to(self, device: torch.device) -> "Fp8Weight":
        return Fp8Weight(self.weight.to(device).contiguous(), self.scale.to(device, torch.float32).contiguous(), self.block_n)

    def dense(self) -> torch.Tensor:
        """The [N, K] float32 weight this represents."""
        n, k = self.weight.shape
        s = self.scale.repeat_interleave(self.block_n, 0)[:n]
        s = s.expand(n, k // GROUP_K) if s.shape[1] == 1 else s
        return self.weight.float() * s.repeat_interleave(GROUP_K, 1)

    @staticmethod
    def cat(parts: Iterable["Fp8Weight"]) -> "Fp8Weight":
        """Parts stacked along the rows (a merged projection): one scale layout for all of them,
        block rows kept where every part but the last ends on a block, else one scale per row."""
        ps = list(parts)
        b = ps[0].block_n
        if any(p.block_n != b for p in ps) or any(p.weight.shape[0] % b for p in ps[:-1]):
            ps, b = [p.per_row() for p in ps], 1
        if len({p.scale.shape[1] for p in ps}) > 1:  # per-row-block and per-128-column scales: the latter
            kb = ps[0].weight.shape[1] // GROUP_K
            ps = [Fp8Weight(p.weight, p.scale.expand(-1, kb).contiguous(), p.block_n) for p in ps]
        return Fp8Weight(torch.cat([p.weight for p in ps]), torch.cat([p.scale for p in ps]), b)

    def install(self, module: nn.Module) -> None:
        """Make this the FP8 weight of linear layer `module` (its scales; the weight itself
        arrives through the state dict)."""
        module.weight_scale = self.scale  # type: ignore[assignment]
        module.weight_block_n = self.block_n  # type: ignore[assignment]


def keeps_fp8(device: torch.device, deterministic: bool, quantization: str | None) -> bool:
    """Whether FP8 checkpoints keep FP8 weights on this engine: on CUDA with Triton (the FP8
    GEMM), not in deterministic mode (its GEMMs must be batch-invariant; the dequantized weight's
    are), and for now only when asked (`--quantization fp8`): the kernels are checked in Triton's
    interpreter and compiled for sm_90, but not yet run on a GPU, so the default stays the
    dequantized path until an H200 run confirms them. Elsewhere they are dequantized at load."""
    import importlib.util

    if quantization != "fp8":
        return False
    return device.type == "cuda" and not deterministic and importlib.util.find_spec("triton") is not None


def quantize_groups_torch(x: torch.Tensor) -> torch.Tensor:
    """The activation quantizer's values (kernel/triton_fp8.quantize_groups), dequantized: per row
    and 128 columns, scale = absmax / 448, x / scale saturated and rounded to e4m3, times scale."""
    m, k = x.shape
    g = x.float().reshape(m, k // GROUP_K, GROUP_K)
    s = g.abs().amax(-1, keepdim=True).clamp(min=1e-10) / FP8_MAX
    return ((g / s).clamp(-FP8_MAX, FP8_MAX).to(FP8_E4M3).float() * s).reshape(m, k)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_n: int,
               bias: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """The FP8 linear op: x W^T (+ bias) with x quantized per (row, 128 columns). CUDA: the Triton
    kernels (kernel/triton_fp8.py); elsewhere the same arithmetic in float32 torch ops (the
    reference: no speed, the CPU never keeps FP8 weights outside tests)."""
    if x.is_cuda:
        from minisgl.kernel.triton_fp8 import fp8_linear as triton_fp8_linear

        return triton_fp8_linear(x, weight, scale, block_n, bias)
    flat = quantize_groups_torch(x.reshape(-1, x.shape[-1]))
    y = flat @ Fp8Weight(weight, scale, block_n).dense().t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).view(*x.shape[:-1], weight.shape[0])


def quantize_per_row(w: torch.Tensor) -> Fp8Weight:
    """Online FP8 (`--quantization fp8`): scale = absmax / 448 per output row, w / scale rounded
    to e4m3 (saturated)."""
    s = (w.float().abs().amax(1, keepdim=True).clamp(min=1e-12) / FP8_MAX).contiguous()
    q = (w.float() / s).clamp(-FP8_MAX, FP8_MAX).to(FP8_E4M3)
    return Fp8Weight(q, s, 1)
