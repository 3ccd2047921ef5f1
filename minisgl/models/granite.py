"""Granite (IBM Granite 3.x dense): Llama's layer with four scalars: the embeddings times
`embedding_multiplier`, each block's output times `residual_multiplier` before its residual add,
`attention_multiplier` as the attention scale (instead of 1/sqrt(head_dim)), and the logits
divided by `logits_scaling`. models/config.py reads them; base.py and the layers apply them."""

from __future__ import annotations

from minisgl.models.base import CausalLM
from minisgl.models.config import ModelConfig


class GraniteForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig) -> None:
        if cfg.mlp_bias:
            raise ValueError("GraniteForCausalLM: mlp_bias is not supported (no Granite dense checkpoint sets it)")
        self.qkv_bias = self.o_bias = cfg.attention_bias
        super().__init__(cfg)
