"""The single-rank compute engine: model, KV pool, page table, attention backend, sampler."""

import importlib
from typing import TYPE_CHECKING, Any

# Torch-free: the server's command line is built from EngineConfig's fields without the engine;
# the rest loads on first use.
from minisgl.engine.config import EngineConfig

if TYPE_CHECKING:
    from minisgl.engine.engine import Engine, ForwardOutput
    from minisgl.engine.sample import BatchSamplingArgs, Sampler

_LAZY = {"Engine": "engine", "ForwardOutput": "engine", "BatchSamplingArgs": "sample", "Sampler": "sample"}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)


__all__ = ["Engine", "EngineConfig", "ForwardOutput", "BatchSamplingArgs", "Sampler"]
