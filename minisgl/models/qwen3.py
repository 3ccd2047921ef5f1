"""Qwen3: per-head RMSNorm on q and k before rotary; optional attention bias."""

from __future__ import annotations

from minisgl.models.base import CausalLM
from minisgl.models.config import ModelConfig


class Qwen3ForCausalLM(CausalLM):
    qk_norm = True

    def __init__(self, cfg: ModelConfig) -> None:
        self.qkv_bias = self.o_bias = cfg.attention_bias
        super().__init__(cfg)
