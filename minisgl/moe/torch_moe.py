"""Reference MoE: loop over the experts that received tokens (works on CPU and CUDA)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minisgl.layers.activation import silu_and_mul
from minisgl.moe.base import BaseMoeBackend, ClampedSwiglu


class TorchMoeBackend(BaseMoeBackend):
    expert_features = ("expert_bias", "clamped_swiglu")

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
        out = torch.zeros_like(x)
        num_experts = w13.shape[0]
        # [E, k, T] one-hot of which (token, slot) pairs go to each expert
        mask = F.one_hot(topk_ids.long(), num_classes=num_experts).permute(2, 1, 0)
        hit = torch.nonzero(mask.sum(dim=(1, 2)) > 0).flatten().tolist()
        for e in hit:
            slot, token = torch.where(mask[e])
            h = F.linear(x[token], w13[e], b13[e] if b13 is not None else None)
            h = silu_and_mul(h) if activation is None else activation(h)
            h = F.linear(h, w2[e]) * topk_weights[token, slot, None]
            out.index_add_(0, token, h.to(out.dtype))
        return out
