"""Qwen3-MoE: Qwen3 attention; sparse MoE blocks (softmax router, top-k, optional renorm)."""

from __future__ import annotations

import re
from typing import Any, Dict, Sequence, Tuple

import torch
from torch import nn

from minisgl.core import get_global_ctx
from minisgl.distributed import all_reduce, get_tp_info
from minisgl.layers import ReplicatedLinear, RMSNorm
from minisgl.layers.base import ShardedModule, narrow_rank
from minisgl.models.base import GatedMLP
from minisgl.models.config import ModelConfig
from minisgl.models.qwen3 import Qwen3ForCausalLM
from minisgl.utils.misc import div_even

_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")


class FusedExperts(ShardedModule):
    """All experts' weights of one layer, sharded on the intermediate dim (like gate_up/down)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.local_inter = div_even(intermediate, get_tp_info().size)
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * self.local_inter, hidden), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, self.local_inter), requires_grad=False)

    def parts(self, param_name: str) -> Sequence[Any]:
        if param_name == "w13":
            return [(e, j) for e in range(self.num_experts) for j in (0, 1)]
        return list(range(self.num_experts))

    def shard(self, param_name: str, full: torch.Tensor, part: Any = None) -> torch.Tensor:
        dim = 0 if param_name == "w13" else 1
        return narrow_rank(full, dim, self.local_inter, get_tp_info().rank)

    def merge(self, param_name: str, shards: Dict[Any, torch.Tensor]) -> torch.Tensor:
        if param_name == "w13":
            return torch.stack([torch.cat([shards[(e, 0)], shards[(e, 1)]]) for e in range(self.num_experts)])
        return torch.stack([shards[e] for e in range(self.num_experts)])


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.gate = ReplicatedLinear(cfg.hidden_size, cfg.num_experts)
        self.experts = FusedExperts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm) -> Tuple[torch.Tensor, torch.Tensor]:
        """The block protocol of models/base.py: pre-norm, then the experts."""
        h, residual = norm.forward_with_residual(x, residual)
        return self.experts_forward(h), residual

    def experts_forward(self, x: torch.Tensor) -> torch.Tensor:
        router_logits = self.gate(x)
        probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
        topk_weights, topk_ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
        topk_weights = topk_weights.to(x.dtype)
        backend = get_global_ctx().moe_backend
        assert backend is not None
        out = backend.forward(x, self.experts.w13, self.experts.w2, topk_weights, topk_ids)
        return all_reduce(out)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    def build_mlp(self, cfg: ModelConfig, layer_id: int) -> nn.Module:
        if cfg.layer_is_moe(layer_id):
            return SparseMoeBlock(cfg)
        return GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)

    def map_weight_name(self, name: str) -> Tuple[str, Any] | None:
        return map_expert_weight(name) or super().map_weight_name(name)


def map_expert_weight(name: str) -> Tuple[str, Any] | None:
    """An expert's checkpoint tensor (mlp.experts.{i}.gate/up/down_proj) -> (the layer's merged
    expert parameter, its part); None for any other name."""
    m = _EXPERT.search(name)
    if m is None:
        return None
    prefix = name[: m.start()]
    expert, proj = int(m.group(1)), m.group(2)
    if proj == "down":
        return f"{prefix}.mlp.experts.w2", expert
    return f"{prefix}.mlp.experts.w13", (expert, 0 if proj == "gate" else 1)
