"""EngineConfig: everything needed to build one Engine (one tensor-parallel rank)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, List

import torch

from minisgl.distributed import DistributedInfo
from minisgl.models.config import ModelConfig
from minisgl.utils.hf import cached_load_hf_config


@dataclass(frozen=True)
class EngineConfig:
    model_path: str
    tp_info: DistributedInfo
    dtype: torch.dtype
    device: str = "auto"  # auto: cuda:<rank> when a GPU is present, else cpu
    max_running_req: int = 256
    attention_backend: str = "auto"
    moe_backend: str = "auto"
    cuda_graph_bs: List[int] | None = None
    cuda_graph_max_bs: int | None = None
    # Prefill and mixed steps of up to this many tokens replay CUDA graphs (engine/mixed_graph.py);
    # None: by free memory (2048 above 40 GiB, mixed_graph.default_max_tokens), 0: they run eagerly.
    cuda_graph_max_tokens: int | None = None
    page_size: int = 1
    memory_ratio: float = 0.9
    cpu_kv_cache_bytes: int = 2 << 30  # on CPU the KV pool is capped at 2 GiB by default
    # What the KV pool stores (kvcache/pool.py): "auto" (the model dtype), "fp8_e4m3" (CUDA) or
    # "int8" (CPU, per-head scales): half the bytes per token for decode attention to read.
    kv_cache_dtype: str = "auto"
    distributed_timeout: float = 60.0
    distributed_port: int = 2333
    use_dummy_weight: bool = False
    max_seq_len_override: int | None = None
    num_page_override: int | None = None
    # "HOST:PORT" of rank 0's rendezvous for several machines (--dist-init-addr); None: this
    # machine, at distributed_port (the seed's distributed_addr)
    dist_init_addr: str | None = None
    # The rendezvous store at that address is served by the process that started the ranks
    # (distributed.host_rendezvous: LLM(tp=N), the server on one machine), not by rank 0
    dist_store_hosted: bool = False
    # CPU only (see engine/cpu_decode.py): weight-only quantization of the small-batch decode
    # GEMMs (None, "gguf": the GGUF's own Q4_1/Q8_0 codes, "int4", "int8"), and the flat
    # decode step on fused C kernels (False: the module path, as on CUDA).
    quantization: str | None = None
    cpu_fast_decode: bool = True
    # Batch-invariant kernels (attention backend "deterministic", fixed-shape GEMMs): greedy and
    # seeded outputs do not depend on batch composition, chunking or prefix-cache state.
    deterministic: bool = False

    @cached_property
    def hf_config(self) -> Any:
        return cached_load_hf_config(self.model_path)

    @cached_property
    def model_config(self) -> ModelConfig:
        from minisgl.models import ModelConfig

        return ModelConfig.from_hf(self.hf_config)

    @property
    def max_seq_len(self) -> int:
        if self.max_seq_len_override is not None:
            return self.max_seq_len_override
        return self.model_config.rotary_config.max_position

    @property
    def max_forward_len(self) -> int:
        return self.max_seq_len

    @property
    def distributed_addr(self) -> str:
        if self.dist_init_addr is not None:
            return f"tcp://{self.dist_init_addr}"
        return f"tcp://127.0.0.1:{self.distributed_port}"
