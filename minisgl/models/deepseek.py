"""DeepSeek-V2 and V3: multi-head latent attention (MLA) and DeepSeek's MoE, on the shared decoder
layer (pre-norms, residual stream; `models/base.py`).

**MLA.** Per token the layer projects one latent `kv_a_proj_with_mqa(x)` = [c_kv | k_pe]:
c_kv (kv_lora_rank values, RMS-normalised by `kv_a_layernorm`) from which `kv_b_proj` would expand
every head's non-rotary key (qk_nope_head_dim) and value (v_head_dim), and k_pe
(qk_rope_head_dim), one rotary key shared by all heads. q is `q_proj(x)` (V2-Lite) or
`q_b_proj(q_a_layernorm(q_a_proj(x)))`, per head [q_nope | q_pe]. The KV pool stores only
[c_kv | k_pe] per token and layer (kvcache/pool.py, the latent layout), and attention runs in the
latent space ("absorbed" projections), for prefill and decode alike:

    score_h(t, s) = q_nope_h . (W_UK_h c_s) + q_pe_h . k_pe_s = (W_UK_h^T q_nope_h) . c_s + q_pe_h . k_pe_s
    out_h(t)      = W_UV_h (sum_s p_h(t, s) c_s)

so the backend sees MQA with one key head [c | k_pe] (kv_lora_rank + rope dims) whose value is
its first kv_lora_rank dims, queries [W_UK_h^T q_nope_h | q_pe_h], and the layer applies W_UV_h
to its [T, H, kv_lora_rank] output. The score scale is qk_head_dim^-0.5 times YaRN's
mscale(factor, mscale_all_dim)^2 (`ModelConfig.attn_scale`). Rotary acts on the rope dims only,
in DeepSeek's adjacent-pair layout (V2's complex rotation; V3 with `rope_interleave`, the default;
q and k share the layout, so the scores equal transformers' de-interleaved output's).

**MoE.** Layers below `first_k_dense_replace` (and those off `moe_layer_freq`) are dense MLPs;
the others route each token to `num_experts_per_tok` of `n_routed_experts` experts (the fused MoE
backends, which take the top-k ids and weights computed here) plus `n_shared_experts` experts'
worth of a dense MLP every token takes. Routing in float32 (`route`): V2 softmax scores with
greedy or group-limited top-k; V3 sigmoid scores plus `e_score_correction_bias`, groups ranked by
their top-2 sum (noaux_tc), the bias choosing experts only (the weights are the unbiased scores,
renormalised with `norm_topk_prob`); the weights then times `routed_scaling_factor`.

tp > 1: q_b_proj / q_proj and kv_b_proj are split by heads, o_proj by its input rows; q_a_proj,
kv_a_proj_with_mqa and the latent pool are replicated (every rank's heads read the same latent);
experts and the shared MLP split their intermediate dim, as Qwen3-MoE's.

Not loaded: the multi-token-prediction layers of V3 checkpoints (`num_nextn_predict_layers` /
`num_mtp_layers`, stored as layers past num_hidden_layers) are skipped; they only serve
speculative decoding, which is not implemented for them.
"""

from __future__ import annotations

import re
from typing import Any, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.core import get_global_ctx
from minisgl.distributed import all_reduce, get_tp_info
from minisgl.layers import ColumnParallelLinear, ReplicatedLinear, RMSNorm, RowParallelLinear, get_rope
from minisgl.layers.base import ShardedModule, narrow_rank
from minisgl.layers.norm import PreNorm
from minisgl.models.base import CausalLM, GatedMLP
from minisgl.models.config import DeepseekMoeConfig, LatentAttentionConfig, ModelConfig
from minisgl.models.qwen3_moe import FusedExperts, map_expert_weight
from minisgl.utils.misc import div_even

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
# transformers' DeepSeek norms inside attention use RMSNorm's default eps, not rms_norm_eps
_LATENT_NORM_EPS = 1e-6


