"""The decoder-only transformer shared by every supported architecture.

Architectures differ in a few switches (q/k/v bias, q/k RMSNorm per head or over the whole
projection, MoE blocks, no pre-norms, post-norms, NoPE layers, an attention scale, residual /
embedding / logit multipliers), so each architecture module is a small subclass of `CausalLM`
that sets them; a fast path that cannot compute a switch declines it (the `plain` properties).
Submodule names follow the HF checkpoints (model.layers.N.self_attn..., lm_head) so weight names
map with a few rules (the post-norm slots take each architecture's names in `map_weight_name`).

This is the only definition of the layer: fast paths replace its ops (the norms, `norm_linear`,
the linear layers, attention, MoE) behind their interfaces, or replay it whole (CUDA graphs, the
CPU runner). A block (attention, MLP, MoE) takes the residual stream and its pre-norm,
`block(x, residual, norm) -> (out, residual)`, so the norm can fuse into its first projection.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Mapping, Sequence, Tuple

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
from minisgl.layers.norm import PreNorm, ResidualAdd, WideRMSNorm
from minisgl.layers.norm_linear import norm_linear
from minisgl.models.config import ModelConfig
from minisgl.utils.misc import div_even


class SelfAttention(nn.Module):
    """q/k/v projection, attention, o projection. Options beyond Llama's: `qk_norm` "head" (Qwen3:
    RMSNorm per head) or "wide" (OLMo 2: over the whole q and k projections), `rotary` False (a
    NoPE layer, SmolLM3), `softmax_scale` instead of 1/sqrt(head_dim) (Granite)."""

    def __init__(
        self,
        cfg: ModelConfig,
        layer_id: int,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm: bool | str,
        rotary: bool = True,
        softmax_scale: float | None = None,
    ) -> None:
        super().__init__()
        tp = get_tp_info()
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_qo_heads, cfg.num_kv_heads, qkv_bias)
        self.o_proj = RowParallelLinear(cfg.num_qo_heads * cfg.head_dim, cfg.hidden_size, o_bias)
        num_q = div_even(cfg.num_qo_heads, tp.size)
        num_kv = div_even(cfg.num_kv_heads, tp.size, allow_replicate=True)
        self.q_size, self.kv_size = num_q * cfg.head_dim, num_kv * cfg.head_dim
        per_head = qk_norm is True or qk_norm == "head"
        self.q_norm: RMSNorm | None = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if per_head else None
        self.k_norm: RMSNorm | None = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if per_head else None
        self.wide_qk_norm = qk_norm == "wide"
        if self.wide_qk_norm:
            if cfg.num_kv_heads % tp.size:
                raise ValueError(f"a q/k norm over all heads needs num_key_value_heads ({cfg.num_kv_heads}) divisible by tp ({tp.size})")
            self.q_norm = WideRMSNorm(cfg.num_qo_heads * cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = WideRMSNorm(cfg.num_kv_heads * cfg.head_dim, cfg.rms_norm_eps)
        self.attn = AttentionLayer(
            layer_id,
            num_q_heads=num_q,
            num_kv_heads=num_kv,
            head_dim=cfg.head_dim,
            rotary=get_rope(cfg.rotary_config) if rotary else None,
            q_norm=self.q_norm if per_head else None,
            k_norm=self.k_norm if per_head else None,
            softmax_scale=softmax_scale,
        )
        self.qkv_proj.fused_kind = "norm"  # called through norm_linear below

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, norm: PreNorm) -> Tuple[torch.Tensor, torch.Tensor]:
        qkv, residual = norm_linear(norm, self.qkv_proj, x, residual)
        if self.wide_qk_norm:
            assert self.q_norm is not None and self.k_norm is not None
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            qkv = torch.cat([self.q_norm(q), self.k_norm(k), v], dim=-1)
        return self.o_proj(self.attn(qkv)), residual

    @property
    def plain(self) -> bool:
        """Whether the CPU decode loop computes this block's q/k norm (the attention itself is
        the CPU backend's `takes`)."""
        return not self.wide_qk_norm


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str) -> None:
        super().__init__()
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r}; supported: silu")
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate, intermediate])
        self.down_proj = RowParallelLinear(intermediate, hidden)
        self.gate_up_proj.fused_kind = "gated"  # called through norm_linear below

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, norm: PreNorm) -> Tuple[torch.Tensor, torch.Tensor]:
        act, residual = norm_linear(norm, self.gate_up_proj, x, residual, gated=True)
        return self.down_proj(act), residual

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP alone, on an already normalised input (a shared expert)."""
        return self.down_proj(self.gate_up_proj.forward_silu_and_mul(x))


class DecoderLayer(nn.Module):
    """Pre-norm blocks, each output added to the residual stream. Options: `pre_norms` False
    (OLMo 2: no norm before attention or MLP), `post_norms` (OLMo 2, GLM-4: a norm on each block's
    output before its residual add: `attn_out_norm`, `mlp_out_norm`), `residual_multiplier`
    (Granite: each block's output times it before the add), `norm` (the RMSNorm of every norm
    here: Gemma's (1 + w) kind)."""

    def __init__(
        self,
        cfg: ModelConfig,
        self_attn: nn.Module,
        mlp: nn.Module,
        pre_norms: bool = True,
        post_norms: bool = False,
        residual_multiplier: float = 1.0,
        norm: Callable[[int, float], RMSNorm] = RMSNorm,
    ) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm: PreNorm = norm(hidden, eps) if pre_norms else ResidualAdd()
        self.post_attention_layernorm: PreNorm = norm(hidden, eps) if pre_norms else ResidualAdd()
        self.attn_out_norm = norm(hidden, eps) if post_norms else None
        self.mlp_out_norm = norm(hidden, eps) if post_norms else None
        self.residual_multiplier = residual_multiplier
        if not pre_norms:  # no norm to fuse into the projections: they run as plain GEMMs
            for block in (self_attn, mlp):
                for proj in ("qkv_proj", "gate_up_proj"):
                    if hasattr(block, proj):
                        getattr(block, proj).fused_kind = "plain"

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None) -> Tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.self_attn(x, residual, self.input_layernorm)
        h, residual = self.mlp(self._to_stream(h, self.attn_out_norm), residual, self.post_attention_layernorm)
        return self._to_stream(h, self.mlp_out_norm), residual

    def _to_stream(self, out: torch.Tensor, post_norm: RMSNorm | None) -> torch.Tensor:
        """A block's output as it is added to the residual stream (the add itself is deferred to
        the next norm)."""
        if post_norm is not None:
            out = post_norm(out)
        return out if self.residual_multiplier == 1.0 else out * self.residual_multiplier

    @property
    def plain(self) -> bool:
        """Whether this is the layer the CPU decode loop computes (pre-norms only, no multiplier)."""
        return (
            isinstance(self.input_layernorm, RMSNorm) and isinstance(self.post_attention_layernorm, RMSNorm)
            and self.attn_out_norm is None and self.mlp_out_norm is None and self.residual_multiplier == 1.0
        )  # fmt: skip


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, layers: Sequence[nn.Module]) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.multiplier = cfg.embedding_multiplier
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
    qk_norm: bool | str = False  # True / "head": per head; "wide": over the whole projection
    pre_norms: bool = True
    post_norms: bool = False

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        layers = [
            DecoderLayer(
                cfg,
                self.build_attention(cfg, i),
                self.build_mlp(cfg, i),
                pre_norms=self.pre_norms,
                post_norms=self.post_norms,
                residual_multiplier=cfg.residual_multiplier,
            )  # fmt: skip
            for i in range(cfg.num_layers)
        ]
        self.model = DecoderModel(cfg, layers)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        self.lm_head.logits_scaling = cfg.logits_scaling

    def build_attention(self, cfg: ModelConfig, layer_id: int) -> nn.Module:
        return SelfAttention(
            cfg, layer_id, qkv_bias=self.qkv_bias, o_bias=self.o_bias, qk_norm=self.qk_norm,
            rotary=cfg.layer_has_rope(layer_id), softmax_scale=cfg.attention_multiplier,
        )  # fmt: skip

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
            want = tuple(param.shape)
            owner = self.get_submodule(name.rpartition(".")[0])
            if name.endswith(".weight") and getattr(owner, "weight_zero", None) is not None:
                want = (want[0], want[1] // 8)  # an int4 weight (layers/int4.py): 8 codes per int32 word along K
                owner.weight = nn.Parameter(torch.empty(want, dtype=torch.int32, device="meta"), requires_grad=False)
            if tuple(state[name].shape) != want:
                raise ValueError(f"weight {name} has shape {tuple(state[name].shape)}, expected {want}")
        return super().load_state_dict(state, strict=True, assign=True)
