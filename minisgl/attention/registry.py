"""Attention backends by name: the registry, 'auto' resolution and creation.

Its own module so that base.py imports no backend: every backend imports base.py, and this
module imports each backend only when it is created.
"""

from __future__ import annotations

import importlib
from typing import Callable, Sequence

import torch

from minisgl.attention.base import BaseAttnBackend
from minisgl.core import get_global_ctx
from minisgl.models.config import ModelConfig
from minisgl.utils.registry import Registry

ATTN_BACKENDS: Registry[Callable[[ModelConfig], BaseAttnBackend]] = Registry("attention backend")


@ATTN_BACKENDS.register("torch")
def _torch(cfg: ModelConfig) -> BaseAttnBackend:
    from minisgl.attention.torch_backend import TorchAttnBackend

    return TorchAttnBackend(cfg)


@ATTN_BACKENDS.register("cpu")
def _cpu(cfg: ModelConfig) -> BaseAttnBackend:
    from minisgl.kernel.cpu.attention import CpuAttnBackend

    return CpuAttnBackend(cfg)


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


@ATTN_BACKENDS.register("cpu_deterministic")
def _cpu_deterministic(cfg: ModelConfig) -> BaseAttnBackend:
    from minisgl.kernel.cpu.attention import CpuDeterministicAttnBackend

    return CpuDeterministicAttnBackend(cfg)


def resolve_attention_backend(name: str, device: torch.device, features: Sequence[str] = ()) -> str:
    """'auto' -> triton on CUDA if importable, else flashinfer (unless the model needs attention
    `features` it lacks: sliding windows, soft-capping), else torch; cpu on a CPU (the paged C
    kernels, itself the torch backend where they do not apply); torch for latent attention
    (DeepSeek's MLA) on any device.

    Triton first: it was the faster of the two on the H200's offline recipe, with bf16 and even
    more with fp8 K/V (the figures are in docs/PERFORMANCE.md), and it captures prefill and mixed
    steps in CUDA graphs, which the FlashInfer backend does not."""
    if name != "auto":
        ATTN_BACKENDS.get(name)  # validates
        return name
    if "latent_attention" in features:
        return "torch"  # the one backend with MLA over a latent pool (no C, Triton or FlashInfer kernel for it)
    if device.type != "cuda":
        return "cpu"
    for candidate in ("triton", "flashinfer"):
        if candidate == "flashinfer" and any(f != "query_pre_attn_scalar" for f in features):
            continue  # (FlashInferAttnBackend.attention_features)
        try:
            importlib.import_module(candidate)
            return candidate
        except ImportError:
            continue
    return "torch"


def create_attention_backend(name: str, model_config: ModelConfig) -> BaseAttnBackend:
    device = get_global_ctx().page_table.device  # type: ignore[union-attr]
    return ATTN_BACKENDS.get(resolve_attention_backend(name, device, model_config.attention_features()))(model_config)
