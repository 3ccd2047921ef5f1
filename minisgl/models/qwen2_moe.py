"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2 attention (q/k/v bias); sparse MoE blocks with
`norm_topk_prob` as configured plus a shared expert (a dense MLP every token takes, scaled by a
sigmoid gate); `decoder_sparse_step` / `mlp_only_layers` leave some layers dense."""

from __future__ import annotations

from typing import Any, Tuple

import torch
from torch import nn

from minisgl.layers import ReplicatedLinear
from minisgl.models.base import CausalLM, GatedMLP
from minisgl.models.config import ModelConfig
from minisgl.models.qwen3_moe import SparseMoeBlock, map_expert_weight


class SharedExpertMoeBlock(SparseMoeBlock):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.shared_expert = GatedMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size, cfg.hidden_act)
        self.shared_expert_gate = ReplicatedLinear(cfg.hidden_size, 1)

    def experts_forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert.mlp(x)
        return super().experts_forward(x) + shared


class Qwen2MoeForCausalLM(CausalLM):
    qkv_bias = True
    o_bias = False

    def build_mlp(self, cfg: ModelConfig, layer_id: int) -> nn.Module:
        if not cfg.layer_is_moe(layer_id):
            return GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
        return SharedExpertMoeBlock(cfg) if cfg.shared_expert_intermediate_size else SparseMoeBlock(cfg)

    def map_weight_name(self, name: str) -> Tuple[str, Any] | None:
        # the experts' names are Qwen3-MoE's (mlp.experts.{i}.gate/up/down_proj)
        return map_expert_weight(name) or super().map_weight_name(name)
