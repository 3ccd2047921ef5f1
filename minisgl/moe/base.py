"""The MoE backend interface and its registry.

A backend computes sum_k w[t,k] * expert_{ids[t,k]}(x[t]) for local expert weights
w13 [E, 2*I, H] (gate rows then up rows) and w2 [E, H, I]. Routing (top-k) happens in the layer.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable

import torch

from minisgl.utils.registry import Registry


class BaseMoeBackend(ABC):
    @abstractmethod
    def forward(
        self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor: ...


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

                from minisgl.moe import triton_moe  # noqa: F401

                name = "triton"
            except ImportError:
                pass
    return MOE_BACKENDS.get(name)()
