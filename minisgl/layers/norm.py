"""RMSNorm, computed the way HF does (float32 statistics, scale in the model dtype).

`unit_offset` is Gemma's kind: the scale is (1 + weight), applied in float32 before the cast
(transformers' Gemma2RMSNorm); only the torch code computes it, so the fused kernels below (and
every fast path that reads a norm's weight) take plain norms only.

On CUDA tensors (when triton imports) one Triton kernel does the same arithmetic, with the
residual add fused in (minisgl/kernel/triton_ops.py); on CPU tensors the C kernel of
kernel/cpu/ops.py does, where it was built."""

from __future__ import annotations

from typing import Tuple

import torch
from torch import nn

from minisgl.kernel.cpu import ops as cpu_ops
from minisgl.kernel.fused import triton_ops, use_fused
from minisgl.layers.base import ShardedModule


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if use_fused(x) and weight.dtype == x.dtype:
        return triton_ops().rms_norm(x, weight, eps)  # type: ignore[union-attr]
    if not x.is_cuda and (out := cpu_ops.rms_norm(x, weight, eps)) is not None:
        return out
    return rms_norm_torch(x, weight, eps)


def rms_norm_unit_offset(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * (1.0 + weight.float())).to(x.dtype)


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


class RMSNorm(ShardedModule):
    def __init__(self, hidden: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.unit_offset = unit_offset
        self.weight = nn.Parameter(torch.empty(hidden), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.unit_offset:
            return rms_norm_unit_offset(x, self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps)

    def forward_with_residual(self, x: torch.Tensor, residual: torch.Tensor | None) -> Tuple[torch.Tensor, torch.Tensor]:
        """Add the residual stream, then normalise; returns (normed, new residual)."""
        if self.unit_offset:
            x = x + residual if residual is not None else x
            return rms_norm_unit_offset(x, self.weight, self.eps), x
        if residual is not None and use_fused(x) and self.weight.dtype == x.dtype == residual.dtype:
            return triton_ops().fused_add_rms_norm(x, residual, self.weight, self.eps)  # type: ignore[union-attr]
        if not x.is_cuda and (fused := cpu_ops.add_rms_norm(x, residual, self.weight, self.eps)) is not None:
            return fused
        if residual is not None:
            x = x + residual
        return rms_norm(x, self.weight, self.eps), x
