"""The attention layer: split qkv, optional per-head q/k norm (Qwen3), rotary, then the backend
(which also stores this step's K/V into the paged pool)."""

from __future__ import annotations

import torch
from torch import nn

from minisgl.core import get_global_ctx
from minisgl.layers.norm import RMSNorm
from minisgl.layers.rotary import RotaryEmbedding


class AttentionLayer(nn.Module):
    def __init__(
        self,
        layer_id: int,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rotary: RotaryEmbedding,
        q_norm: RMSNorm | None = None,
        k_norm: RMSNorm | None = None,
    ) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_q_heads, self.num_kv_heads, self.head_dim = num_q_heads, num_kv_heads, head_dim
        self.q_size, self.kv_size = num_q_heads * head_dim, num_kv_heads * head_dim
        self.rotary = rotary
        # A tuple, not submodules: the norms' weights belong to the owning self_attn block, so
        # their state-dict names match the checkpoint's (self_attn.q_norm.weight).
        self._qk_norm = (q_norm, k_norm) if q_norm is not None and k_norm is not None else None

    def forward(self, qkv: torch.Tensor) -> torch.Tensor:
        ctx = get_global_ctx()
        batch = ctx.batch
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_q_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self._qk_norm is not None:
            q, k = self._qk_norm[0](q), self._qk_norm[1](k)
        q, k = self.rotary(batch.positions, q, k)
        assert ctx.attn_backend is not None
        o = ctx.attn_backend.forward(q, k, v, self.layer_id, batch)
        return o.reshape(-1, self.q_size)
