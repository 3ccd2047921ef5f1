"""The attention backend interface.

A backend owns the per-step metadata (`prepare_metadata`, host side, before the forward) and
the per-layer compute: `store_kv` writes the step's K/V into the pool at `batch.out_loc`, and
`attend` runs attention over the pool. `forward` does both; the attention layer calls `attend`
alone when a fused kernel already normalised, rotated and stored K/V (CUDA, see
`minisgl.layers.attention`). Backends that support CUDA graphs also implement the capture/replay
hooks.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, List, Tuple

import torch

from minisgl.core import Batch, get_global_ctx
from minisgl.models.config import ModelConfig
from minisgl.utils.registry import Registry


@dataclass
class BaseAttnMetadata:
    # index of each request's last fed token in the flat batch: the rows the LM head needs
    last_indices: torch.Tensor


class BaseAttnBackend(ABC):
    # the pool formats (kvcache/pool.py KV_CACHE_DTYPES) this backend's kernels read and write
    kv_cache_dtypes: Tuple[str, ...] = ("auto",)

    def __init__(self, model_config: ModelConfig) -> None:
        ctx = get_global_ctx()
        assert ctx.kv_cache is not None and ctx.page_table is not None, "create the KV pool and page table first"
        if ctx.kv_cache.kv_cache_dtype not in self.kv_cache_dtypes:
            raise ValueError(
                f"attention backend {type(self).__name__} does not support kv_cache_dtype={ctx.kv_cache.kv_cache_dtype!r} "
                f"(it supports: {', '.join(self.kv_cache_dtypes)}); the torch backend reads every format"
            )
        self.model_config = model_config
        self.kv_cache = ctx.kv_cache
        self.page_table = ctx.page_table
        self.page_size = ctx.page_size
        self.device = ctx.page_table.device

    @abstractmethod
    def prepare_metadata(self, batch: Batch) -> None: ...

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: Batch) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hk, D] (this step's tokens). Returns [T, Hq, D]."""
        self.store_kv(k, v, layer_id, batch)
        return self.attend(q, layer_id, batch)

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: Batch) -> None:
        """Write this step's K/V (each [T, Hk, D]) into the pool slots `batch.out_loc`."""
        self.kv_cache.store_kv(k, v, batch.out_loc, layer_id)

    @abstractmethod
    def attend(self, q: torch.Tensor, layer_id: int, batch: Batch) -> torch.Tensor:
        """q: [T, Hq, D] over the pool, which already holds this step's K/V. Returns [T, Hq, D]."""

    # ---- CUDA graph hooks (decode) ------------------------------------------------------
    supports_cuda_graph: bool = False

    def init_capture_graph(self, max_seq_len: int, bs_list: List[int]) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def prepare_for_capture(self, batch: Batch) -> None:
        raise NotImplementedError

    def prepare_for_replay(self, batch: Batch) -> None:
        raise NotImplementedError

    # ---- CUDA graph hooks for steps that carry prompt tokens (engine/mixed_graph.py) -----------
    supports_mixed_graph: bool = False

    def init_mixed_graph(self, max_requests: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs of prefill steps")

    def prepare_for_mixed_capture(self, batch: Batch, num_decode: int, num_extend: int, num_tokens: int) -> None:
        raise NotImplementedError

    def prepare_for_mixed_replay(self, batch: Batch) -> None:
        raise NotImplementedError


ATTN_BACKENDS: Registry[Callable[[ModelConfig], BaseAttnBackend]] = Registry("attention backend")


@ATTN_BACKENDS.register("torch")
def _torch(cfg: ModelConfig) -> BaseAttnBackend:
    from minisgl.attention.torch_backend import TorchAttnBackend

    return TorchAttnBackend(cfg)


@ATTN_BACKENDS.register("triton")
def _triton(cfg: ModelConfig) -> BaseAttnBackend:
    from minisgl.attention.triton_backend import TritonAttnBackend

    return TritonAttnBackend(cfg)


@ATTN_BACKENDS.register("flashinfer", "fi")
def _flashinfer(cfg: ModelConfig) -> BaseAttnBackend:
    from minisgl.attention.flashinfer_backend import FlashInferAttnBackend

    return FlashInferAttnBackend(cfg)


@ATTN_BACKENDS.register("deterministic")
def _deterministic(cfg: ModelConfig) -> BaseAttnBackend:
    from minisgl.attention.deterministic_backend import DeterministicAttnBackend

    return DeterministicAttnBackend(cfg)


def resolve_attention_backend(name: str, device: torch.device) -> str:
    """'auto' -> triton on CUDA if importable, else flashinfer, else torch.

    Triton first: on the H200 it measured 1.06-1.09x FlashInfer on the offline recipe with bf16
    K/V and 1.5x with fp8 K/V (docs/PERFORMANCE.md, FlashInfer round three), and it captures
    prefill and mixed steps in CUDA graphs, which the FlashInfer backend does not."""
    if name != "auto":
        ATTN_BACKENDS.get(name)  # validates
        return name
    if device.type != "cuda":
        return "torch"
    for candidate in ("triton", "flashinfer"):
        try:
            importlib.import_module(candidate)
            return candidate
        except ImportError:
            continue
    return "torch"


def create_attention_backend(name: str, model_config: ModelConfig) -> BaseAttnBackend:
    device = get_global_ctx().page_table.device  # type: ignore[union-attr]
    return ATTN_BACKENDS.get(resolve_attention_backend(name, device))(model_config)
