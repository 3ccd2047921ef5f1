"""The attention layer: split qkv, optional per-head q/k norm (Qwen3), rotary, then the backend
(which also stores this step's K/V into the paged pool).

On CUDA (Triton available, full-width rotary, KV pool in the model dtype or fp8_e4m3) all of that
up to the attention itself is one fused kernel, `triton_ops.attention_prologue`: a decode step of a small
model is bound by its kernel count, and this turns four to six kernels per layer into one. A
backend may take the whole step from the qkv rows itself (`forward_qkv`: the CPU one)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from minisgl.core import get_global_ctx
from minisgl.kernel.fused import triton_ops, use_fused
from minisgl.layers.norm import RMSNorm
from minisgl.layers.rotary import RotaryEmbedding

if TYPE_CHECKING:
    from minisgl.kvcache.pool import KVCachePool


class AttentionLayer(nn.Module):
    def __init__(
        self,
        layer_id: int,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rotary: RotaryEmbedding | None,
        q_norm: RMSNorm | None = None,
        k_norm: RMSNorm | None = None,
        softmax_scale: float | None = None,
        sinks_owner: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_q_heads, self.num_kv_heads, self.head_dim = num_q_heads, num_kv_heads, head_dim
        self.q_size, self.kv_size = num_q_heads * head_dim, num_kv_heads * head_dim
        self.rotary = rotary  # None: a NoPE layer (SmolLM3), no position rotation at all
        # None: the backends' 1/sqrt(head_dim). Otherwise (Granite's attention_multiplier) q is
        # scaled by softmax_scale * sqrt(head_dim) before the backend, whose 1/sqrt(head_dim)
        # then makes the product softmax_scale: every backend serves it unchanged.
        self.softmax_scale = softmax_scale
        # A tuple, not submodules: the norms' weights belong to the owning self_attn block, so
        # their state-dict names match the checkpoint's (self_attn.q_norm.weight).
        self._qk_norm = (q_norm, k_norm) if q_norm is not None and k_norm is not None else None
        # GPT-OSS's attention sinks: the `sinks` parameter [num_q_heads] of the owning block, read
        # at each call (loading assigns the parameter anew) and held in a tuple likewise
        self._sinks_owner = (sinks_owner,) if sinks_owner is not None else None

    @property
    def sinks(self) -> torch.Tensor | None:
        if self._sinks_owner is None:
            return None
        sinks = self._sinks_owner[0].sinks
        assert isinstance(sinks, torch.Tensor)
        return sinks

    @property
    def plain(self) -> bool:
        """Whether this is the attention the fused kernels compute (the CUDA prologue, the CPU
        kernels): full-width rotate-half rotary and the default scale."""
        r = self.rotary
        return r is not None and r.rotary_dim == self.head_dim and not r.interleaved and self.softmax_scale is None

    def _can_fuse(self, qkv: torch.Tensor, cache_dtype: torch.dtype) -> bool:
        if not use_fused(qkv) or not self.plain or self.rotary is None or self.rotary.cos.device != qkv.device:
            return False
        # the kernel stores the model dtype or fp8 (bitwise the pool's reference fp8 store)
        if cache_dtype not in (qkv.dtype, torch.float8_e4m3fn):
            return False
        # (the kernel computes plain RMSNorm, not Gemma's unit-offset kind)
        return self._qk_norm is None or all(n.weight.dtype == qkv.dtype and not n.unit_offset for n in self._qk_norm)

    def _store_loc(self, kv: KVCachePool, out_loc: torch.Tensor) -> torch.Tensor:
        """Where this layer's K/V of the step go: `out_loc`, or a hybrid pool's window slots of it
        for a sliding layer (kvcache/window.py; a device gather, inside CUDA graphs)."""
        trans = kv.translation_of(self.layer_id)
        return out_loc if trans is None else trans[out_loc.long()]

    def forward(self, qkv: torch.Tensor) -> torch.Tensor:
        ctx = get_global_ctx()
        batch = ctx.batch
        backend, kv = ctx.attn_backend, ctx.kv_cache
        assert backend is not None and kv is not None
        o = backend.forward_qkv(qkv, self, batch)
        if o is not None:
            return o
        if self._can_fuse(qkv, kv.dtype):
            assert self.rotary is not None  # (_can_fuse: plain)
            norm = self._qk_norm
            q = triton_ops().attention_prologue(  # type: ignore[union-attr]
                qkv, batch.positions, norm[0].weight if norm else None, norm[1].weight if norm else None,
                norm[0].eps if norm else 0.0, self.rotary.cos, self.rotary.sin,
                kv.k_cache(self.layer_id), kv.v_cache(self.layer_id), self._store_loc(kv, batch.out_loc),
                self.num_q_heads, self.num_kv_heads, self.head_dim,
            )  # fmt: skip
            return backend.attend(q, self.layer_id, batch, self.sinks).reshape(-1, self.q_size)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_q_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self._qk_norm is not None:
            q, k = self._qk_norm[0](q), self._qk_norm[1](k)
        if self.rotary is not None:
            q, k = self.rotary(batch.positions, q, k)
        if self.softmax_scale is not None:
            q = q * (self.softmax_scale * self.head_dim**0.5)
        o = backend.forward(q, k, v, self.layer_id, batch, self.sinks)
        return o.reshape(-1, self.q_size)
