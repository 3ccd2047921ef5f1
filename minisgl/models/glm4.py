"""GLM-4 (GLM-4-0414, `Glm4ForCausalLM`): q/k/v bias (none on o), partial rotary
(`partial_rotary_factor`, 0.5) in GLM's interleaved layout (adjacent pairs rotate), a norm on
each block's output before its residual add (`post_self_attn_layernorm`, `post_mlp_layernorm`)
besides the pre-norms, and gate/up stored fused (`gate_up_proj`, split by the loader)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Tuple

from minisgl.models.base import CausalLM
from minisgl.models.config import ModelConfig
from minisgl.models.weight import Fused

_POST_NORMS = ((".post_self_attn_layernorm.", ".attn_out_norm."), (".post_mlp_layernorm.", ".mlp_out_norm."))


class Glm4ForCausalLM(CausalLM):
    post_norms = True

    def __init__(self, cfg: ModelConfig) -> None:
        self.qkv_bias = cfg.attention_bias
        super().__init__(replace(cfg, rotary_config=replace(cfg.rotary_config, interleaved=True)))

    def map_weight_name(self, name: str) -> Tuple[str, Any] | None:
        if ".mlp.gate_up_proj." in name:
            n = self.config.intermediate_size
            return name, Fused(((0, n), (1, n)))
        for src, dst in _POST_NORMS:
            name = name.replace(src, dst)
        return super().map_weight_name(name)
