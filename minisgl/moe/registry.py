"""MoE backends by name: the registry, 'auto' resolution and creation.

Its own module so that base.py imports no backend: every backend imports base.py, and this
module imports each backend only when it is created.
"""

from __future__ import annotations

from typing import Callable, Sequence

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


def create_moe_backend(name: str, device: torch.device | None = None, features: Sequence[str] = ()) -> BaseMoeBackend:
    """The backend `name` ("auto": triton on CUDA where it imports and computes every expert
    `feature` the model needs, else torch, logged); an explicit backend lacking one is refused
    by name."""
    auto = name == "auto"
    if auto:
        name = "torch"
        if device is not None and device.type == "cuda" and "triton" in MOE_BACKENDS:
            try:
                import triton  # noqa: F401

                import minisgl.moe.triton_moe  # noqa: F401

                name = "triton"
            except ImportError:
                pass
    backend = MOE_BACKENDS.get(name)()
    missing = [f for f in features if f not in backend.expert_features]
    if missing and auto and name != "torch":
        from minisgl.utils.logger import init_logger

        init_logger(__name__).info_rank0(f"MoE backend: torch ({name} does not implement {', '.join(missing)})")
        return create_moe_backend("torch", device, features)
    if missing:
        raise ValueError(
            f"MoE backend {name!r} does not implement {', '.join(missing)} (the model's experts need it); "
            f"the torch MoE backend does (--moe-backend torch or auto)"
        )
    return backend
