"""OLMo 2: post-norm blocks (no norm before attention or the MLP; `post_attention_layernorm` and
`post_feedforward_layernorm` normalise each block's output before its residual add) and q/k
RMSNorm over the whole q and k projections (all heads at once), before rotary."""

from __future__ import annotations

from typing import Any, Tuple

from minisgl.models.base import CausalLM
from minisgl.models.config import ModelConfig

# checkpoint name -> ours (DecoderLayer's post-norm slots)
_POST_NORMS = ((".post_attention_layernorm.", ".attn_out_norm."), (".post_feedforward_layernorm.", ".mlp_out_norm."))


class Olmo2ForCausalLM(CausalLM):
    qk_norm = "wide"
    pre_norms = False
    post_norms = True

    def __init__(self, cfg: ModelConfig) -> None:
        self.qkv_bias = self.o_bias = cfg.attention_bias
        super().__init__(cfg)

    def map_weight_name(self, name: str) -> Tuple[str, Any] | None:
        for src, dst in _POST_NORMS:
            name = name.replace(src, dst)
        return super().map_weight_name(name)
