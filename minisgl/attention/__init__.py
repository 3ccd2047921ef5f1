"""Attention backends: torch (reference, CPU + CUDA), triton and flashinfer (CUDA)."""

from minisgl.attention.base import ATTN_BACKENDS, BaseAttnBackend, BaseAttnMetadata, create_attention_backend

__all__ = ["ATTN_BACKENDS", "BaseAttnBackend", "BaseAttnMetadata", "create_attention_backend"]
