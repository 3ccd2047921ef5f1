"""Qwen2: Llama with a bias on q/k/v (never on o)."""

from __future__ import annotations

from minisgl.models.base import CausalLM


class Qwen2ForCausalLM(CausalLM):
    qkv_bias = True
    o_bias = False
