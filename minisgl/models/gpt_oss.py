"""GPT-OSS: Llama-shaped layers with q/k/v/o biases, attention sinks (a learned logit per query
head that joins every softmax denominator and weighs no value), sliding-window layers alternating
with full ones (`layer_types`, masked by the attention backends as Gemma's), YaRN rope, and every
MLP a mixture of experts:

- the router is a linear layer with a bias; each token takes the top-k *logits* and softmaxes
  those k (not a softmax over every expert then top-k, as Qwen3-MoE);
- the experts have biases on both projections and the clamped SwiGLU (`moe/base.py`
  ClampedSwiglu). The checkpoint stores each layer's experts fused and transposed:
  `experts.gate_up_proj` [E, H, 2I] with gate and up *interleaved* along the last dim (column
  2j gate, 2j + 1 up), `gate_up_proj_bias` [E, 2I] likewise, `down_proj` [E, I, H],
  `down_proj_bias` [E, H]; they load into the fused MoE's layout (w13 [E, 2I, H], gate rows then
  up rows; w2 [E, H, I]) and are sharded on I.

The gate/up bias goes to the MoE backend (the "expert_bias" feature, with "clamped_swiglu": the
torch backend's; moe/registry.py refuses or passes over a backend without them); the down bias,
weighted by the routing weights, is added after the all-reduce, so each token gets it once.
MXFP4 expert checkpoints are dequantized at load (models/checkpoint_quant.py).
"""

from __future__ import annotations

import re
from typing import Any, Tuple

import torch
from torch import nn

from minisgl.core import get_global_ctx
from minisgl.distributed import all_reduce, get_tp_info
from minisgl.layers import ReplicatedLinear
from minisgl.layers.base import ShardedModule, narrow_rank
from minisgl.layers.norm import PreNorm
from minisgl.models.base import CausalLM, SelfAttention
from minisgl.models.config import ModelConfig
from minisgl.moe.base import ClampedSwiglu
from minisgl.utils.misc import div_even

_EXPERTS = re.compile(r"\.mlp\.experts\.(gate_up_proj|gate_up_proj_bias|down_proj|down_proj_bias)$")
_OURS = {"gate_up_proj": "w13", "gate_up_proj_bias": "b13", "down_proj": "w2", "down_proj_bias": "b2"}


def _whole(full: Any) -> torch.Tensor:
    """A checkpoint tensor read whole (an open file's CheckpointTensor) or as it is."""
    return full.read() if hasattr(full, "read") else full


class GptOssAttention(SelfAttention, ShardedModule):
    """The shared attention block with q/k/v/o biases and this rank's heads' sinks."""

    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__(cfg, layer_id, qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias, qk_norm=False)
        self.num_local_heads = div_even(cfg.num_qo_heads, get_tp_info().size)
        self.sinks = nn.Parameter(torch.empty(self.num_local_heads), requires_grad=False)
        self.attn._sinks_owner = (self,)  # the backend reads self.sinks at each call

    def shard(self, param_name: str, full: torch.Tensor, part: Any = None) -> torch.Tensor:
        assert param_name == "sinks"
        return narrow_rank(full, 0, self.num_local_heads, get_tp_info().rank)


class GptOssExperts(ShardedModule):
    """One layer's experts in the fused MoE layout, sharded on the intermediate dim."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.local_inter = inter = div_even(intermediate, get_tp_info().size)
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden), requires_grad=False)
        self.b13 = nn.Parameter(torch.empty(num_experts, 2 * inter), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, inter), requires_grad=False)
        self.b2 = nn.Parameter(torch.empty(num_experts, hidden), requires_grad=False)  # replicated

    def shard(self, param_name: str, full: torch.Tensor, part: Any = None) -> torch.Tensor:
        rank, inter = get_tp_info().rank, self.local_inter
        t = _whole(full)
        if param_name in ("w13", "b13"):  # [E, (H,) 2I], gate/up interleaved on the last dim
            gate = narrow_rank(t[..., 0::2], t.dim() - 1, inter, rank)
            up = narrow_rank(t[..., 1::2], t.dim() - 1, inter, rank)
            fused = torch.cat([gate, up], dim=-1)
            return fused.transpose(1, 2).contiguous() if param_name == "w13" else fused.contiguous()
        if param_name == "w2":  # [E, I, H] -> [E, H, I_local]
            return narrow_rank(t, 1, inter, rank).transpose(1, 2).contiguous()
        return t


class GptOssMoe(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.router = ReplicatedLinear(cfg.hidden_size, cfg.num_experts, bias=True)
        self.experts = GptOssExperts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.activation = ClampedSwiglu(cfg.swiglu_alpha, cfg.swiglu_limit)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, norm: PreNorm) -> Tuple[torch.Tensor, torch.Tensor]:
        h, residual = norm.forward_with_residual(x, residual)
        logits = self.router(h)
        top_logits, topk_ids = torch.topk(logits, self.top_k, dim=-1)  # top-k first, then softmax over those
        topk_weights = torch.softmax(top_logits, dim=-1, dtype=torch.float32).to(h.dtype)
        backend = get_global_ctx().moe_backend
        assert backend is not None
        e = self.experts
        out = all_reduce(backend.forward(h, e.w13, e.w2, topk_weights, topk_ids, e.b13, self.activation))
        bias = (e.b2[topk_ids] * topk_weights.unsqueeze(-1)).sum(dim=1)  # each expert's down bias, weighted
        return out + bias.to(out.dtype), residual


class GptOssForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig) -> None:
        if not cfg.is_moe:
            raise ValueError("GptOssForCausalLM: the config sets no num_local_experts")
        if cfg.mlp_only_layers or cfg.decoder_sparse_step != 1:
            raise ValueError("GptOssForCausalLM: every layer is an MoE layer (mlp_only_layers / decoder_sparse_step unsupported)")
        super().__init__(cfg)

    def build_attention(self, cfg: ModelConfig, layer_id: int) -> nn.Module:
        return GptOssAttention(cfg, layer_id)

    def build_mlp(self, cfg: ModelConfig, layer_id: int) -> nn.Module:
        return GptOssMoe(cfg)

    def map_weight_name(self, name: str) -> Tuple[str, Any] | None:
        m = _EXPERTS.search(name)
        if m is not None:
            return f"{name[: m.start()]}.mlp.experts.{_OURS[m.group(1)]}", None
        return super().map_weight_name(name)
