"""ModelConfig: the architecture facts minisgl needs, read from a HF config (4.x or 5.x layout)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List

from minisgl.layers.rotary import RotaryConfig


def _rope_params(hf: Any) -> tuple[float, Dict[str, Any] | None]:
    """(theta, scaling) from either `rope_parameters` (transformers 5) or
    `rope_theta` + `rope_scaling` (checkpoints written by transformers 4)."""
    params = getattr(hf, "rope_parameters", None) or {}
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


def _window_cut(hf: Any) -> int | None:
    """The sliding window where a config attends through one shorter than max_position_embeddings:
    the context is cut to it (RotaryConfig.max_position, and so the engine's max_seq_len).

    No backend here masks a sliding window; within the window the mask hides nothing (a query
    attends to the keys less than `sliding_window` positions back, transformers'
    `sliding_window_overlay`), so a context of at most `sliding_window` tokens is exact. Phi-3-mini-4k
    sets 2047 of 4096, Mistral-7B-v0.1 4096 of 32768; Qwen2/3 configs with use_sliding_window
    false come from transformers with no window."""
    window = getattr(hf, "sliding_window", None)
    if getattr(hf, "use_sliding_window", True) is False:
        window = None
    if window is not None and int(window) < hf.max_position_embeddings:
        return int(window)
    return None


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

    def layer_has_rope(self, layer_id: int) -> bool:
        return layer_id not in self.no_rope_layers

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def layer_is_moe(self, layer_id: int) -> bool:
        return self.is_moe and layer_id not in self.mlp_only_layers and (layer_id + 1) % self.decoder_sparse_step == 0

    @classmethod
    def from_hf(cls, hf: Any) -> "ModelConfig":
        archs = getattr(hf, "architectures", None) or []
        if not archs:
            raise ValueError("config.json has no 'architectures' entry; cannot pick a model implementation")
        num_heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
        theta, scaling = _rope_params(hf)
        # transformers 5 keeps it in rope_parameters (and on the config), 4 on the config
        rope_params = getattr(hf, "rope_parameters", None) or {}
        partial = float(rope_params.get("partial_rotary_factor") or getattr(hf, "partial_rotary_factor", None) or 1.0)
        eos = getattr(hf, "eos_token_id", None)
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        num_experts = getattr(hf, "num_experts", None) or getattr(hf, "num_local_experts", None) or 0
        bare = archs[0] in BARE_DECODERS
        # only MoE configs (Qwen*-MoE, Mixtral) count as MoE: a dense config may carry an unused field
        is_moe = "moe" in getattr(hf, "model_type", "") or getattr(hf, "num_local_experts", None) is not None
        attention_multiplier = getattr(hf, "attention_multiplier", None)
        return cls(
            architecture=archs[0],
            model_type=getattr(hf, "model_type", ""),
            num_layers=hf.num_hidden_layers,
            num_qo_heads=num_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            vocab_size=hf.vocab_size,
            rms_norm_eps=hf.rms_norm_eps,
            hidden_act=getattr(hf, "hidden_act", "silu"),
            # a bare decoder has no LM head: it shares the embedding's (never used: it embeds only)
            tie_word_embeddings=bare or bool(getattr(hf, "tie_word_embeddings", False)),
            attention_bias=bool(getattr(hf, "attention_bias", False)),
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            rotary_config=RotaryConfig(
                head_dim=head_dim,
                rotary_dim=int(head_dim * partial),
                max_position=_window_cut(hf) or hf.max_position_embeddings,
                base=theta,
                scaling=scaling,
            ),
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
        )
