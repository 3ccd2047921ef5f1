"""The attention backend interface.

A backend owns the per-step metadata (`prepare_metadata`, host side, before the forward) and
the per-layer compute: `store_kv` writes the step's K/V into the pool at `batch.out_loc`, and
`attend` runs attention over the pool. `forward` does both; the attention layer calls `attend`
alone when a fused kernel already normalised, rotated and stored K/V (CUDA, see
`minisgl.layers.attention`), and first offers the backend the whole step from the qkv rows,
`forward_qkv` (the CPU backend's C kernels take it). A backend declares what more it can do in
one capability enum, `caps` (`AttnCap`): CUDA graphs of decode steps, of prefill / mixed steps;
each capability comes with the hooks the graph runners call. The registry that creates backends by name lives in
attention/registry.py (so this module imports no backend).
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, List, Protocol, Tuple

import torch

from minisgl.core import Batch, get_global_ctx
from minisgl.models.config import ModelConfig


@dataclass
class BaseAttnMetadata:
    # index of each request's last fed token in the flat batch: the rows the LM head needs
    last_indices: torch.Tensor


class AttnCap(enum.Flag):
    NONE = 0
    DECODE_GRAPH = enum.auto()  # decode steps replay CUDA graphs: DecodeGraphHooks
    MIXED_GRAPH = enum.auto()  # prefill / mixed steps replay CUDA graphs: MixedGraphHooks


class BaseAttnBackend(ABC):
    # the pool formats (kvcache/pool.py KV_CACHE_DTYPES) this backend's kernels read and write
    kv_cache_dtypes: Tuple[str, ...] = ("auto",)
    # the attention options beyond plain causal softmax (ModelConfig.attention_features: a
    # per-layer sliding_window, attn_logit_softcapping, query_pre_attn_scalar, attention_sinks,
    # latent_attention: DeepSeek's MLA over a latent pool, V a view of K) this backend
    # computes; a model that needs another is refused at init, by the option's name
    attention_features: Tuple[str, ...] = ()

    def __init__(self, model_config: ModelConfig) -> None:
        ctx = get_global_ctx()
        assert ctx.kv_cache is not None and ctx.page_table is not None, "create the KV pool and page table first"
        if ctx.kv_cache.kv_cache_dtype not in self.kv_cache_dtypes:
            raise ValueError(
                f"attention backend {type(self).__name__} does not support kv_cache_dtype={ctx.kv_cache.kv_cache_dtype!r} "
                f"(it supports: {', '.join(self.kv_cache_dtypes)}); the torch backend reads every format"
            )
        missing = [f for f in model_config.attention_features() if f not in self.attention_features]
        if missing:
            raise ValueError(
                f"attention backend {type(self).__name__} does not implement {', '.join(missing)} "
                f"({model_config.architecture}); the torch backend implements every one"
            )
        self.model_config = model_config
        self.kv_cache = ctx.kv_cache
        self.page_table = ctx.page_table
        self.page_size = ctx.page_size
        self.device = ctx.page_table.device

    @abstractmethod
    def prepare_metadata(self, batch: Batch) -> None: ...

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, layer_id: int, batch: Batch,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """q: [T, Hq, D]; k, v: [T, Hk, D] (this step's tokens). Returns [T, Hq, D].
        Latent attention ("latent_attention", a latent pool: kvcache/pool.py): v None, k the
        [T, 1, D] latent rows, V their first `kv_cache.v_dim` values; returns [T, Hq, v_dim]."""
        self.store_kv(k, v, layer_id, batch)
        return self.attend(q, layer_id, batch, sinks)

    def store_kv(self, k: torch.Tensor, v: torch.Tensor | None, layer_id: int, batch: Batch) -> None:
        """Write this step's K/V (each [T, Hk, D]; a latent pool: K alone) into the pool slots `batch.out_loc`."""
        self.kv_cache.store_kv(k, v, batch.out_loc, layer_id)

    @abstractmethod
    def attend(self, q: torch.Tensor, layer_id: int, batch: Batch, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q: [T, Hq, D] over the pool, which already holds this step's K/V. Returns [T, Hq, D]
        ([T, Hq, v_dim] over a latent pool). `sinks` [Hq] (the model dtype): the layer's attention
        sinks, given only to a backend that lists "attention_sinks" in its `attention_features`."""

    def forward_qkv(self, qkv: torch.Tensor, layer: Any, batch: Batch) -> torch.Tensor | None:
        """The attention layer's whole step from its projection's qkv rows [T, (Hq + 2 Hk) * D]:
        q/k norm, rotary, K/V store and attention, [T, Hq * D]; None (the default) where this
        backend leaves the prologue to the layer, which then calls `forward`."""
        return None

    # what this backend can do beyond the eager forward; each capability comes with its hooks
    caps: AttnCap = AttnCap.NONE


class DecodeGraphHooks(Protocol):
    """A backend with AttnCap.DECODE_GRAPH (engine/graph.py calls these)."""

    def init_capture_graph(self, max_seq_len: int, bs_list: List[int]) -> None: ...

    def prepare_for_capture(self, batch: Batch) -> None: ...

    def prepare_for_replay(self, batch: Batch) -> None: ...


class MixedGraphHooks(Protocol):
    """A backend with AttnCap.MIXED_GRAPH (engine/mixed_graph.py calls these)."""

    def init_mixed_graph(self, max_requests: int) -> None: ...

    def prepare_for_mixed_capture(self, batch: Batch, num_decode: int, num_extend: int, num_tokens: int) -> None: ...

    def prepare_for_mixed_replay(self, batch: Batch) -> None: ...
