"""SmolLM3: Llama's layer, with NoPE layers (no rotary at all) where the config's
`no_rope_layers` flags say (transformers derives them from `no_rope_layer_interval`: every
fourth layer by default); models/config.py reads them, the attention layer skips the rotation."""

from __future__ import annotations

from minisgl.models.base import CausalLM
from minisgl.models.config import ModelConfig


class SmolLM3ForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig) -> None:
        if cfg.mlp_bias:
            raise ValueError("SmolLM3ForCausalLM: mlp_bias is not supported (no SmolLM3 checkpoint sets it)")
        self.qkv_bias = self.o_bias = cfg.attention_bias
        super().__init__(cfg)
