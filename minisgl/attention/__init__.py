"""Attention backends: torch (reference, CPU + CUDA), triton and flashinfer (CUDA)."""

from minisgl.attention.base import AttnCap, BaseAttnBackend, BaseAttnMetadata
from minisgl.attention.registry import ATTN_BACKENDS, create_attention_backend, resolve_attention_backend

__all__ = ["ATTN_BACKENDS", "AttnCap", "BaseAttnBackend", "BaseAttnMetadata", "create_attention_backend", "resolve_attention_backend"]
