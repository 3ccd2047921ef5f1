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

The latent layout (multi-head latent attention, DeepSeek-V2/V3: `ModelConfig.latent_attention`)
keeps one buffer: per layer [num_slots, 1, kv_lora_rank + qk_rope_head_dim], each token's
compressed latent and its rotary key, and no V buffer: V is a view of K's first `v_dim`
(= kv_lora_rank) values. So a token costs (kv_lora_rank + rope) values per layer instead of
2 * heads * head_dim; int8 scales one row (the latent and the rotary key together) per token.
"""

from __future__ import annotations

from typing import Dict, Tuple

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


def kv_bytes_per_slot(name: str, model_dtype: torch.dtype, num_layers: int, num_kv_heads: int, head_dim: int, latent: bool = False) -> int:
    """Bytes one token's K and V take over all layers, scales included (`latent`: K alone, V
    being a view of it)."""
    per_head = head_dim * kv_storage_dtype(name, model_dtype).itemsize + (4 if name == "int8" else 0)
    return (1 if latent else 2) * num_layers * num_kv_heads * per_head


def pool_geometry(model_config: ModelConfig, tp_size: int) -> Tuple[int, int, int | None]:
    """(KV heads per rank, K head dim, v_dim) of the pool for `model_config`: v_dim None for
    separate K and V buffers; for latent attention one replicated "head" of the latent and the
    rotary key, V its first kv_lora_rank values."""
    mla = model_config.latent_attention
    if mla is not None:
        return 1, mla.latent_dim, mla.kv_lora_rank
    return div_even(model_config.num_kv_heads, tp_size, allow_replicate=True), model_config.head_dim, None


def model_kv_bytes_per_slot(
    model_config: ModelConfig, kv_cache_dtype: str, model_dtype: torch.dtype, tp_size: int, num_layers: int | None = None
) -> int:
    """Bytes one token takes in this rank's pool for `model_config` (the engine sizes the pool by
    it); `num_layers`: of that many of its layers only (a hybrid pool's global or sliding ones)."""
    heads, head_dim, v_dim = pool_geometry(model_config, tp_size)
    layers = model_config.num_layers if num_layers is None else num_layers
    return kv_bytes_per_slot(kv_cache_dtype, model_dtype, layers, heads, head_dim, latent=v_dim is not None)


class KVCachePool:
    def __init__(
        self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int, device: torch.device, dtype: torch.dtype,
        kv_cache_dtype: str = "auto", v_dim: int | None = None,
    ) -> None:  # fmt: skip
        """`v_dim` None: K and V buffers of [num_slots, num_kv_heads, head_dim] per layer; else the
        latent layout: K alone, V the view of its first `v_dim` values."""
        self.num_layers, self.num_slots = num_layers, num_slots
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.v_dim = v_dim
        if v_dim is not None and not 0 < v_dim <= head_dim:
            raise ValueError(f"a latent pool's v_dim must be in (0, head_dim={head_dim}], got {v_dim}")
        self.device = device
        self.model_dtype = dtype  # what the model computes in; `dtype` is what the pool stores
        self.kv_cache_dtype = kv_cache_dtype
        self.dtype = kv_storage_dtype(kv_cache_dtype, dtype)
        planes = 1 if self.latent else 2
        self.buffer = torch.zeros(planes, num_layers, num_slots, num_kv_heads, head_dim, device=device, dtype=self.dtype)
        # int8 only: [planes, layers, slots, heads] fp32 scales (K, V; a latent pool: K's only)
        self.scales: torch.Tensor | None = None
        if kv_cache_dtype == "int8":
            self.scales = torch.zeros(planes, num_layers, num_slots, num_kv_heads, device=device, dtype=torch.float32)

    def translation_of(self, layer_id: int) -> torch.Tensor | None:
        """The main slot -> window slot map a reader of layer `layer_id` applies to the page
        table's slots (HybridKVCachePool's sliding layers); None: the slots are this layer's."""
        return None

    @property
    def latent(self) -> bool:
        """The latent layout: V is K's first `v_dim` values, not a buffer of its own."""
        return self.v_dim is not None

    @property
    def quantized(self) -> bool:
        return self.kv_cache_dtype != "auto"

    def k_cache(self, layer_id: int) -> torch.Tensor:
        return self.buffer[0, layer_id]

    def v_cache(self, layer_id: int) -> torch.Tensor:
        if self.v_dim is not None:
            return self.buffer[0, layer_id, ..., : self.v_dim]
        return self.buffer[1, layer_id]

    def k_scale(self, layer_id: int) -> torch.Tensor:
        assert self.scales is not None, "only an int8 pool has scales"
        return self.scales[0, layer_id]

    def v_scale(self, layer_id: int) -> torch.Tensor:
        assert self.scales is not None, "only an int8 pool has scales"
        return self.scales[0 if self.latent else 1, layer_id]

    def store_kv(self, k: torch.Tensor, v: torch.Tensor | None, out_loc: torch.Tensor, layer_id: int) -> None:
        """Write this step's K and V ([T, Hk, D] each) at pool slots `out_loc`; a latent pool
        takes K alone (v None: V is part of it)."""
        if self.latent != (v is None):
            raise ValueError("a latent KV pool stores K alone (v=None); a K/V pool needs both")
        if self.quantized:
            self._store_quantized(k, v, out_loc, layer_id)
            return
        if v is None:
            self.k_cache(layer_id).index_copy_(0, out_loc.long(), k.to(self.dtype))
            return
        from minisgl.kernel import store_kv

        store_kv(self.k_cache(layer_id), self.v_cache(layer_id), k, v, out_loc)

    def _store_quantized(self, k: torch.Tensor, v: torch.Tensor | None, out_loc: torch.Tensor, layer_id: int) -> None:
        """The reference quantizing store (backends with their own kernels store bitwise alike)."""
        idx = out_loc.long()
        for which, x in ((0, k),) if v is None else ((0, k), (1, v)):
            if self.scales is None:  # fp8: saturate, then round to nearest
                q = x.float().clamp(-FP8_MAX, FP8_MAX).to(self.dtype)
            else:
                q, scale = quantize_int8_per_head(x)
                self.scales[which, layer_id].index_copy_(0, idx, scale)
            # (through uint8 views: torch's CPU index kernels do not take float8)
            self.buffer[which, layer_id].view(torch.uint8).index_copy_(0, idx, q.view(torch.uint8))

    def gather(self, layer_id: int, slots: torch.Tensor, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
        """K and V of pool rows `slots` (any shape) as `dtype`, dequantized: [*slots.shape, Hk, D]
        (a latent pool's V: [..., v_dim], a view of the returned K)."""
        k = self._gather_one(0, layer_id, slots, dtype)
        if self.latent:
            return k, k[..., : self.v_dim]
        return k, self._gather_one(1, layer_id, slots, dtype)

    def _gather_one(self, which: int, layer_id: int, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        # (fp8 through uint8 views: torch's CPU index kernels do not take float8)
        plane = self.buffer[which, layer_id]
        if self.dtype == torch.float8_e4m3fn:
            return plane.view(torch.uint8)[slots].view(self.dtype).to(dtype)
        x = plane[slots]
        if self.scales is not None:
            return (x.float() * self.scales[which, layer_id][slots].unsqueeze(-1)).to(dtype)
        return x.to(dtype)

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


class HybridKVCachePool(KVCachePool):
    """The pool of a model with sliding-window layers (kvcache/window.py): the global layers'
    K/V in `full`, one slot per main slot; the sliding layers' K/V in `window`, a smaller pool
    reached through `translation` ([main slots] int64 on the device: main slot -> window slot).
    Layer ids stay the model's: `k_cache`, `store_kv` and `gather` of a sliding layer go to the
    window pool (store and gather translate the slots they are given), so a backend that reads
    through them needs nothing else; a kernel that walks the page table itself applies the
    layer's `translation_of` to each slot it loads."""

    def __init__(
        self, layer_windows: Tuple[int | None, ...], num_slots: int, num_window_slots: int, page_size: int,
        num_kv_heads: int, head_dim: int, device: torch.device, dtype: torch.dtype, kv_cache_dtype: str = "auto",
    ) -> None:  # fmt: skip
        full = [i for i, w in enumerate(layer_windows) if w is None]
        sliding = [i for i, w in enumerate(layer_windows) if w is not None]
        # (this object's own buffer is empty: every layer lives in one of the two pools)
        super().__init__(0, num_slots, num_kv_heads, head_dim, device, dtype, kv_cache_dtype)
        self.num_layers = len(layer_windows)
        self.full = KVCachePool(len(full), num_slots, num_kv_heads, head_dim, device, dtype, kv_cache_dtype)
        self.window = KVCachePool(len(sliding), num_window_slots, num_kv_heads, head_dim, device, dtype, kv_cache_dtype)
        self.scales = self.full.scales  # (what a reader checks to know the pool is int8)
        # layer id -> (its pool, its index there)
        self._where: Dict[int, Tuple[KVCachePool, int]] = {}
        for local, i in enumerate(full):
            self._where[i] = (self.full, local)
        for local, i in enumerate(sliding):
            self._where[i] = (self.window, local)
        # every main slot starts pointing at the window pool's last page (the dummy page's twin):
        # an entry is rewritten when its main page is allocated; stale ones are only read masked
        dummy = num_window_slots - page_size
        self.translation = dummy + torch.arange(num_slots, device=device, dtype=torch.int64) % page_size

    def sliding(self, layer_id: int) -> bool:
        return self._where[layer_id][0] is self.window

    def translation_of(self, layer_id: int) -> torch.Tensor | None:
        return self.translation if self.sliding(layer_id) else None

    def k_cache(self, layer_id: int) -> torch.Tensor:
        pool, local = self._where[layer_id]
        return pool.k_cache(local)

    def v_cache(self, layer_id: int) -> torch.Tensor:
        pool, local = self._where[layer_id]
        return pool.v_cache(local)

    def k_scale(self, layer_id: int) -> torch.Tensor:
        pool, local = self._where[layer_id]
        return pool.k_scale(local)

    def v_scale(self, layer_id: int) -> torch.Tensor:
        pool, local = self._where[layer_id]
        return pool.v_scale(local)

    def _slots(self, layer_id: int, slots: torch.Tensor) -> torch.Tensor:
        return self.translation[slots.long()] if self.sliding(layer_id) else slots

    def store_kv(self, k: torch.Tensor, v: torch.Tensor | None, out_loc: torch.Tensor, layer_id: int) -> None:
        pool, local = self._where[layer_id]
        pool.store_kv(k, v, self._slots(layer_id, out_loc), local)

    def gather(self, layer_id: int, slots: torch.Tensor, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
        pool, local = self._where[layer_id]
        return pool.gather(local, self._slots(layer_id, slots), dtype)

    @property
    def nbytes(self) -> int:
        return self.full.nbytes + self.window.nbytes + self.translation.numel() * self.translation.element_size()


def create_kvcache_pool(
    model_config: ModelConfig, num_pages: int, page_size: int, device: torch.device, dtype: torch.dtype,
    kv_cache_dtype: str = "auto", num_window_pages: int | None = None,
) -> KVCachePool:  # fmt: skip
    """`num_window_pages` (pages counted as `num_pages`, the dummy page included): a hybrid pool
    for a model with sliding layers (kvcache/window.py); None: every layer keeps every token."""
    heads, head_dim, v_dim = pool_geometry(model_config, get_tp_info().size)
    if num_window_pages is not None:
        assert v_dim is None and model_config.layer_windows, "a window pool needs sliding layers and a K/V pool"
        return HybridKVCachePool(
            model_config.layer_windows, num_pages * page_size, num_window_pages * page_size, page_size, heads, head_dim,
            device, dtype, kv_cache_dtype,
        )  # fmt: skip
    return KVCachePool(
        num_layers=model_config.num_layers,
        num_slots=num_pages * page_size,
        num_kv_heads=heads,
        head_dim=head_dim,
        device=device,
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        v_dim=v_dim,
    )
