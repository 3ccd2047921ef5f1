"""The "pre-norm, then project" op of a decoder block: residual add + RMSNorm, a linear layer,
and SiLU-and-mul of its [gate | up] output when `gated`.

Native implementation: the three modules in turn (each picks its own CPU / CUDA kernel; a
gated projection's `forward_silu_and_mul`, which on CPU can fuse the SiLU into the GEMM). CUDA
implementation: one skinny GEMV launch (kernel/skinny.py, kernel/triton_gemv.py) where the plan
the engine measured at init and bound to `linear` covers this batch size and weight shape; the
arithmetic and rounding points are the same, only the dot's summation order differs.
"""

from __future__ import annotations

from typing import Tuple

import torch

from minisgl.layers.linear import _Linear
from minisgl.layers.norm import PreNorm, RMSNorm


def norm_linear(
    norm: PreNorm, linear: _Linear, x: torch.Tensor, residual: torch.Tensor | None, gated: bool = False
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(linear(norm(x + residual)), silu-and-mul'ed when gated; the new residual stream)."""
    if isinstance(norm, RMSNorm) and linear.skinny is not None and linear.fused_kind == ("gated" if gated else "norm"):
        fused = linear.skinny.run(linear.fused_kind, x, linear.weight, residual, norm)
        if fused is not None:
            y, new_residual = fused
            return y, new_residual if new_residual is not None else x  # layer 0: the stream starts as x
    h, residual = norm.forward_with_residual(x, residual)
    return (linear.forward_silu_and_mul(h) if gated else linear(h)), residual
