"""ModelConfig: the architecture facts minisgl needs, read from a HF config (4.x or 5.x layout)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Tuple

from minisgl.layers.rotary import RotaryConfig


def _rope_params(hf: Any) -> tuple[float, Dict[str, Any] | None]:
    """(theta, scaling) from either `rope_parameters` (transformers 5) or
    `rope_theta` + `rope_scaling` (checkpoints written by transformers 4)."""
    params = getattr(hf, "rope_parameters", None) or {}
    if isinstance(params.get("full_attention"), dict):  # per layer type (Gemma 3): the global layers'
        params = params["full_attention"]
    theta = params.get("rope_theta", getattr(hf, "rope_theta", None))
    scaling: Dict[str, Any] | None = None
    if params.get("rope_type", "default") not in ("default", None):
        scaling = dict(params)
    elif getattr(hf, "rope_scaling", None):
        scaling = dict(hf.rope_scaling)
        if scaling.get("rope_type", scaling.get("type")) in ("default", None):
            scaling = None  # (transformers 5 mirrors rope_parameters here: plain rope, no scaling)
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) in ("longrope", "su"):
        # transformers 4 kept these at the top level; LongRoPE needs both (layers/rotary.py)
        original = scaling.get("original_max_position_embeddings", getattr(hf, "original_max_position_embeddings", None))
        if original is not None:
            scaling["original_max_position_embeddings"] = original
            scaling.setdefault("factor", hf.max_position_embeddings / original)  # transformers' default
    return float(theta if theta is not None else 10000.0), scaling


# Architectures whose sliding windows the attention backends mask, layer by layer
# (`ModelConfig.layer_windows`), so their context is never cut to the window.
WINDOW_MASKED_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM", "GptOssForCausalLM")


def _layer_windows(hf: Any, arch: str) -> Tuple[int | None, ...]:
    """Each layer's sliding window (None: global) for the architectures that mask it: from
    `layer_types` when the config has them, else Gemma 2's alternation (even layers slide) or
    Gemma 3's `sliding_window_pattern` (every pattern-th layer is global)."""
    window = getattr(hf, "sliding_window", None)
    if arch not in WINDOW_MASKED_ARCHITECTURES or window is None:
        return ()
    n = hf.num_hidden_layers
    types = getattr(hf, "layer_types", None)
    if not types:
        pattern = 2 if arch == "Gemma2ForCausalLM" else int(getattr(hf, "sliding_window_pattern", None) or 6)
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)]
    unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
    if unknown or len(types) != n:
        raise ValueError(f"layer_types must name full_attention or sliding_attention for each of {n} layers (got {unknown or len(types)})")
    return tuple(int(window) if t == "sliding_attention" else None for t in types)


def _local_rope(hf: Any, global_rotary: RotaryConfig) -> RotaryConfig | None:
    """Gemma 3's rotary for sliding layers: `rope_local_base_freq` (transformers 4) or
    rope_parameters["sliding_attention"] (transformers 5), never scaled; None where the config
    has one rotary for every layer."""
    params = getattr(hf, "rope_parameters", None) or {}
    local = params.get("sliding_attention") if isinstance(params.get("sliding_attention"), dict) else None
    base = (local or {}).get("rope_theta", getattr(hf, "rope_local_base_freq", None))
    if base is None:
        return None
    if local is not None and local.get("rope_type", "default") not in ("default", None):
        raise ValueError(f"rope scaling of sliding layers ({local.get('rope_type')!r}) is not implemented")
    return RotaryConfig(global_rotary.head_dim, global_rotary.rotary_dim, global_rotary.max_position, float(base))


