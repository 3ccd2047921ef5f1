"""MoE backends by name: the registry, 'auto' resolution and creation.

Its own module so that base.py imports no backend: every backend imports base.py, and this
module imports each backend only when it is created.
"""

from __future__ import annotations

from typing import Callable

import torch

from minisgl.moe.base import BaseMoeBackend
from minisgl.utils.registry import Registry

MOE_BACKENDS: Registry[Callable[[], BaseMoeBackend]] = Registry("MoE backend")


@MOE_BACKENDS.register("torch")
def _torch_backend() -> BaseMoeBackend:
    from minisgl.moe.torch_moe import TorchMoeBackend

    return TorchMoeBackend()


@MOE_BACKENDS.register("triton")
def _triton_backend() -> BaseMoeBackend:
    from minisgl.moe.triton_moe import TritonMoeBackend

    return TritonMoeBackend()


def create_moe_backend(name: str, device: torch.device | None = None) -> BaseMoeBackend:
    if name == "auto":
        name = "torch"
        if device is not None and device.type == "cuda" and "triton" in MOE_BACKENDS:
            try:
                import triton  # noqa: F401

                import minisgl.moe.triton_moe  # noqa: F401

                name = "triton"
            except ImportError:
                pass
    return MOE_BACKENDS.get(name)()
