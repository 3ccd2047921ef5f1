"""Collectives over torch.distributed (gloo on CPU, NCCL on CUDA). With one rank they are identities."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from minisgl.distributed.info import get_tp_info


def init_process_group(addr: str, rank: int, size: int, device: torch.device, timeout_s: float) -> None:
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend=backend, init_method=addr, rank=rank, world_size=size, timeout=timedelta(seconds=timeout_s)
    )


def destroy_process_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if get_tp_info().size == 1:
        return x
    dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's shard along the last dimension (vocab-parallel logits)."""
    size = get_tp_info().size
    if size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)
