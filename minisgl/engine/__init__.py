"""The single-rank compute engine: model, KV pool, page table, attention backend, sampler."""

from minisgl.engine.config import EngineConfig
from minisgl.engine.engine import Engine, ForwardOutput
from minisgl.engine.sample import BatchSamplingArgs, Sampler

__all__ = ["Engine", "EngineConfig", "ForwardOutput", "BatchSamplingArgs", "Sampler"]
