"""Gemma 2 and Gemma 3 (text): Llama's projections with four (1 + w) RMSNorms per layer (pre- and
post-norm around attention and around the MLP), a GELU-tanh gated MLP, the embedding scaled by
sqrt(hidden), tied embeddings, interleaved sliding-window and global layers.

Gemma 2 soft-caps the attention scores and the final logits (tanh(s / c) * c); Gemma 3 instead
normalises q and k per head (the (1 + w) kind) and rotates sliding layers with their own base
(`rope_local_base_freq`). The attention backends mask each layer's window and apply the scale
(`query_pre_attn_scalar`^-0.5) and soft-cap from the ModelConfig (`layer_windows`, `attn_scale`,
`attn_logit_softcapping`), or refuse the model at init.

The blocks call their projections as plain linears (`fused_kind` "plain") after their own norm:
the fused norm + GEMV kernels compute plain RMSNorm, not the unit-offset kind.
"""

from __future__ import annotations

from typing import Any, Dict, Tuple

import torch
from torch import nn

from minisgl.distributed import get_tp_info
from minisgl.layers import (
    AttentionLayer,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RowParallelLinear,
    get_rope,
)
from minisgl.layers.activation import gelu_tanh_and_mul
from minisgl.models.base import CausalLM, DecoderLayer, DecoderModel
from minisgl.models.config import ModelConfig
from minisgl.utils.misc import div_even


def _norm(cfg: ModelConfig, size: int) -> RMSNorm:
    return RMSNorm(size, cfg.rms_norm_eps, unit_offset=True)


class GemmaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, qk_norm: bool) -> None:
        super().__init__()
        tp = get_tp_info()
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_qo_heads, cfg.num_kv_heads, False)
        self.o_proj = RowParallelLinear(cfg.num_qo_heads * cfg.head_dim, cfg.hidden_size, False)
        self.q_norm = _norm(cfg, cfg.head_dim) if qk_norm else None
        self.k_norm = _norm(cfg, cfg.head_dim) if qk_norm else None
        self.attn = AttentionLayer(
            layer_id,
            num_q_heads=div_even(cfg.num_qo_heads, tp.size),
            num_kv_heads=div_even(cfg.num_kv_heads, tp.size, allow_replicate=True),
            head_dim=cfg.head_dim,
            rotary=get_rope(cfg.rotary_of(layer_id)),
            q_norm=self.q_norm,
            k_norm=self.k_norm,
        )

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm) -> Tuple[torch.Tensor, torch.Tensor]:
        h, residual = norm.forward_with_residual(x, residual)
        return self.o_proj(self.attn(self.qkv_proj(h))), residual


class GemmaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.hidden_act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"{cfg.architecture}: unsupported hidden_activation {cfg.hidden_act!r}; supported: gelu_pytorch_tanh")
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size, cfg.intermediate_size])
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm) -> Tuple[torch.Tensor, torch.Tensor]:
        h, residual = norm.forward_with_residual(x, residual)
        return self.down_proj(gelu_tanh_and_mul(self.gate_up_proj(h))), residual


def _layer(cfg: ModelConfig, layer_id: int, qk_norm: bool) -> DecoderLayer:
    """x -> x + post_attn(attn(input_norm(x))) -> that + post_ff(mlp(pre_ff(that))): the shared
    layer with post-norms, every norm of the (1 + w) kind (Gemma's names: `map_weight_name`)."""
    unit = lambda size, eps: RMSNorm(size, eps, unit_offset=True)  # noqa: E731
    return DecoderLayer(cfg, GemmaAttention(cfg, layer_id, qk_norm), GemmaMLP(cfg), post_norms=True, norm=unit)


# Gemma's per-layer norm names -> the shared layer's (the post-attention norm is the attention
# block's output norm there; the MLP's pre-norm is the shared layer's post_attention_layernorm)
_NORM_NAMES = {
    ".post_attention_layernorm.": ".attn_out_norm.",
    ".pre_feedforward_layernorm.": ".post_attention_layernorm.",
    ".post_feedforward_layernorm.": ".mlp_out_norm.",
}


class GemmaModel(DecoderModel):
    def __init__(self, cfg: ModelConfig, qk_norm: bool) -> None:
        super().__init__(cfg, [_layer(cfg, i, qk_norm) for i in range(cfg.num_layers)])
        self.norm = _norm(cfg, cfg.hidden_size)
        self.embed_scale = cfg.hidden_size**0.5
        self._scales: Dict[torch.dtype, float] = {}

    def _scale(self, dtype: torch.dtype) -> float:
        """sqrt(hidden) as transformers multiplies by it: a float32 tensor rounded to the model
        dtype (a Python float of that value: the product rounds the same, and nothing is
        allocated per step)."""
        if dtype not in self._scales:
            self._scales[dtype] = float(torch.tensor(self.embed_scale, dtype=torch.float32).to(dtype))
        return self._scales[dtype]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        x, residual = x * self._scale(x.dtype), None
        for layer in self.layers:
            x, residual = layer(x, residual)
        x, _ = self.norm.forward_with_residual(x, residual)
        return x


class Gemma2ForCausalLM(CausalLM):
    qk_norm = False

    def __init__(self, cfg: ModelConfig) -> None:
        if cfg.attention_bias:
            raise ValueError(f"{cfg.architecture}: attention_bias is not implemented (no Gemma checkpoint has one)")
        nn.Module.__init__(self)
        self.config = cfg
        # (not CausalLM.__init__: its layers are the Llama-shaped DecoderLayer)
        self.model = GemmaModel(cfg, self.qk_norm)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        # inside the head, so every runner and the prompt logprobs see the capped logits
        self.lm_head.softcap = cfg.final_logit_softcapping

    def map_weight_name(self, name: str) -> Tuple[str, Any] | None:
        for gemma, ours in _NORM_NAMES.items():
            if gemma in name:
                name = name.replace(gemma, ours)
                break
        return super().map_weight_name(name)


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    qk_norm = True