class HeadRows(ShardedModule):
    """`kv_b_proj`'s weight [H * (nope + v), kv_lora_rank], this rank's heads' rows. Not a linear
    layer: its per-head blocks W_UK and W_UV are used in the absorbed attention, never as x W^T
    (so no quantized or fused GEMM replaces it)."""

    def __init__(self, num_heads: int, rows_per_head: int, in_features: int) -> None:
        super().__init__()
        self.local_heads = div_even(num_heads, get_tp_info().size)
        self.rows_per_head = rows_per_head
        self.weight = nn.Parameter(torch.empty(self.local_heads * rows_per_head, in_features), requires_grad=False)

    def shard(self, param_name: str, full: torch.Tensor, part: Any = None) -> torch.Tensor:
        return narrow_rank(full, 0, self.local_heads * self.rows_per_head, get_tp_info().rank)


class LatentAttention(nn.Module):
    """MLA over the latent pool (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        mla = cfg.latent_attention
        assert mla is not None
        self.mla: LatentAttentionConfig = mla
        self.layer_id = layer_id
        hidden, heads, bias = cfg.hidden_size, cfg.num_qo_heads, cfg.attention_bias
        self.num_local_heads = div_even(heads, get_tp_info().size)
        self.q_proj: ColumnParallelLinear | None = None
        self.q_a_proj: ReplicatedLinear | None = None
        self.q_a_layernorm: RMSNorm | None = None
        self.q_b_proj: ColumnParallelLinear | None = None
        if mla.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, heads * mla.qk_head_dim)
        else:
            self.q_a_proj = ReplicatedLinear(hidden, mla.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, _LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(mla.q_lora_rank, heads * mla.qk_head_dim)
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, mla.latent_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, _LATENT_NORM_EPS)
        self.kv_b_proj = HeadRows(heads, mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank)
        self.o_proj = RowParallelLinear(heads * mla.v_head_dim, hidden, bias=bias)
        self.rotary = get_rope(cfg.rotary_config)  # over the rope dims (head_dim = qk_rope_head_dim)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, norm: PreNorm) -> Tuple[torch.Tensor, torch.Tensor]:
        h, residual = norm.forward_with_residual(x, residual)
        mla, heads = self.mla, self.num_local_heads
        ctx = get_global_ctx()
        batch, backend = ctx.batch, ctx.attn_backend
        assert backend is not None
        if self.q_proj is not None:
            q = self.q_proj(h)
        else:
            assert self.q_a_proj is not None and self.q_a_layernorm is not None and self.q_b_proj is not None
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(h)))
        q_nope, q_pe = q.view(-1, heads, mla.qk_head_dim).split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(h).split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv.contiguous())
        q_pe, k_pe = self.rotary(batch.positions, q_pe, k_pe.unsqueeze(1))
        w = self.kv_b_proj.weight.view(heads, mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank)
        w_uk, w_uv = w[:, : mla.qk_nope_head_dim], w[:, mla.qk_nope_head_dim :]
        # absorbed query [T, H, kv_lora_rank + rope]: q_nope_h W_UK_h, then q_pe
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)
        query = torch.cat([q_latent, q_pe.to(q_latent.dtype)], dim=-1)
        latent = torch.cat([c_kv, k_pe.squeeze(1).to(c_kv.dtype)], dim=-1).unsqueeze(1)  # [T, 1, rank + rope]
        o_latent = backend.forward(query, latent, None, self.layer_id, batch)  # [T, H, kv_lora_rank]
        out = torch.bmm(o_latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [T, H, v_head_dim]
        return self.o_proj(out.reshape(-1, heads * mla.v_head_dim)), residual


class Router(ShardedModule):
    """The MoE gate: `weight` [E, H] and, for V3, `e_score_correction_bias` [E] (replicated), both
    kept in float32 whatever the model dtype (the loader reads `float32_params`), as transformers
    keeps them: the bias decides between experts whose scores differ in bf16's last bits."""

    float32_params = ("weight", "e_score_correction_bias")

    def __init__(self, num_experts: int, hidden: int, bias: bool) -> None:
        super().__init__()
        f32 = torch.float32
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, dtype=f32), requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.empty(num_experts, dtype=f32), requires_grad=False) if bias else None


