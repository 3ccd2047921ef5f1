"""Rotary position embedding (HF's rotate-half layout) with default, linear, llama3, yarn and longrope scaling.

The cos/sin table is computed in float32 on the real device (never on meta: the model is built
on meta and its weights loaded afterwards, but the table is not a weight) and shared by every
layer of one model with the same parameters: the engine builds its model inside
`rope_tables(device)`, whose cache ends with the build (the model holds its tables, nothing is
left for Engine.shutdown to clear).
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Tuple

import torch
from torch import nn

from minisgl.kernel.fused import triton_ops, use_fused

# the device of tables built outside a model build (standalone kernel checks)
_ROPE_DEVICE: torch.device = torch.device("cpu")
# the model builds in progress: (device, tables by parameters), see rope_tables
_BUILDS: List[Tuple[torch.device, Dict[Tuple[Any, ...], "RotaryEmbedding"]]] = []


def set_rope_device(device: torch.device) -> None:
    """The device of tables built outside `rope_tables` (standalone checks of the kernels)."""
    global _ROPE_DEVICE
    _ROPE_DEVICE = torch.device(device)


@contextmanager
def rope_tables(device: torch.device) -> Iterator[None]:
    """Layers built inside get their tables on `device`, one per distinct set of parameters."""
    _BUILDS.append((torch.device(device), {}))
    try:
        yield
    finally:
        _BUILDS.pop()


@dataclass(frozen=True)
class RotaryConfig:
    head_dim: int
    rotary_dim: int
    max_position: int
    base: float
    scaling: Dict[str, Any] | None = field(default=None, hash=False, compare=False)
    # GLM's layout: the rotated pairs are adjacent dims (0, 1), (2, 3)... instead of (i, i + d/2)
    interleaved: bool = False

    def key(self) -> Tuple[Any, ...]:
        scaling = tuple(sorted((k, str(v)) for k, v in (self.scaling or {}).items()))
        return (self.head_dim, self.rotary_dim, self.max_position, self.base, scaling, self.interleaved)


def _inv_freq(cfg: RotaryConfig) -> torch.Tensor:
    dim = cfg.rotary_dim
    inv_freq = 1.0 / (cfg.base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type in ("default", None):
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
        return torch.where(is_medium, smoothed, scaled)
    if rope_type == "yarn":
        return _yarn(cfg)[0]
    raise ValueError(f"unsupported rope scaling type {rope_type!r}; supported: default, linear, llama3, yarn, longrope")


def _yarn(cfg: RotaryConfig) -> Tuple[torch.Tensor, float]:
    """YaRN (GPT-OSS, DeepSeek): (inv_freq, attention factor) as transformers computes them
    (`_compute_yarn_parameters`). Each frequency blends the plain one (extrapolation) and the one
    divided by `factor` (interpolation) along a linear ramp over the dims between the correction
    dims of `beta_fast` and `beta_slow` rotations within the original context (floored / ceiled
    unless `truncate` is false); cos/sin are then multiplied by the attention factor, default
    0.1 * ln(factor) + 1 (or the ratio of two such with `mscale` / `mscale_all_dim`)."""
    scaling = cfg.scaling or {}
    if "original_max_position_embeddings" not in scaling:
        raise ValueError("rope_scaling type 'yarn' needs the field 'original_max_position_embeddings'")
    original = float(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor")
    factor = float(factor) if factor is not None else cfg.max_position / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = mscale(factor, float(m)) / mscale(factor, float(m_all)) if m and m_all else mscale(factor)
    beta_fast, beta_slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)
    dim, base = cfg.rotary_dim, cfg.base

    def correction_dim(rotations: float) -> float:  # the dim that turns `rotations` times over `original`
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # (a zero-width ramp)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    extrapolate = 1 - ramp  # the share of the plain frequency
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv_freq, float(attention_factor)


def _cos_sin_table(cfg: RotaryConfig) -> Tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every position, [max_position, rotary_dim] each (float32)."""
    t = torch.arange(cfg.max_position, dtype=torch.float32)
    if _rope_type(cfg) in ("longrope", "su"):  # "su": LongRoPE's name in the first Phi-3 configs
        if cfg.interleaved:
            raise ValueError("longrope with an interleaved rotary layout is not supported")
        return _longrope_table(cfg, t)
    freqs = torch.outer(t, _inv_freq(cfg))
    emb = freqs.repeat_interleave(2, dim=-1) if cfg.interleaved else torch.cat([freqs, freqs], dim=-1)
    if _rope_type(cfg) == "yarn":
        attention_factor = _yarn(cfg)[1]
        return emb.cos() * attention_factor, emb.sin() * attention_factor
    return emb.cos(), emb.sin()


