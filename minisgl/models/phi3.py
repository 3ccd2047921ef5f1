"""Phi-3 / Phi-3.5 / Phi-4-mini: Llama's layer, with q/k/v and gate/up stored fused in the checkpoint.

Phi-4-mini is the same class with partial rotary (`partial_rotary_factor` 0.75) and a tied head;
Phi-3.5 and Phi-4-mini use LongRoPE (`rope_scaling` type "longrope", layers/rotary.py), and a
sliding window shorter than the context (Phi-3-mini-4k) cuts the context to it (models/config.py).
"""

from __future__ import annotations

from typing import Any, Tuple

from minisgl.models.base import CausalLM
from minisgl.models.config import ModelConfig
from minisgl.models.weight import Fused


class Phi3ForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig) -> None:
        if cfg.attention_bias:
            raise ValueError("Phi3ForCausalLM: attention_bias is not part of Phi-3 (its checkpoints have no biases)")
        super().__init__(cfg)

    def map_weight_name(self, name: str) -> Tuple[str, Any] | None:
        cfg = self.config
        if ".self_attn.qkv_proj." in name:
            q, kv = cfg.num_qo_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
            return name, Fused((("q", q), ("k", kv), ("v", kv)))
        if ".mlp.gate_up_proj." in name:
            return name, Fused(((0, cfg.intermediate_size), (1, cfg.intermediate_size)))
        return super().map_weight_name(name)
