"""The MoE backend interface (the registry that creates backends is moe/registry.py).

A backend computes sum_k w[t,k] * expert_{ids[t,k]}(x[t]) for local expert weights
w13 [E, 2*I, H] (gate rows then up rows) and w2 [E, H, I]. Routing (top-k) happens in the layer.
A backend declares what it can do beyond the eager forward in one capability enum, `caps`.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod

import torch


class MoeCap(enum.Flag):
    NONE = 0
    # launches fixed by the shapes alone whatever the routing, no host sync: decode steps can be
    # captured in CUDA graphs
    DECODE_GRAPH = enum.auto()
    MIXED_GRAPH = enum.auto()  # prefill / mixed steps in CUDA graphs (no backend is checked for it yet)


class BaseMoeBackend(ABC):
    caps: MoeCap = MoeCap.NONE

    @abstractmethod
    def forward(
        self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor: ...