def _window_cut(hf: Any) -> int | None:
    """The sliding window where a config attends through one shorter than max_position_embeddings:
    the context is cut to it (RotaryConfig.max_position, and so the engine's max_seq_len).

    No backend here masks a sliding window; within the window the mask hides nothing (a query
    attends to the keys less than `sliding_window` positions back, transformers'
    `sliding_window_overlay`), so a context of at most `sliding_window` tokens is exact. Phi-3-mini-4k
    sets 2047 of 4096, Mistral-7B-v0.1 4096 of 32768; Qwen2/3 configs with use_sliding_window
    false come from transformers with no window. The architectures whose windows the backends
    mask (WINDOW_MASKED_ARCHITECTURES) are never cut."""
    window = getattr(hf, "sliding_window", None)
    if getattr(hf, "use_sliding_window", True) is False or (getattr(hf, "architectures", None) or [""])[0] in WINDOW_MASKED_ARCHITECTURES:
        window = None
    if window is not None and int(window) < hf.max_position_embeddings:
        return int(window)
    return None


DEEPSEEK_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")


@dataclass(frozen=True)
class LatentAttentionConfig:
    """DeepSeek's multi-head latent attention (MLA): each token's keys and values are one
    compressed latent of `kv_lora_rank` values (plus one shared rotary key of `qk_rope_head_dim`),
    expanded per head by `kv_b_proj` into `qk_nope_head_dim` key and `v_head_dim` value dims.
    `q_lora_rank` None: q is one projection (V2-Lite), else q_a_proj -> norm -> q_b_proj."""

    kv_lora_rank: int
    q_lora_rank: int | None
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """What the KV pool holds per token and layer: the latent and the rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class DeepseekMoeConfig:
    """DeepSeek's MoE layers: dense below `first_k_dense_replace`, then every `moe_layer_freq`-th
    layer sparse; `n_shared_experts` experts' worth of a dense MLP every token takes; routing by
    `scoring` (softmax: V2, sigmoid: V3) and `topk_method` (greedy, group_limited_greedy over
    `n_group` groups keeping `topk_group`, or V3's noaux_tc: `e_score_correction_bias` picks the
    experts, the unbiased scores weigh them), weights times `routed_scaling_factor`."""

    n_shared_experts: int
    first_k_dense_replace: int
    moe_layer_freq: int
    scoring: str
    topk_method: str
    n_group: int
    topk_group: int
    routed_scaling_factor: float


def _deepseek(hf: Any, arch: str) -> Tuple[LatentAttentionConfig, DeepseekMoeConfig]:
    """The MLA and MoE options of a DeepSeek-V2/V3 config (4.x: the released checkpoints'
    config.json; 5.x: transformers' own layout). What transformers does not compute is refused
    by name rather than run differently."""
    v3 = arch == "DeepseekV3ForCausalLM"
    scoring = str(getattr(hf, "scoring_func", None) or ("sigmoid" if v3 else "softmax"))
    method = str(getattr(hf, "topk_method", None) or ("noaux_tc" if v3 else "greedy"))
    allowed = {"sigmoid": ("noaux_tc",)} if v3 else {"softmax": ("greedy", "group_limited_greedy")}
    if scoring not in allowed:
        raise ValueError(f"{arch}: scoring_func {scoring!r} is not supported; supported: {', '.join(allowed)}")
    if method not in allowed[scoring]:
        raise ValueError(f"{arch}: topk_method {method!r} is not supported; supported: {', '.join(allowed[scoring])}")
    if not v3 and getattr(hf, "norm_topk_prob", False):
        # (transformers' DeepseekV2 never renormalises; no released V2 checkpoint sets it)
        raise ValueError(f"{arch}: norm_topk_prob true is not supported (supported: false, as transformers computes V2)")
    experts = int(getattr(hf, "n_routed_experts", None) or getattr(hf, "num_local_experts", None) or 0)
    grouped = method != "greedy"
    n_group = int(getattr(hf, "n_group", None) or 1) if grouped else 1
    topk_group = int(getattr(hf, "topk_group", None) or 1) if grouped else 1
    if experts % n_group or not 1 <= topk_group <= n_group:
        raise ValueError(f"{arch}: n_group={n_group} must divide n_routed_experts={experts} and topk_group={topk_group} be in [1, n_group]")
    if method == "noaux_tc" and experts // n_group < 2:
        raise ValueError(f"{arch}: noaux_tc scores each group by its top 2 experts: n_routed_experts / n_group must be >= 2")
    q_lora = getattr(hf, "q_lora_rank", None)
    mla = LatentAttentionConfig(
        kv_lora_rank=int(hf.kv_lora_rank),
        q_lora_rank=int(q_lora) if q_lora is not None else None,
        qk_nope_head_dim=int(hf.qk_nope_head_dim),
        qk_rope_head_dim=int(hf.qk_rope_head_dim),
        v_head_dim=int(hf.v_head_dim),
    )
    moe = DeepseekMoeConfig(
        n_shared_experts=int(getattr(hf, "n_shared_experts", None) or 0),
        first_k_dense_replace=int(getattr(hf, "first_k_dense_replace", None) or 0),
        moe_layer_freq=int(getattr(hf, "moe_layer_freq", None) or 1),
        scoring=scoring,
        topk_method=method,
        n_group=n_group,
        topk_group=topk_group,
        routed_scaling_factor=float(getattr(hf, "routed_scaling_factor", None) or 1.0),
    )
    return mla, moe


def _mla_softmax_scale(mla: LatentAttentionConfig, scaling: Dict[str, Any] | None) -> float:
    """qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under a scaled rope (YaRN's
    correction of every score, not only the rotary dims), as transformers' `yarn_apply_mscale`."""
    scale = mla.qk_head_dim**-0.5
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    m_all = (scaling or {}).get("mscale_all_dim")
    if scaling is not None and kind not in ("default", None) and m_all:
        factor = float(scaling["factor"])
        m = 1.0 if factor <= 1 else 0.1 * float(m_all) * math.log(factor) + 1.0
        scale *= m * m
    return scale


# Bare decoder architectures -> the causal LM whose decoder they are (models/__init__.py).
BARE_DECODERS = {"LlamaModel": "LlamaForCausalLM", "Qwen2Model": "Qwen2ForCausalLM", "Qwen3Model": "Qwen3ForCausalLM"}


def _no_rope_layers(hf: Any) -> List[int]:
    """SmolLM3's NoPE layers. Its `no_rope_layers` is a per-layer flag list, 1 = uses rotary
    (transformers fills it from `no_rope_layer_interval`: every interval-th layer is NoPE)."""
    flags = getattr(hf, "no_rope_layers", None)
    if flags is None:
        interval = getattr(hf, "no_rope_layer_interval", None)
        if interval is None:
            return []
        flags = [int((i + 1) % int(interval) != 0) for i in range(hf.num_hidden_layers)]
    if len(flags) != hf.num_hidden_layers:
        raise ValueError(f"no_rope_layers has {len(flags)} entries, the model has {hf.num_hidden_layers} layers")
    return [i for i, uses_rope in enumerate(flags) if not uses_rope]


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    model_type: str
    num_layers: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    hidden_act: str
    tie_word_embeddings: bool
    attention_bias: bool
    rotary_config: RotaryConfig
    mlp_bias: bool = False
    eos_token_ids: List[int] = field(default_factory=list)
    # the sliding window the context was cut to (_window_cut), else None
    context_cut_by_window: int | None = None
    # Mixture of experts (Qwen3-MoE); num_experts == 0 means dense.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: List[int] = field(default_factory=list)
    # The checkpoint is the decoder alone (Qwen3Model, LlamaModel: an embedding model), without an
    # LM head; its weight names may lack the "model." prefix.
    is_bare_decoder: bool = False
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's shared expert; 0: none
    # Granite: embeddings times embedding_multiplier, each block's output times
    # residual_multiplier, attention scale attention_multiplier (None: 1/sqrt(head_dim)), logits
    # divided by logits_scaling
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    # SmolLM3: the layers that apply no rotary (NoPE)
    no_rope_layers: List[int] = field(default_factory=list)

    # Attention beyond softmax(q k^T / sqrt(head_dim)) over every earlier key (Gemma 2 and 3):
    # each layer's sliding window (empty: every layer global; None: that layer global), the
    # rotary of the windowed layers where it differs (Gemma 3), the score scale (None:
    # head_dim^-0.5) and tanh soft-capping of the scores and of the final logits.
    layer_windows: Tuple[int | None, ...] = ()
    local_rotary_config: RotaryConfig | None = None
    attn_scale: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    # GPT-OSS: a learned logit per query head (`self_attn.sinks`) in every softmax denominator
    attention_sinks: bool = False
    # GPT-OSS's experts: the clamped SwiGLU's alpha and limit (swiglu_alpha, swiglu_limit)
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # DeepSeek-V2/V3: multi-head latent attention (the KV pool holds the latent) and its MoE
    latent_attention: LatentAttentionConfig | None = None
    deepseek_moe: DeepseekMoeConfig | None = None

    def layer_has_rope(self, layer_id: int) -> bool:
        return layer_id not in self.no_rope_layers

    def window_of(self, layer_id: int) -> int | None:
        """Layer `layer_id`'s sliding window: its queries see the keys less than this many
        positions back (transformers' `sliding_window`), or None (every earlier key)."""
        return self.layer_windows[layer_id] if self.layer_windows else None

    def rotary_of(self, layer_id: int) -> RotaryConfig:
        if self.local_rotary_config is not None and self.window_of(layer_id) is not None:
            return self.local_rotary_config
        return self.rotary_config

    @property
    def softmax_scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else 1.0 / math.sqrt(self.head_dim)

    def plain_attention(self, layer_id: int) -> bool:
        """Whether layer `layer_id` is plain causal attention at the default scale (what a
        backend without window, soft-capping or scale support computes exactly)."""
        return (
            self.window_of(layer_id) is None and self.attn_logit_softcapping is None and self.attn_scale is None
            and not self.attention_sinks
        )  # fmt: skip

    def attention_features(self) -> List[str]:
        """The config fields whose attention a plain backend does not compute (empty if none)."""
        out = []
        if any(w is not None for w in self.layer_windows):
            out.append("sliding_window")
        if self.attn_logit_softcapping is not None:
            out.append("attn_logit_softcapping")
        if self.latent_attention is not None:
            out.append("latent_attention")  # (its own score scale, attn_scale, is part of it)
        elif self.attn_scale is not None:
            out.append("query_pre_attn_scalar")
        if self.attention_sinks:
            out.append("attention_sinks")
        return out

    def moe_features(self) -> List[str]:
        """The expert options a plain MoE backend does not compute (moe/base.py)."""
        return ["expert_bias", "clamped_swiglu"] if self.architecture == "GptOssForCausalLM" else []

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def layer_is_moe(self, layer_id: int) -> bool:
        ds = self.deepseek_moe
        if ds is not None:
            return self.is_moe and layer_id >= ds.first_k_dense_replace and layer_id % ds.moe_layer_freq == 0
        return self.is_moe and layer_id not in self.mlp_only_layers and (layer_id + 1) % self.decoder_sparse_step == 0

    @classmethod
    def from_hf(cls, hf: Any) -> "ModelConfig":
        archs = getattr(hf, "architectures", None) or []
        if not archs:
            raise ValueError("config.json has no 'architectures' entry; cannot pick a model implementation")
        num_heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
        theta, scaling = _rope_params(hf)
        arch = archs[0]
        mla, ds_moe = _deepseek(hf, arch) if arch in DEEPSEEK_ARCHITECTURES else (None, None)
        if mla is not None:
            head_dim = mla.qk_rope_head_dim  # the rotary's width (transformers' head_dim for DeepSeek)
        scalar = getattr(hf, "query_pre_attn_scalar", None)
        if getattr(hf, "use_bidirectional_attention", None):
            raise ValueError("use_bidirectional_attention is not implemented (causal decoders only)")
        # transformers 5 keeps it in rope_parameters (and on the config), 4 on the config
        rope_params = getattr(hf, "rope_parameters", None) or {}
        partial = float(rope_params.get("partial_rotary_factor") or getattr(hf, "partial_rotary_factor", None) or 1.0)
        eos = getattr(hf, "eos_token_id", None)
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        num_experts = getattr(hf, "num_experts", None) or getattr(hf, "num_local_experts", None) or 0
        if ds_moe is not None:
            num_experts = getattr(hf, "n_routed_experts", None) or num_experts
        rotary = RotaryConfig(
            head_dim=head_dim,
            rotary_dim=int(head_dim * partial),
            max_position=_window_cut(hf) or hf.max_position_embeddings,
            base=theta,
            scaling=scaling,
            # DeepSeek rotates adjacent pairs: V2 always (its complex rotation), V3 with rope_interleave
            interleaved=mla is not None and (arch == "DeepseekV2ForCausalLM" or bool(getattr(hf, "rope_interleave", True))),
        )
        bare = archs[0] in BARE_DECODERS
        # only MoE configs (Qwen*-MoE, Mixtral) count as MoE: a dense config may carry an unused field
        is_moe = "moe" in getattr(hf, "model_type", "") or getattr(hf, "num_local_experts", None) is not None or ds_moe is not None
        attention_multiplier = getattr(hf, "attention_multiplier", None)
        attn_scale = None  # Gemma scales the scores by query_pre_attn_scalar^-0.5, not head_dim^-0.5; DeepSeek by its own
        if mla is not None:
            attn_scale = _mla_softmax_scale(mla, scaling)
        elif scalar not in (None, head_dim) and arch in WINDOW_MASKED_ARCHITECTURES:
            attn_scale = float(scalar) ** -0.5
        return cls(
            architecture=arch,
            model_type=getattr(hf, "model_type", ""),
            num_layers=hf.num_hidden_layers,
            num_qo_heads=num_heads,
            # (MLA expands the latent to every query head; the pool holds one latent: pool_geometry)
            num_kv_heads=num_heads if mla is not None else getattr(hf, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            vocab_size=hf.vocab_size,
            rms_norm_eps=hf.rms_norm_eps,
            # (Gemma names it hidden_activation)
            hidden_act=str(getattr(hf, "hidden_activation", None) or getattr(hf, "hidden_act", "silu")),
            # a bare decoder has no LM head: it shares the embedding's (never used: it embeds only)
            tie_word_embeddings=bare or bool(getattr(hf, "tie_word_embeddings", False)),
            attention_bias=bool(getattr(hf, "attention_bias", False)),
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            rotary_config=rotary,
            eos_token_ids=eos_ids,
            context_cut_by_window=_window_cut(hf),
            num_experts=int(num_experts) if is_moe else 0,
            num_experts_per_tok=int(getattr(hf, "num_experts_per_tok", 0) or 0),
            # Mixtral's experts are intermediate_size wide
            moe_intermediate_size=int(getattr(hf, "moe_intermediate_size", 0) or hf.intermediate_size),
            norm_topk_prob=bool(getattr(hf, "norm_topk_prob", False)),
            decoder_sparse_step=int(getattr(hf, "decoder_sparse_step", 1) or 1),
            mlp_only_layers=list(getattr(hf, "mlp_only_layers", None) or []),
            is_bare_decoder=bare,
            shared_expert_intermediate_size=int(getattr(hf, "shared_expert_intermediate_size", 0) or 0),
            embedding_multiplier=float(getattr(hf, "embedding_multiplier", 1.0)),
            residual_multiplier=float(getattr(hf, "residual_multiplier", 1.0)),
            attention_multiplier=float(attention_multiplier) if attention_multiplier is not None else None,
            logits_scaling=float(getattr(hf, "logits_scaling", 1.0)),
            no_rope_layers=_no_rope_layers(hf),
            layer_windows=_layer_windows(hf, arch),
            local_rotary_config=_local_rope(hf, rotary),
            attn_scale=attn_scale,
            attn_logit_softcapping=_float_or_none(getattr(hf, "attn_logit_softcapping", None)),
            final_logit_softcapping=_float_or_none(getattr(hf, "final_logit_softcapping", None)),
            attention_sinks=arch == "GptOssForCausalLM",
            swiglu_alpha=float(getattr(hf, "swiglu_alpha", 1.702)),
            swiglu_limit=float(getattr(hf, "swiglu_limit", 7.0)),
            latent_attention=mla,
            deepseek_moe=ds_moe,
        )


def _float_or_none(x: Any) -> float | None:
    return float(x) if x is not None else None
