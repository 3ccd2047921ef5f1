"""EngineConfig: everything needed to build one Engine (one tensor-parallel rank)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any, List

from minisgl.utils.cli import MODEL, MULTI_NODE, SCHEDULING, knob, nonnegative_int, positive_int, ratio
from minisgl.utils.hf import cached_load_hf_config

if TYPE_CHECKING:  # torch-free at import: the server's command line is built from these fields
    import torch

    from minisgl.distributed import DistributedInfo
    from minisgl.models.config import ModelConfig


@dataclass(frozen=True)
class EngineConfig:
    model_path: str
    tp_info: DistributedInfo
    dtype: torch.dtype
    # auto: cuda:<rank> when a GPU is present, else cpu
    device: str = knob("auto", "auto (cuda when available, else cpu), cpu, cuda or cuda:N", group=MODEL)
    max_running_req: int = knob(
        256, "requests decoded together at most", group=SCHEDULING, flags=("--max-running-requests",), type=positive_int
    )
    attention_backend: str = knob(
        "auto",
        "attention kernels: auto (CUDA: triton, else flashinfer; CPU: cpu), cpu (the C kernels), torch (reference, CPU+CUDA), triton or flashinfer (CUDA)",
        group=MODEL,
    )
    moe_backend: str = "auto"
    cuda_graph_bs: List[int] | None = None
    cuda_graph_max_bs: int | None = knob(
        None,
        "largest decode batch captured in a CUDA graph (CUDA only)",
        group=SCHEDULING,
        type=positive_int,
        default_text="256 on a >40 GiB GPU",
    )
    # Prefill and mixed steps of up to this many tokens replay CUDA graphs (engine/mixed_graph.py);
    # None: by free memory (2048 above 40 GiB, mixed_graph.default_max_tokens), 0: they run eagerly.
    cuda_graph_max_tokens: int | None = knob(
        None,
        "largest prefill/mixed step (tokens) replayed from a CUDA graph; 0: those run eagerly (CUDA only)",
        group=SCHEDULING,
        type=nonnegative_int,
        default_text="2048 on a >40 GiB GPU",
    )
    page_size: int = knob(1, "tokens per KV page", group=SCHEDULING, type=positive_int)
    memory_ratio: float = knob(0.9, "share of free device memory the weights + KV cache may take", group=SCHEDULING, type=ratio)
    cpu_kv_cache_bytes: int = 2 << 30  # on CPU the KV pool is capped at 2 GiB by default
    # What the KV pool stores (kvcache/pool.py): "auto" (the model dtype), "fp8_e4m3" (CUDA) or
    # "int8" (CPU, per-head scales): half the bytes per token for decode attention to read.
    kv_cache_dtype: str = knob(
        "auto",
        "what the KV cache stores: auto (the model dtype), fp8_e4m3 (CUDA, unit scale) or int8 (CPU, per-head scales)",
        group=MODEL,
        choices=("auto", "fp8_e4m3", "int8"),
    )
    distributed_timeout: float = knob(
        60.0, "seconds to wait for every rank to join", group=MULTI_NODE, flags=("--dist-timeout",), type=float
    )
    distributed_port: int = 2333
    use_dummy_weight: bool = knob(
        False,
        "auto: the checkpoint's weights; dummy: random weights, for benchmarks on a folder with only config.json",
        group=MODEL,
        flags=("--load-format",),
        values={"auto": False, "dummy": True},
    )
    max_seq_len_override: int | None = knob(
        None,
        "context length: prompt + output tokens",
        group=SCHEDULING,
        flags=("--max-seq-len",),
        type=positive_int,
        default_text="the model's",
    )
    num_page_override: int | None = knob(
        None,
        "KV pages to allocate (overrides --memory-ratio)",
        group=SCHEDULING,
        flags=("--num-pages",),
        type=positive_int,
        default_text="from --memory-ratio",
    )
    # A model with sliding layers (kvcache/window.py): the window pool's pages instead of its
    # share of the budget (tests and experiments; at least one request's window pages and a step's
    # chunks). The main pool is sized as without it.
    num_window_page_override: int | None = None
    # "HOST:PORT" of rank 0's rendezvous for several machines (--dist-init-addr); None: this
    # machine, at distributed_port (the seed's distributed_addr)
    dist_init_addr: str | None = None
    # The rendezvous store at that address is served by the process that started the ranks
    # (distributed.host_rendezvous: LLM(tp=N), the server on one machine), not by rank 0
    dist_store_hosted: bool = False
    # CUDA: "fp8" runs the linear layers on the FP8 GEMM (layers/fp8.py): an FP8 checkpoint's own
    # weights and scales, a dense one's quantized per channel at load (opt-in until run on a GPU).
    # "int4" runs them on the W4A16 int4 GEMM (layers/int4.py): a dense model's weights quantized
    # at load (group-128 asymmetric); a 4-bit AWQ/GPTQ/compressed-tensors checkpoint keeps its own
    # codes on that GEMM under "int4" (opt-in until run on a GPU; "auto", "none": dequantized).
    # CPU only (see engine/cpu_decode.py): weight-only quantization of the small-batch decode
    # GEMMs ("auto" (None too): a GGUF's own codes (as "gguf", in bf16 with the C kernel), a 4-bit AWQ/GPTQ/compressed-tensors
    # checkpoint's own codes, else none; "none"; "gguf": the GGUF's own Q4_1/Q8_0 codes; "int4", "int8": rounded), and the C
    # GEMMs, attention and decode loop (False: the module path on torch ops and the torch
    # attention backend; deterministic mode sets it). A quantized checkpoint loads (dequantized)
    # whatever this says: models/checkpoint_quant.py.
    quantization: str | None = knob(
        "auto",
        "weight quantization. CPU: weight-only quantized decode GEMMs (auto: a GGUF's or a 4-bit AWQ/GPTQ/"
        "compressed-tensors checkpoint's own codes, else none; none: dense; gguf: the .gguf file's own Q4_1 codes; int4/int8: rounded). CUDA: fp8 runs the "
        "linear layers on the W8A8 FP8 GEMM (an FP8 checkpoint's own weights, a dense one's per-channel FP8 at load); int4 on the W4A16 "
        "int4 GEMM (a dense model's weights as group-128 int4 at load, a 4-bit checkpoint's own codes; auto and none dequantize those)",
        group=MODEL,
        choices=("auto", "none", "gguf", "int4", "int8", "fp8"),
    )
    cpu_fast_decode: bool = True
    # What the server does with the model (engine/pooling.py): "generate" (the LM head samples
    # tokens) or "embed" (prefill only; the final-normed hidden rows are pooled into one vector
    # per request). "auto": embed for a bare decoder checkpoint (Qwen3Model, no LM head).
    task: str = knob(
        "auto",
        "generate (chat/completions) or embed (/v1/embeddings: prefill only, pooled hidden states); "
        "auto: embed for a bare decoder checkpoint (Qwen3Model, LlamaModel, ...), else generate",
        group=MODEL,
        choices=("auto", "generate", "embed"),
    )
    pooling: str = knob(
        "auto",
        "embed task: how the final-normed hidden rows become one vector (last token, mean, cls = first); "
        "auto: the checkpoint's sentence-transformers 1_Pooling/config.json, else last",
        group=MODEL,
        choices=("auto", "last", "mean", "cls"),
    )
    normalize: bool | None = knob(
        None,
        "embed task: L2-normalize the pooled vector (or not); by default as the checkpoint's modules.json says (a Normalize "
        "module), on without sentence-transformers files",
        group=MODEL,
        negatable=True,
        default_text="from the checkpoint",
    )
    # Batch-invariant kernels (attention backend "cpu_deterministic" / "deterministic", one GEMM
    # kernel per weight or fixed-shape tiles): greedy and seeded outputs do not depend on batch
    # composition, chunking or prefix-cache state, and generation logprobs equal the prompt
    # logprobs of a re-scoring prefill (docs/ARCHITECTURE.md, "Deterministic mode").
    deterministic: bool = knob(
        False,
        "batch-invariant kernels: greedy/seeded outputs identical whatever the batch, chunking and prefix-cache state; "
        "generation logprobs equal the re-scoring prefill's prompt logprobs",
        group=SCHEDULING,
        switch=True,
    )

    @cached_property
    def hf_config(self) -> Any:
        return cached_load_hf_config(self.model_path)

    @cached_property
    def model_config(self) -> ModelConfig:
        from minisgl.models import ModelConfig

        return ModelConfig.from_hf(self.hf_config)

    @property
    def max_seq_len(self) -> int:
        window = self.model_config.context_cut_by_window
        if self.max_seq_len_override is not None:
            if window is not None and self.max_seq_len_override > window:
                raise ValueError(
                    f"--max-seq-len {self.max_seq_len_override} is longer than this model's sliding window "
                    f"(sliding_window={window}); sliding-window attention is not implemented, so its context is at most {window}"
                )
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
