"""Gated activations (one Triton kernel on CUDA tensors when triton imports, the C kernel of
kernel/cpu/ops.py on CPU tensors where it was built)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minisgl.kernel.cpu import ops as cpu_ops
from minisgl.kernel.fused import triton_ops, use_fused


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up] along the last dim -> silu(gate) * up."""
    if use_fused(x):
        return triton_ops().silu_and_mul(x)  # type: ignore[union-attr]
    if not x.is_cuda and (out := cpu_ops.silu_and_mul(x)) is not None:
        return out
    return silu_and_mul_torch(x)


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up] -> gelu(gate, tanh approximation) * up (Gemma's gelu_pytorch_tanh)."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