def _longrope_table(cfg: RotaryConfig, t: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """LongRoPE (Phi-3.5, Phi-4-mini) as transformers computes it (`_compute_longrope_parameters`):
    inv_freq = 1 / (ext * base^(2i/d)) with ext = short_factor or long_factor, and cos/sin times
    attention_factor (default sqrt(1 + ln(factor) / ln(original)), factor = max_position / original).

    Which set, per token: row p holds the short factors for p < original_max_position_embeddings
    and the long ones from there on. transformers picks one set per forward by its longest position
    (`dynamic_rope_update`: long once max(position_ids) + 1 > original), and its generate drops the
    cache at the crossing and recomputes the whole sequence with the long set (Phi3's
    `prepare_inputs_for_generation`). A paged engine rotates each token once, when its K is stored,
    and never recomputes stored K, so the choice is per position: identical to transformers for
    every sequence within original_max_position_embeddings; past it the tokens before the crossing
    keep the short set (transformers' forward fed one token at a time past the original length).
    vLLM and SGLang instead rotate every token of a batch with the long set once any position in it
    exceeds the original length, which makes one request's rotation depend on its batch mates. One
    table indexed by position is what every path reads (module path, fused CUDA prologue, graphs,
    the CPU C loop). docs/MODELS.md says the same."""
    scaling = cfg.scaling or {}
    for key in ("short_factor", "long_factor", "original_max_position_embeddings"):
        if key not in scaling:
            raise ValueError(f"rope_scaling type 'longrope' needs the field {key!r}")
    original = int(scaling["original_max_position_embeddings"])
    factor = float(scaling.get("factor") or cfg.max_position / original)
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    dim = cfg.rotary_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    cos, sin = [], []
    for key, rows in (("short_factor", t[:original]), ("long_factor", t[original:])):
        ext = [float(f) for f in scaling[key]]
        if len(ext) != dim // 2:
            raise ValueError(f"rope_scaling.{key} has {len(ext)} entries; the rotary dimension {dim} needs {dim // 2}")
        inv_freq = 1.0 / (torch.tensor(ext, dtype=torch.float32) * cfg.base**exponents)
        freqs = torch.outer(rows, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        cos.append(emb.cos() * attention_factor)
        sin.append(emb.sin() * attention_factor)
    return torch.cat(cos), torch.cat(sin)


def _rope_type(cfg: RotaryConfig) -> str:
    scaling = cfg.scaling or {}
    return scaling.get("rope_type", scaling.get("type", "default")) or "default"


class RotaryEmbedding(nn.Module):
    def __init__(self, cfg: RotaryConfig, device: torch.device | None = None) -> None:
        super().__init__()
        self.head_dim, self.rotary_dim, self.interleaved = cfg.head_dim, cfg.rotary_dim, cfg.interleaved
        # Computed on the device it serves (its cos/sin round as that device's do), outside any
        # `torch.device("meta")` context the caller may be in.
        with torch.device(device if device is not None else _ROPE_DEVICE):
            # Plain attributes, not buffers: they are not weights and must not be built on meta.
            self.cos, self.sin = _cos_sin_table(cfg)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """q: [T, Hq, D], k: [T, Hk, D]; returns rotated copies."""
        if use_fused(q) and self.cos.device == q.device and not self.interleaved:  # the kernel rotates halves
            return triton_ops().apply_rotary(positions, q, k, self.cos, self.sin, self.rotary_dim)  # type: ignore[union-attr]
        return self.forward_torch(positions, q, k)

    def forward_torch(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        rotate = _rotate_pairs if self.interleaved else _rotate_half
        return _apply(q, cos, sin, self.rotary_dim, rotate), _apply(k, cos, sin, self.rotary_dim, rotate)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """The interleaved layout's rotate_half: (x0, x1, x2, x3...) -> (-x1, x0, -x3, x2...)."""
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def _apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int, rotate: Any = _rotate_half) -> torch.Tensor:
    if rotary_dim == x.shape[-1]:
        return x * cos + rotate(x) * sin
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    return torch.cat([rot * cos + rotate(rot) * sin, rest], dim=-1)


def get_rope(cfg: RotaryConfig) -> RotaryEmbedding:
    """The table for `cfg`: shared within the current `rope_tables` build, else a new one."""
    if not _BUILDS:
        return RotaryEmbedding(cfg)
    device, tables = _BUILDS[-1]
    key = cfg.key()
    if key not in tables:
        tables[key] = RotaryEmbedding(cfg, device)
    return tables[key]
