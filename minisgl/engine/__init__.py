"""The single-rank compute engine: model, KV pool, page table, attention backend, sampler."""

from typing import TYPE_CHECKING

# Torch-free: the server's command line is built from EngineConfig's fields without the engine;
# the rest loads on first use.
from minisgl.engine.config import EngineConfig
from minisgl.utils.misc import lazy_exports

if TYPE_CHECKING:
    from minisgl.engine.engine import Engine, ForwardOutput
    from minisgl.engine.sample import BatchSamplingArgs, Sampler

__getattr__ = lazy_exports(__name__, {"Engine": "engine", "ForwardOutput": "engine", "BatchSamplingArgs": "sample", "Sampler": "sample"})


__all__ = ["Engine", "EngineConfig", "ForwardOutput", "BatchSamplingArgs", "Sampler"]
