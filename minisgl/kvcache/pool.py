"""The KV pool: per layer, K and V of shape [num_slots, local_kv_heads, head_dim].

A slot holds one token's K/V; a page is `page_size` consecutive slots. The page table maps each
request's token positions to slots, so attention backends only ever see slot indices.

The pool stores K/V in the model dtype by default ("auto") or, to halve the bytes decode
attention streams, in 8 bits (`kv_cache_dtype`, vLLM's and SGLang's name for it):

- "fp8_e4m3" (CUDA): float8_e4m3fn with a unit scale, as vLLM does without calibration; values
  beyond e4m3's range (+-448) saturate instead of turning into NaN. The GPU kernels convert in
  hardware, so the format carries no scale.
- "int8" (CPU): symmetric int8 with one fp32 scale per (token, KV head), the absmax over the
  head's `head_dim` values / 127, like llama.cpp's q8_0 cache. AVX-512 has no fp8 conversion, and
  a per-head scale keeps ~7 bits of each head's range, where e4m3's 3-bit mantissa keeps ~4.

Every reader of a quantized pool dequantizes the same way: `q * scale` in fp32.
"""

from __future__ import annotations

from typing import Tuple

import torch

from minisgl.distributed import get_tp_info
from minisgl.models.config import ModelConfig
from minisgl.utils.misc import div_even

KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "int8")
FP8_MAX = 448.0  # largest finite float8_e4m3fn

_STORAGE = {"fp8_e4m3": torch.float8_e4m3fn, "int8": torch.int8}


def check_kv_cache_dtype(name: str, device: torch.device) -> None:
    """Raise ValueError unless `name` is a KV cache dtype this device can store and read."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {name!r}")
    if name == "fp8_e4m3" and device.type != "cuda":
        raise ValueError("kv_cache_dtype='fp8_e4m3' needs a CUDA device (fp8 conversion in hardware); on a CPU use 'int8'")
    if name == "int8" and device.type != "cpu":
        raise ValueError("kv_cache_dtype='int8' (per-head scales) is the CPU format; on CUDA use 'fp8_e4m3'")


def kv_storage_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    return _STORAGE.get(name, model_dtype)


def kv_bytes_per_slot(name: str, model_dtype: torch.dtype, num_layers: int, num_kv_heads: int, head_dim: int) -> int:
    """Bytes one token's K and V take over all layers, scales included."""
    per_head = head_dim * kv_storage_dtype(name, model_dtype).itemsize + (4 if name == "int8" else 0)
    return 2 * num_layers * num_kv_heads * per_head


class KVCachePool:
    def __init__(
        self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int, device: torch.device, dtype: torch.dtype,
        kv_cache_dtype: str = "auto",
    ) -> None:  # fmt: skip
        self.num_layers, self.num_slots = num_layers, num_slots
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.device = device
        self.model_dtype = dtype  # what the model computes in; `dtype` is what the pool stores
        self.kv_cache_dtype = kv_cache_dtype
        self.dtype = kv_storage_dtype(kv_cache_dtype, dtype)
        self.buffer = torch.zeros(2, num_layers, num_slots, num_kv_heads, head_dim, device=device, dtype=self.dtype)
        # int8 only: [2, layers, slots, heads] fp32 scales (K, V)
        self.scales: torch.Tensor | None = None
        if kv_cache_dtype == "int8":
            self.scales = torch.zeros(2, num_layers, num_slots, num_kv_heads, device=device, dtype=torch.float32)

    @property
    def quantized(self) -> bool:
        return self.kv_cache_dtype != "auto"

    def k_cache(self, layer_id: int) -> torch.Tensor:
        return self.buffer[0, layer_id]

    def v_cache(self, layer_id: int) -> torch.Tensor:
        return self.buffer[1, layer_id]

    def k_scale(self, layer_id: int) -> torch.Tensor:
        assert self.scales is not None, "only an int8 pool has scales"
        return self.scales[0, layer_id]

    def v_scale(self, layer_id: int) -> torch.Tensor:
        assert self.scales is not None, "only an int8 pool has scales"
        return self.scales[1, layer_id]

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, out_loc: torch.Tensor, layer_id: int) -> None:
        if self.quantized:
            self._store_quantized(k, v, out_loc, layer_id)
            return
        from minisgl.kernel import store_kv

        store_kv(self.k_cache(layer_id), self.v_cache(layer_id), k, v, out_loc)

    def _store_quantized(self, k: torch.Tensor, v: torch.Tensor, out_loc: torch.Tensor, layer_id: int) -> None:
        """The reference quantizing store (backends with their own kernels store bitwise alike)."""
        idx = out_loc.long()
        for which, x in ((0, k), (1, v)):
            if self.scales is None:  # fp8: saturate, then round to nearest
                q = x.float().clamp(-FP8_MAX, FP8_MAX).to(self.dtype)
            else:
                q, scale = quantize_int8_per_head(x)
                self.scales[which, layer_id].index_copy_(0, idx, scale)
            # (through uint8 views: torch's CPU index kernels do not take float8)
            self.buffer[which, layer_id].view(torch.uint8).index_copy_(0, idx, q.view(torch.uint8))

    def gather(self, layer_id: int, slots: torch.Tensor, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
        """K and V of pool rows `slots` (any shape) as `dtype`, dequantized: [*slots.shape, Hk, D]."""
        if self.dtype == torch.float8_e4m3fn:
            k8, v8 = self.k_cache(layer_id).view(torch.uint8)[slots], self.v_cache(layer_id).view(torch.uint8)[slots]
            return k8.view(self.dtype).to(dtype), v8.view(self.dtype).to(dtype)
        k, v = self.k_cache(layer_id)[slots], self.v_cache(layer_id)[slots]
        if self.scales is not None:
            k = (k.float() * self.k_scale(layer_id)[slots].unsqueeze(-1)).to(dtype)
            v = (v.float() * self.v_scale(layer_id)[slots].unsqueeze(-1)).to(dtype)
            return k, v
        return k.to(dtype), v.to(dtype)

    @property
    def nbytes(self) -> int:
        extra = 0 if self.scales is None else self.scales.numel() * self.scales.element_size()
        return self.buffer.numel() * self.buffer.element_size() + extra


def quantize_int8_per_head(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """x [T, H, D] -> (codes int8 [T, H, D], scales fp32 [T, H]): scale = absmax / 127, code =
    round-half-even(x * (127 / absmax)); an all-zero head gets scale 0 and codes 0. The C store
    (kernel/cpu) computes exactly these fp32 operations, so both give the same bits."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1)
    # a true division (the C store's 127.0f / amax): `127.0 / amax` on a tensor is computed as
    # reciprocal(amax) * 127 in torch, one rounding more
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    codes = torch.round(xf * inv.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return codes, amax / 127.0


def create_kvcache_pool(
    model_config: ModelConfig, num_pages: int, page_size: int, device: torch.device, dtype: torch.dtype,
    kv_cache_dtype: str = "auto",
) -> KVCachePool:  # fmt: skip
    local_kv_heads = div_even(model_config.num_kv_heads, get_tp_info().size, allow_replicate=True)
    return KVCachePool(
        num_layers=model_config.num_layers,
        num_slots=num_pages * page_size,
        num_kv_heads=local_kv_heads,
        head_dim=model_config.head_dim,
        device=device,
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
    )
