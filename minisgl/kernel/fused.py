"""When to use the Triton kernels of `minisgl.kernel.triton_ops` instead of the torch ops.

`use_fused(x)` is true only for CUDA tensors when triton imports (checked once, lazily: a CPU
process never imports triton because `x.is_cuda` is tested first). `set_fused_ops_enabled(False)`
turns the kernels off in this process, for checks that compare them with the torch ops on a GPU.
"""

from __future__ import annotations

from types import ModuleType

import torch

_state: dict = {"enabled": True, "module": None, "checked": False}


def set_fused_ops_enabled(enabled: bool) -> bool:
    """Turn the fused kernels on or off; returns the previous setting."""
    previous = bool(_state["enabled"])
    _state["enabled"] = bool(enabled)
    return previous


def fused_ops_enabled() -> bool:
    return bool(_state["enabled"])


def triton_ops() -> ModuleType | None:
    """The kernel module, or None when triton cannot be imported (imported on first call)."""
    if not _state["checked"]:
        _state["checked"] = True
        try:
            from minisgl.kernel import triton_ops as module

            _state["module"] = module
        except ImportError:
            _state["module"] = None
    return _state["module"]


def use_fused_on(device: torch.device) -> bool:
    """Whether tensors on `device` take the Triton kernels (for decisions made before any tensor exists)."""
    return device.type == "cuda" and _state["enabled"] and triton_ops() is not None


def use_fused(x: torch.Tensor) -> bool:
    return x.is_cuda and _state["enabled"] and triton_ops() is not None
