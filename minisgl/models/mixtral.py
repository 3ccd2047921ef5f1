"""Mixtral: Llama attention; every MLP a sparse MoE block (softmax router, top-k, the top-k
weights always renormalised), run by the fused MoE backend (minisgl/moe/) like Qwen3-MoE's.

The checkpoint names the block `block_sparse_moe` and an expert's projections w1 (gate), w3 (up)
and w2 (down); they load into the same merged expert tensors as Qwen3-MoE's."""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any, Tuple

from torch import nn

from minisgl.models.base import CausalLM
from minisgl.models.config import ModelConfig
from minisgl.models.qwen3_moe import SparseMoeBlock

_EXPERT = re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.(w1|w2|w3)\.weight$")


class MixtralForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig) -> None:
        if not cfg.is_moe:
            raise ValueError("MixtralForCausalLM: the config sets no num_local_experts")
        self.qkv_bias = self.o_bias = cfg.attention_bias
        super().__init__(replace(cfg, norm_topk_prob=True))  # Mixtral's router always renormalises

    def build_mlp(self, cfg: ModelConfig, layer_id: int) -> nn.Module:
        return SparseMoeBlock(cfg)

    def map_weight_name(self, name: str) -> Tuple[str, Any] | None:
        m = _EXPERT.search(name)
        if m is None:
            return super().map_weight_name(name.replace(".block_sparse_moe.gate.", ".mlp.gate."))
        prefix, expert, proj = name[: m.start()], int(m.group(1)), m.group(2)
        if proj == "w2":
            return f"{prefix}.mlp.experts.w2", expert
        return f"{prefix}.mlp.experts.w13", (expert, 0 if proj == "w1" else 1)
