"""The decoder-only transformer shared by every supported architecture.

Architectures differ in a few switches (q/k/v bias, per-head q/k RMSNorm, MoE blocks), so each
architecture module is a small subclass of `CausalLM` that sets them. Submodule names follow the
HF checkpoints (model.layers.N.self_attn..., lm_head) so weight names map with a few rules.

This is the only definition of the layer: fast paths replace its ops (the norms, `norm_linear`,
the linear layers, attention, MoE) behind their interfaces, or replay it whole (CUDA graphs, the
CPU runner). A block (attention, MLP, MoE) takes the residual stream and its pre-norm,
`block(x, residual, norm) -> (out, residual)`, so the norm can fuse into its first projection.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Sequence, Tuple

import torch
from torch import nn

from minisgl.core import get_global_ctx
from minisgl.distributed import get_tp_info
from minisgl.layers import (
    AttentionLayer,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
    get_rope,
)
from minisgl.layers.norm_linear import norm_linear
from minisgl.models.config import ModelConfig
from minisgl.utils.misc import div_even


class SelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, qkv_bias: bool, o_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        tp = get_tp_info()
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_qo_heads, cfg.num_kv_heads, qkv_bias)
        self.o_proj = RowParallelLinear(cfg.num_qo_heads * cfg.head_dim, cfg.hidden_size, o_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.attn = AttentionLayer(
            layer_id,
            num_q_heads=div_even(cfg.num_qo_heads, tp.size),
            num_kv_heads=div_even(cfg.num_kv_heads, tp.size, allow_replicate=True),
            head_dim=cfg.head_dim,
            rotary=get_rope(cfg.rotary_config),
            q_norm=self.q_norm,
            k_norm=self.k_norm,
        )
        self.qkv_proj.fused_kind = "norm"  # called through norm_linear below

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm) -> Tuple[torch.Tensor, torch.Tensor]:
        qkv, residual = norm_linear(norm, self.qkv_proj, x, residual)
        return self.o_proj(self.attn(qkv)), residual


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str) -> None:
        super().__init__()
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r}; supported: silu")
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate, intermediate])
        self.down_proj = RowParallelLinear(intermediate, hidden)
        self.gate_up_proj.fused_kind = "gated"  # called through norm_linear below

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm) -> Tuple[torch.Tensor, torch.Tensor]:
        act, residual = norm_linear(norm, self.gate_up_proj, x, residual, gated=True)
        return self.down_proj(act), residual


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, self_attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None) -> Tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.self_attn(x, residual, self.input_layernorm)
        return self.mlp(h, residual, self.post_attention_layernorm)


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, layers: Sequence[nn.Module]) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(x, residual)
        x, _ = self.norm.forward_with_residual(x, residual)
        return x


# checkpoint substring -> (our substring, part of the merged parameter)
STACKED_PARAMS: Tuple[Tuple[str, str, Any], ...] = (
    (".q_proj.", ".qkv_proj.", "q"),
    (".k_proj.", ".qkv_proj.", "k"),
    (".v_proj.", ".qkv_proj.", "v"),
    (".gate_proj.", ".gate_up_proj.", 0),
    (".up_proj.", ".gate_up_proj.", 1),
)


class CausalLM(nn.Module):
    """Decoder + LM head. `forward()` takes no arguments: it reads the batch from the Context and
    returns one row of logits per (padded) request: the last token's."""

    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        layers = [DecoderLayer(cfg, self.build_attention(cfg, i), self.build_mlp(cfg, i)) for i in range(cfg.num_layers)]
        self.model = DecoderModel(cfg, layers)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)

    def build_attention(self, cfg: ModelConfig, layer_id: int) -> nn.Module:
        return SelfAttention(cfg, layer_id, qkv_bias=self.qkv_bias, o_bias=self.o_bias, qk_norm=self.qk_norm)

    def build_mlp(self, cfg: ModelConfig, layer_id: int) -> nn.Module:
        return GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)

    def forward(self) -> torch.Tensor:
        """Logits of each request's last token, or with `batch.return_hidden` the final-normed
        hidden state of every fed token (the embed task pools them, engine/pooling.py)."""
        batch = get_global_ctx().batch
        hidden = self.model(batch.input_ids)
        if batch.return_hidden:  # the embed task: every fed row after the final norm, pooled by the engine
            return hidden
        if batch.is_prefill:
            if batch.prompt_logprob_rows is not None:  # prompt logprobs: the engine projects these rows
                batch.prompt_hidden = hidden[batch.prompt_logprob_rows]
            hidden = hidden[batch.attn_metadata.last_indices]
        return self.lm_head(hidden)

    # ---- weights -------------------------------------------------------------------------
    def map_weight_name(self, name: str) -> Tuple[str, Any] | None:
        """Checkpoint name -> (our parameter name, part) or None to skip it."""
        if "rotary_emb.inv_freq" in name:
            return None
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            return None
        if self.config.is_bare_decoder and not name.startswith("model."):
            name = "model." + name  # a bare decoder's checkpoint names its weights from the decoder down
        for src, dst, part in STACKED_PARAMS:
            if src in name:
                return name.replace(src, dst), part
        return name, None

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True, assign: bool = True) -> Any:  # type: ignore[override]
        """Install loaded weights into the meta-built model without a second copy."""
        state = dict(state_dict)
        if self.config.tie_word_embeddings and "lm_head.weight" not in state and "model.embed_tokens.weight" in state:
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
        expected: Dict[str, nn.Parameter] = dict(self.named_parameters())
        missing = sorted(expected.keys() - state.keys())
        if missing:
            more = f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""
            raise ValueError(f"checkpoint is missing weights: {', '.join(missing[:5])}{more}")
        unexpected = sorted(state.keys() - expected.keys())
        if unexpected:
            raise ValueError(f"checkpoint has weights this {type(self).__name__} does not use: {', '.join(unexpected[:5])}")
        for name, param in expected.items():
            if tuple(state[name].shape) != tuple(param.shape):
                raise ValueError(f"weight {name} has shape {tuple(state[name].shape)}, expected {tuple(param.shape)}")
        return super().load_state_dict(state, strict=True, assign=True)
