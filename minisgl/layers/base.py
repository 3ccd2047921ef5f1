"""The weight-loading half of the sharding contract (see layers/__init__.py)."""

from __future__ import annotations

from typing import Any, Dict, Sequence

import torch
from torch import nn


class ShardedModule(nn.Module):
    """A module whose parameters are loaded from (possibly several) full checkpoint tensors."""

    def shard(self, param_name: str, full: torch.Tensor, part: Any = None) -> torch.Tensor:
        return full  # replicated by default

    def parts(self, param_name: str) -> Sequence[Any] | None:
        return None  # one checkpoint tensor per parameter by default

    def merge(self, param_name: str, shards: Dict[Any, torch.Tensor]) -> torch.Tensor:
        return torch.cat([shards[p] for p in self.parts(param_name) or ()], dim=0)


def narrow_rank(full: torch.Tensor, dim: int, local: int, index: int) -> torch.Tensor:
    """Slice `local` rows of `dim` for shard `index`, zero-padding past the end (uneven vocab)."""
    start = index * local
    end = min(start + local, full.shape[dim])
    piece = full.narrow(dim, start, max(end - start, 0))
    if piece.shape[dim] == local:
        return piece
    pad_shape = list(full.shape)
    pad_shape[dim] = local - piece.shape[dim]
    return torch.cat([piece, full.new_zeros(pad_shape)], dim=dim)