def route(
    logits: torch.Tensor, moe: DeepseekMoeConfig, top_k: int, norm_topk_prob: bool, bias: torch.Tensor | None
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(top-k weights float32 [T, k], expert ids [T, k]) of float32 router logits [T, E]."""
    scores = logits.softmax(dim=-1) if moe.scoring == "softmax" else logits.sigmoid()
    choice = scores if bias is None else scores + bias.float()
    if moe.topk_method != "greedy":  # keep the topk_group best of n_group groups of experts
        grouped = choice.view(choice.shape[0], moe.n_group, -1)
        if moe.topk_method == "noaux_tc":
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        else:
            group_scores = grouped.max(dim=-1).values
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(moe.topk_group, dim=-1, sorted=False).indices, True)
        # (V2 zeroes the other groups' softmax scores, V3 excludes them: as transformers does)
        fill = float("-inf") if moe.topk_method == "noaux_tc" else 0.0
        choice = grouped.masked_fill(~keep.unsqueeze(-1), fill).view_as(choice)
    ids = choice.topk(top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * moe.routed_scaling_factor, ids


class DeepseekMoe(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        moe = cfg.deepseek_moe
        assert moe is not None
        self.moe: DeepseekMoeConfig = moe
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = Router(cfg.num_experts, cfg.hidden_size, bias=moe.topk_method == "noaux_tc")
        self.experts = FusedExperts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.shared_experts: GatedMLP | None = None
        if moe.n_shared_experts:
            self.shared_experts = GatedMLP(cfg.hidden_size, moe.n_shared_experts * cfg.moe_intermediate_size, cfg.hidden_act)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, norm: PreNorm) -> Tuple[torch.Tensor, torch.Tensor]:
        h, residual = norm.forward_with_residual(x, residual)
        logits = F.linear(h.float(), self.gate.weight.float())  # float32, as transformers' router (dummy weights: bf16)
        weights, ids = route(logits, self.moe, self.top_k, self.norm_topk_prob, self.gate.e_score_correction_bias)
        backend = get_global_ctx().moe_backend
        assert backend is not None
        out = all_reduce(backend.forward(h, self.experts.w13, self.experts.w2, weights.to(h.dtype), ids))
        if self.shared_experts is not None:
            out = out + self.shared_experts.mlp(h)
        return out, residual


class DeepseekV2ForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig) -> None:
        if cfg.latent_attention is None or cfg.deepseek_moe is None:
            raise ValueError(f"{cfg.architecture}: the config has no kv_lora_rank / MoE fields of DeepSeek")
        if cfg.hidden_act != "silu":
            raise ValueError(f"{cfg.architecture}: hidden_act {cfg.hidden_act!r} is not supported; supported: silu")
        if cfg.mlp_bias:
            raise ValueError(f"{cfg.architecture}: mlp_bias is not supported (no DeepSeek checkpoint sets it)")
        super().__init__(cfg)

    def build_attention(self, cfg: ModelConfig, layer_id: int) -> nn.Module:
        return LatentAttention(cfg, layer_id)

    def build_mlp(self, cfg: ModelConfig, layer_id: int) -> nn.Module:
        if cfg.layer_is_moe(layer_id):
            return DeepseekMoe(cfg)
        return GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)

    def map_weight_name(self, name: str) -> Tuple[str, Any] | None:
        m = _LAYER.match(name)
        if m is not None and int(m.group(1)) >= self.config.num_layers:
            return None  # a multi-token-prediction layer (V3): not used here (module docstring)
        # (q_proj is MLA's own projection, not part of a merged q/k/v)
        if ".self_attn." in name and ".q_proj." in name:
            return name, None
        return map_expert_weight(name) or super().map_weight_name(name)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    pass
