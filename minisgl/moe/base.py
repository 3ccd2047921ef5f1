"""The MoE backend interface (the registry that creates backends is moe/registry.py).

A backend computes sum_k w[t,k] * expert_{ids[t,k]}(x[t]) for local expert weights
w13 [E, 2*I, H] (gate rows then up rows) and w2 [E, H, I]. Routing (top-k) happens in the layer.
A backend declares what it can do beyond the eager forward in one capability enum, `caps`, and
the expert options beyond bias-free SiLU-and-mul it computes in `expert_features`
(ModelConfig.moe_features: GPT-OSS's "expert_bias" on w13 and its "clamped_swiglu"); a model
that needs another is refused by the option's name (moe/registry.py).
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Tuple

import torch


class MoeCap(enum.Flag):
    NONE = 0
    # launches fixed by the shapes alone whatever the routing, no host sync: decode steps can be
    # captured in CUDA graphs
    DECODE_GRAPH = enum.auto()
    MIXED_GRAPH = enum.auto()  # prefill / mixed steps in CUDA graphs (no backend is checked for it yet)


@dataclass(frozen=True)
class ClampedSwiglu:
    """GPT-OSS's expert activation on [gate | up]: gate clamped to <= limit, up to [-limit, limit],
    (up + 1) * gate * sigmoid(alpha * gate)."""

    alpha: float
    limit: float

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        gate, up = h.chunk(2, dim=-1)
        gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


class BaseMoeBackend(ABC):
    caps: MoeCap = MoeCap.NONE
    expert_features: Tuple[str, ...] = ()

    @abstractmethod
    def forward(
        self,
        x: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        b13: torch.Tensor | None = None,
        activation: ClampedSwiglu | None = None,
    ) -> torch.Tensor:
        """`b13` [E, 2*I]: a bias on each expert's w13 product ("expert_bias"); `activation`
        None: SiLU-and-mul, else GPT-OSS's ("clamped_swiglu"). Only a backend that lists the
        feature is given it."""
