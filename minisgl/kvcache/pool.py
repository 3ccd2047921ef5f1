"""The KV pool: per layer, K and V of shape [num_slots, local_kv_heads, head_dim].

A slot holds one token's K/V; a page is `page_size` consecutive slots. The page table maps each
request's token positions to slots, so attention backends only ever see slot indices.
"""

from __future__ import annotations

import torch

from minisgl.distributed import get_tp_info
from minisgl.models.config import ModelConfig
from minisgl.utils.misc import div_even


class KVCachePool:
    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int, device: torch.device, dtype: torch.dtype) -> None:
        self.num_layers, self.num_slots = num_layers, num_slots
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.device, self.dtype = device, dtype
        self.buffer = torch.zeros(2, num_layers, num_slots, num_kv_heads, head_dim, device=device, dtype=dtype)

    def k_cache(self, layer_id: int) -> torch.Tensor:
        return self.buffer[0, layer_id]

    def v_cache(self, layer_id: int) -> torch.Tensor:
        return self.buffer[1, layer_id]

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, out_loc: torch.Tensor, layer_id: int) -> None:
        from minisgl.kernel import store_kv

        store_kv(self.k_cache(layer_id), self.v_cache(layer_id), k, v, out_loc)

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()


def create_kvcache_pool(model_config: ModelConfig, num_pages: int, page_size: int, device: torch.device, dtype: torch.dtype) -> KVCachePool:
    local_kv_heads = div_even(model_config.num_kv_heads, get_tp_info().size, allow_replicate=True)
    return KVCachePool(
        num_layers=model_config.num_layers,
        num_slots=num_pages * page_size,
        num_kv_heads=local_kv_heads,
        head_dim=model_config.head_dim,
        device=device,
        dtype=dtype,
    )
