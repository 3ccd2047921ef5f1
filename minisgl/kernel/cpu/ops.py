"""The CPU implementations of the layers' row-wise ops, on the C kernels (kernels.c).

Each op returns None where its kernel does not apply (not a CPU tensor, a dtype the kernels were
not built for, a strided view, no C compiler), and the layer then runs its torch code: these are
the "cpu" implementations behind layers/norm.py's and layers/activation.py's interfaces, the
same arithmetic (RMSNorm statistics in fp32, scale in the model dtype).
"""

from __future__ import annotations

from typing import Any, Tuple

import torch

from minisgl.kernel.cpu import SUFFIX, cpu_kernels


def _rows(x: torch.Tensor) -> Any:
    """The kernel library for the rows of `x` (last dim contiguous rows), or None."""
    if x.device.type != "cpu" or x.dtype not in SUFFIX or not x.is_contiguous() or x.dim() == 0:
        return None
    return cpu_kernels()


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> Tuple[torch.Tensor, torch.Tensor] | None:
    """(rms_norm(x + residual), x + residual) as new tensors, or (rms_norm(x), x) when residual is
    None (the first layer: the stream starts as x); None where the kernel does not apply."""
    k = _rows(x)
    if k is None or weight.dtype != x.dtype or not weight.is_contiguous():
        return None
    if residual is not None and (residual.dtype != x.dtype or not residual.is_contiguous() or residual.shape != x.shape):
        return None
    h = x.shape[-1]
    out = torch.empty_like(x)
    # the kernel adds into its residual argument: a copy, so the caller's stream stays as it was
    # (with none it stores x into x, unchanged)
    res = x if residual is None else residual.clone()
    k.get("add_rms_norm", x.dtype)(x.data_ptr(), res.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // h,
                                   h, eps, int(residual is not None))  # fmt: skip
    return out, res


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """rms_norm(x): add_rms_norm with no residual (the same kernel call)."""
    fused = add_rms_norm(x, None, weight, eps)
    return None if fused is None else fused[0]


def silu_and_mul(x: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up of x = [gate | up] rows; None where the kernel does not apply."""
    k = _rows(x)
    if k is None:
        return None
    inter = x.shape[-1] // 2
    out = x.new_empty(*x.shape[:-1], inter)
    k.get("silu_mul", x.dtype)(x.data_ptr(), out.data_ptr(), x.numel() // x.shape[-1], inter)
    return out
