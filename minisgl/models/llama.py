"""Llama (also Mistral and SmolLM2): plain GQA attention, optional attention bias on q/k/v/o."""

from __future__ import annotations

from minisgl.models.base import CausalLM
from minisgl.models.config import ModelConfig


class LlamaForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig) -> None:
        self.qkv_bias = self.o_bias = cfg.attention_bias
        super().__init__(cfg)


class MistralForCausalLM(LlamaForCausalLM):
    pass
