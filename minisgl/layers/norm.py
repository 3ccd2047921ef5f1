"""RMSNorm, computed the way HF does (float32 statistics, scale in the model dtype).

`unit_offset` is Gemma's kind: the scale is (1 + weight), applied in float32 before the cast
(transformers' Gemma2RMSNorm); only the torch code computes it, so the fused kernels below (and
every fast path that reads a norm's weight) take plain norms only.

On CUDA tensors (when triton imports) one Triton kernel does the same arithmetic, with the
residual add fused in (minisgl/kernel/triton_ops.py); on CPU tensors the C kernel of
kernel/cpu/ops.py does, where it was built."""

from __future__ import annotations

from typing import Tuple, Union

import torch
from torch import nn

from minisgl.distributed import all_reduce, get_tp_info
from minisgl.kernel.cpu import ops as cpu_ops
from minisgl.kernel.fused import triton_ops, use_fused
from minisgl.layers.base import ShardedModule, narrow_rank


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


class ResidualAdd(nn.Module):
    """The pre-norm slot of a block that has none (OLMo 2's post-norm layers): only the deferred
    residual add, so every block keeps the `block(x, residual, norm)` protocol."""

    def forward_with_residual(self, x: torch.Tensor, residual: torch.Tensor | None) -> Tuple[torch.Tensor, torch.Tensor]:
        x = x if residual is None else x + residual
        return x, x


class WideRMSNorm(RMSNorm):
    """RMSNorm over a whole projection (OLMo 2's q/k norm: all heads at once, not per head). At
    tp > 1 each rank holds its heads' columns, so the sum of squares is all-reduced first: every
    rank normalises by the full width's statistics, as the unsharded model does."""

    def __init__(self, width: int, eps: float) -> None:
        size = get_tp_info().size
        if width % size:
            raise ValueError(f"a width-{width} RMSNorm does not split evenly over {size} ranks")
        super().__init__(width // size, eps)
        self.width = width

    def shard(self, param_name: str, full: torch.Tensor, part: object = None) -> torch.Tensor:
        return narrow_rank(full, 0, self.weight.shape[0], get_tp_info().rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if get_tp_info().size == 1:
            return rms_norm(x, self.weight, self.eps)
        xf = x.float()
        sum_sq = all_reduce(xf.pow(2).sum(-1, keepdim=True))
        return self.weight * (xf * torch.rsqrt(sum_sq / self.width + self.eps)).to(x.dtype)


# what sits before a block's first projection: a norm, or only the residual add
PreNorm = Union[RMSNorm, ResidualAdd]
