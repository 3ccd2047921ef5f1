"""Engine: one tensor-parallel rank's model, KV pool, page table, backends and sampler.

Init order matters: TP info and device -> stream and global Context -> communication (tp > 1)
-> measure free memory -> model on meta, load weights -> KV pool (+1 dummy page) -> page table
(+1 dummy row) -> attention backend (reads the pool) -> MoE backend -> sampler -> dummy request
-> GraphRunner (captures last: it runs the model).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
from typing import Any, List, NamedTuple, Tuple

import torch

from minisgl.attention.registry import create_attention_backend, resolve_attention_backend
from minisgl.core import Batch, Context, Req, SamplingParams, clear_global_ctx, global_ctx, set_global_ctx
from minisgl.distributed import all_reduce_min_int, broadcast, destroy_process_group, init_process_group, set_tp_info
from minisgl.distributed.info import clear_tp_info
from minisgl.engine.config import EngineConfig
from minisgl.engine.graph import GraphRunner
from minisgl.engine.mixed_graph import default_max_tokens
from minisgl.engine.pooling import Pooler, PoolingSpec, read_pooling_spec
from minisgl.engine.runners import ModuleRunner, StepRunner, pick_runner
from minisgl.engine.sample import BatchSamplingArgs, Sampler
from minisgl.engine.spec_verify import verify_tokens
from minisgl.kernel.fused import use_fused_on
from minisgl.kernel.skinny import SkinnyPlan
from minisgl.kernel.skinny import build_plan as build_skinny_plan
from minisgl.kvcache import create_kvcache_pool
from minisgl.kvcache.pool import check_kv_cache_dtype
from minisgl.kvcache.window import DECODE_AHEAD_TOKENS, kv_page_sizing
from minisgl.layers.batch_invariant import BatchInvariantMode
from minisgl.layers.fp8 import keeps_fp8
from minisgl.layers.int4 import keeps_int4
from minisgl.layers.rotary import rope_tables
from minisgl.models import create_model
from minisgl.models.weight import dummy_weights, load_weights, quantize_linears_fp8, quantize_linears_int4
from minisgl.moe.base import BaseMoeBackend, MoeCap
from minisgl.moe.registry import create_moe_backend
from minisgl.utils.device import create_event, create_stream, is_cuda, set_stream, stream_context, synchronize
from minisgl.utils.hf import resolve_model_path
from minisgl.utils.logger import init_logger
from minisgl.utils.misc import align_up, gib
from minisgl.utils.torch_utils import torch_dtype

logger = init_logger(__name__)


class ForwardOutput(NamedTuple):
    next_tokens_gpu: torch.Tensor  # on the engine's device: written back to the token pool
    next_tokens_cpu: torch.Tensor  # non-blocking host copy: wait on copy_done_event first
    copy_done_event: Any
    # (chosen-token logprob [B], top-k logprobs [B, k], top-k ids [B, k]) on the host, when asked
    logprobs: Tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # the same for the prompt tokens of batch.prompt_logprob_rows (prefill with prompt logprobs)
    prompt_logprobs: Tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # the embed task: [B, hidden] float32 pooled vectors on the host (a row whose prompt
    # continues in a later chunk is zeros); next_tokens_* are then zeros, sampled from nothing
    embeddings: torch.Tensor | None = None
    # a verify step: the target's token at each of batch.prompt_logprob_rows (engine/spec_verify.py), on the host
    verify_tokens: torch.Tensor | None = None
    # ... and where a row with drafts returns logprobs, `_token_logprobs` at each of those positions
    verify_logprobs: Tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


def _align_up_32(x: int) -> int:
    return align_up(x, 32)


def _pick_device(config: EngineConfig) -> torch.device:
    if config.device == "auto":
        if torch.cuda.is_available():
            return torch.device(f"cuda:{config.tp_info.rank % torch.cuda.device_count()}")
        return torch.device("cpu")
    device = torch.device(config.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {config.device!r} was asked for but CUDA is not available")
    if device.type == "cuda" and device.index is None:  # rank r of a node takes its r-th GPU
        device = torch.device(f"cuda:{config.tp_info.rank % torch.cuda.device_count()}")
    elif device.type == "cuda" and config.tp_info.size > 1:
        raise ValueError(
            f"device {config.device!r} names one GPU, but tp={config.tp_info.size} needs one GPU per rank: "
            "pass device='cuda' (or 'auto') and rank r takes cuda:r"
        )
    return device


def check_tp_size(model_config: Any, tp: int) -> None:
    """Raise ValueError unless the model can be split over `tp` ranks (before any rank starts)."""
    if tp == 1:
        return
    sizes = {"num_attention_heads": model_config.num_qo_heads, "intermediate_size": model_config.intermediate_size}
    if model_config.is_moe:
        sizes["moe_intermediate_size"] = model_config.moe_intermediate_size
    bad = [f"{name}={n}" for name, n in sizes.items() if n % tp != 0]
    kv = model_config.num_kv_heads
    if (kv % tp != 0) if kv >= tp else (tp % kv != 0):
        bad.append(f"num_key_value_heads={kv}")
    if bad:
        ok = [d for d in range(1, model_config.num_qo_heads + 1) if all(
            n % d == 0 for n in sizes.values()) and ((kv % d == 0) if kv >= d else (d % kv == 0))]  # fmt: skip
        raise ValueError(
            f"tensor parallelism tp={tp} cannot split this model: {', '.join(bad)} not divisible by {tp} "
            f"(with fewer KV heads than ranks, tp must be a multiple of them); tp values that fit: {ok}"
        )


def _adjust_config(config: EngineConfig) -> EngineConfig:
    """Validate and resolve 'auto' choices so `engine.config` says what actually runs."""
    check_tp_size(config.model_config, config.tp_info.size)
    if config.page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {config.page_size}")
    if config.max_running_req < 1:
        raise ValueError(f"max_running_req must be >= 1, got {config.max_running_req}")
    if not 0.0 < config.memory_ratio <= 1.0:
        raise ValueError(f"memory_ratio must be in (0, 1], got {config.memory_ratio}")
    device = _pick_device(config)
    check_kv_cache_dtype(config.kv_cache_dtype, device)
    if config.quantization == "fp8" and not is_cuda(device):
        raise ValueError(
            f"quantization='fp8' (online FP8 W8A8 weights) needs a CUDA device, got {device}; on the CPU use quantization='int8' or 'int4'"
        )
    if config.quantization == "int4" and is_cuda(device) and importlib.util.find_spec("triton") is None:
        raise ValueError("quantization='int4' on CUDA (W4A16 weights) needs Triton (its int4 GEMM), which is not installed")
    if config.deterministic:
        if config.attention_backend not in ("auto", "deterministic", "cpu_deterministic"):
            raise ValueError(
                f"deterministic mode runs its own batch-invariant attention; attention_backend={config.attention_backend!r} "
                "cannot be combined with it (leave it 'auto')"
            )
        if config.quantization not in (None, "auto", "none"):
            raise ValueError(
                f"deterministic mode does not support quantization={config.quantization!r} (its GEMMs are not batch-invariant)"
            )
        if config.kv_cache_dtype != "auto":
            raise ValueError(f"deterministic mode needs the model-dtype KV cache, got kv_cache_dtype={config.kv_cache_dtype!r}")
        # Two ranks' partial sums add to the same bits in either order (IEEE addition commutes),
        # so a 2-rank all-reduce is batch-invariant; three or more associate by chunk, and the
        # chunks move with the number of rows.
        if config.tp_info.size > 2:
            raise ValueError(
                f"deterministic mode supports tp <= 2, got tp={config.tp_info.size} (an all-reduce over more ranks "
                "associates its sums by chunk, which changes with the batch)"
            )
        # on a CPU with the C kernels: the paged attention kernel for every row and the C GEMMs
        # fixed to one kernel per weight (engine/cpu_decode.py); else the torch walk and tiles
        cpu_kernels = device.type == "cpu" and config.cpu_fast_decode
        config = dataclasses.replace(config, attention_backend="cpu_deterministic" if cpu_kernels else "deterministic")
    backend = resolve_attention_backend(config.attention_backend, device, config.model_config.attention_features())
    if backend == "cpu" and config.attention_backend == "auto" and not config.cpu_fast_decode:
        backend = "torch"  # the module path on torch ops alone, as without the C kernels
    max_bs = config.cuda_graph_max_bs
    if max_bs is not None:
        max_bs = min(max_bs, config.max_running_req)
    config = dataclasses.replace(config, attention_backend=backend, cuda_graph_max_bs=max_bs)
    return _resolve_task(config)


def _resolve_task(config: EngineConfig) -> EngineConfig:
    """task auto -> embed for a bare decoder, else generate; for embed, the pooling and
    normalization the checkpoint declares unless overridden, and no CUDA graphs (every step is a
    prefill that returns hidden rows, which the graphs do not)."""
    bare = config.model_config.is_bare_decoder
    task = config.task if config.task != "auto" else ("embed" if bare else "generate")
    if task not in ("generate", "embed"):
        raise ValueError(f"task must be auto, generate or embed, got {config.task!r}")
    if task == "generate" and bare:
        raise ValueError(f"{config.model_config.architecture} is a bare decoder without an LM head: it can only embed (--task embed)")
    if task == "generate":
        return dataclasses.replace(config, task=task)
    spec = read_pooling_spec(resolve_model_path(config.model_path), config.hf_config, config.pooling, config.normalize)
    return dataclasses.replace(config, task=task, pooling=spec.method, normalize=spec.normalize, cuda_graph_bs=[])


def _set_cpu_threads(tp_size: int) -> None:
    # Small decode GEMMs slow down dozens of times when threads oversubscribe the cores.
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(max(1, cores // tp_size))


def _host_available_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def _token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logprobs of the model's raw distribution (before penalties and temperature), host copies."""
    chosen, top_vals, top_ids = _logprobs_on_device(logits, tokens, k)
    return chosen.to("cpu", non_blocking=True), top_vals.to("cpu", non_blocking=True), top_ids.to("cpu", non_blocking=True)


def _logprobs_on_device(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(1, tokens.long().unsqueeze(1)).squeeze(1)
    top_vals, top_ids = logp.topk(max(k, 1), dim=-1)
    return chosen, top_vals[:, :k], top_ids[:, :k]


# Prompt rows projected per LM-head call: [rows, vocab] float32 is the peak (256 x 152k = 156 MB),
# not [prompt, vocab] (a 2,000-token prompt over a 49k vocabulary was 0.9 GB at once).
PROMPT_LOGPROB_ROWS = 256


def _prompt_logprobs(lm_head: Any, hidden: torch.Tensor, targets: torch.Tensor, k: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`_token_logprobs` of the prompt rows whose final hidden states are `hidden`, with the LM
    head, the float32 log-softmax and the top-k run over chunks of rows (all per-row ops, so the
    values are those of one call over every row); the results are gathered on the device and
    copied to the host once."""
    parts = [
        _logprobs_on_device(lm_head(hidden[s : s + PROMPT_LOGPROB_ROWS]), targets[s : s + PROMPT_LOGPROB_ROWS], k)
        for s in range(0, hidden.shape[0], PROMPT_LOGPROB_ROWS)
    ]
    chosen, top_vals, top_ids = (torch.cat(ts) if len(ts) > 1 else ts[0] for ts in zip(*parts))
    return chosen.to("cpu", non_blocking=True), top_vals.to("cpu", non_blocking=True), top_ids.to("cpu", non_blocking=True)


WARMUP_PREFILL_TOKENS = 16


class MemoryReserve(NamedTuple):
    """What a second model in the process (the draft model of speculative decoding) takes from
    this engine's memory budget: its weights, and per KV pool slot its own KV bytes (its pool
    gets as many pages as this one's, so this pool's pages are sized for both)."""

    weight_bytes: int
    kv_bytes_per_slot: int


class Engine:
    def __init__(self, config: EngineConfig, *, reserve: MemoryReserve | None = None, draft_of: Engine | None = None) -> None:
        """`reserve`: a draft model's share of the budget (see `MemoryReserve`). `draft_of`: this
        engine is that engine's draft model (tp 1): it shares its stream and lives under its own
        Context, made global only around its own build and forwards (`activated`)."""
        self.draft_of = draft_of
        self.reserve = reserve
        if draft_of is None:
            set_tp_info(rank=config.tp_info.rank, size=config.tp_info.size)
        self.config = config = _adjust_config(config)
        self.device = _pick_device(config)
        if is_cuda(self.device):
            torch.cuda.set_device(self.device)
        elif draft_of is None:
            _set_cpu_threads(config.tp_info.size)
        torch.manual_seed(42)
        # a draft shares the target's stream: its forwards and the verify step are ordered by it
        self.stream: Any = create_stream(self.device) if draft_of is None else draft_of.stream
        set_stream(self.stream)
        self.dtype = config.dtype
        self.ctx = Context(config.page_size)
        if draft_of is None:
            set_global_ctx(self.ctx)
        try:
            with self.activated():
                self._build(config)
        except BaseException:
            self.shutdown()
            raise

    def activated(self) -> Any:
        """This engine's Context as the global one (a no-op for the process's own engine, whose
        Context is global already; a draft engine's forwards run inside it)."""
        return global_ctx(self.ctx) if self.draft_of is not None else contextlib.nullcontext()

    def logits(self, batch: Batch) -> torch.Tensor:
        """The logits of each request's last fed token, nothing sampled and no request advanced
        (the draft model's steps: the proposer picks its tokens). Call it inside `activated()`
        with the batch's inputs and attention metadata prepared."""
        with torch.inference_mode(), self.ctx.forward_batch(batch):
            return pick_runner(self.runners, batch).run(batch)[: batch.size]

    def _build(self, config: EngineConfig) -> None:
        self.tp_cpu_group = self._init_communication(config)
        init_free_memory = self._sync_get_memory()[1]
        logger.info_rank0(f"Free memory before loading model: {gib(init_free_memory)}")

        # ---- model: an empty shell on meta, then the weights are installed into it
        model_config = config.model_config
        with rope_tables(self.device), torch.device("meta"), torch_dtype(config.dtype):
            self.model = create_model(model_config)
        self.model.load_state_dict(self._load_weight_state_dict(config))
        if config.quantization == "fp8":  # online FP8: the dense linear weights become per-channel FP8
            quantize_linears_fp8(self.model)
        if config.quantization == "int4" and is_cuda(self.device):  # online int4 (the CPU's int4 is its decode GEMMs')
            quantize_linears_int4(self.model, self.dtype)
        self.model.eval()

        # ---- KV pool: what memory remains
        self.num_pages, self.num_window_pages = self._determine_num_pages(init_free_memory, config)
        num_tokens = self.num_pages * config.page_size
        self.ctx.kv_cache = self.kv_cache = create_kvcache_pool(
            model_config=model_config,
            num_pages=self.num_pages + 1,  # the extra page is the dummy request's
            page_size=config.page_size,
            device=self.device,
            dtype=self.dtype,
            kv_cache_dtype=config.kv_cache_dtype,
            # (the window pool's last page is the dummy page's twin)
            num_window_pages=None if self.num_window_pages is None else self.num_window_pages + 1,
        )

        # ---- page table: a row per request, each entry the pool slot of that token's KV
        self.max_seq_len = min(config.max_seq_len, num_tokens)
        aligned_max_seq_len = _align_up_32(self.max_seq_len)
        self.ctx.page_table = self.page_table = torch.zeros(
            (config.max_running_req + 1, aligned_max_seq_len),  # last row: the dummy request
            dtype=torch.int32,
            device=self.device,
        )

        # ---- attention backend, MoE backend, sampler
        self.ctx.attn_backend = self.attn_backend = create_attention_backend(config.attention_backend, model_config)
        self.moe_backend: BaseMoeBackend | None = None
        if model_config.is_moe:
            self.ctx.moe_backend = self.moe_backend = create_moe_backend(config.moe_backend, self.device, model_config.moe_features())
        self.sampler = Sampler(self.device, model_config.vocab_size)
        self.pooling_spec: PoolingSpec | None = None
        self.pooler: Pooler | None = None
        if config.task == "embed":  # (pooling and normalize are resolved: this re-read adds the Matryoshka sizes)
            self.pooling_spec = read_pooling_spec(resolve_model_path(config.model_path), config.hf_config, config.pooling, config.normalize)
            self.pooler = Pooler(self.pooling_spec, config.max_running_req + 1, model_config.hidden_size, self.device)
        self.sampler.warmup(config.max_running_req, self.dtype)

        # ---- dummy request and CUDA graphs
        self.dummy_req = Req(
            input_ids=torch.tensor([0], dtype=torch.int32),
            table_idx=config.max_running_req,
            cached_len=0,
            output_len=1,
            uid=-1,
            sampling_params=None,  # type: ignore[arg-type]
            cache_handle=None,
        )
        self.page_table[self.dummy_req.table_idx].fill_(num_tokens)  # the dummy page
        self.skinny_plan = self._build_skinny_plan(config)
        # deterministic mode on CUDA: the decode graphs capture the batch-invariant GEMMs
        # (layers/batch_invariant.py), as the module path runs them (gemm_tiles, below)
        capture_mode = BatchInvariantMode() if config.deterministic and is_cuda(self.device) else contextlib.nullcontext()
        with capture_mode:
            self.graph_runner = GraphRunner(
                stream=self.stream,
                device=self.device,
                model=self.model,
                attn_backend=self.attn_backend,
                cuda_graph_bs=config.cuda_graph_bs,
                cuda_graph_max_bs=config.cuda_graph_max_bs,
                free_memory=init_free_memory,
                max_seq_len=aligned_max_seq_len,
                vocab_size=model_config.vocab_size,
                dummy_req=self.dummy_req,
                max_graph_tokens=self._max_graph_tokens(config, init_free_memory),
                moe_backend=self.moe_backend,
            )
        self.cpu_runner = self._build_cpu_runner(config)
        # deterministic mode: F.linear as batch-invariant GEMMs, unless every GEMM runs a
        # batch-invariant C kernel (and no MoE layer calls F.linear itself)
        self.gemm_tiles = config.deterministic and (model_config.is_moe or not self._cpu_gemms_invariant())
        # the step runners, tried in this order (engine/runners.py); the module path takes the rest
        self.runners: List[StepRunner] = [self.graph_runner]
        if self.cpu_runner is not None:
            self.runners.append(self.cpu_runner)
        self.runners.append(ModuleRunner(self.model, gemm_tiles=self.gemm_tiles))
        self._warmup_prefill()

    # ---- init helpers ------------------------------------------------------------------------
    def _warmup_prefill(self, num_tokens: int = WARMUP_PREFILL_TOKENS) -> None:
        """Run one small prefill on the dummy request's row, so the prefill path's kernels (Triton
        extend attention and friends) are compiled, or loaded from Triton's cache, now: otherwise
        a server's first request pays about a second of JIT on a fresh machine. (With prefill-step
        graphs it replays the smallest one; their capture ran the same kernels eagerly already.)
        Every K/V it writes lands on the dummy page; nothing else in the pool or the page table
        changes."""
        n = min(num_tokens, self.max_seq_len)
        row = self.dummy_req.table_idx
        req = Req(
            input_ids=torch.zeros(n, dtype=torch.int32),
            table_idx=row,
            cached_len=0,
            output_len=1,
            uid=-2,
            sampling_params=SamplingParams(temperature=0.0),
            cache_handle=None,
        )
        batch = Batch(reqs=[req], phase="prefill")
        self.graph_runner.pad_batch(batch)
        with stream_context(self.stream):
            batch.input_ids = torch.zeros(n, dtype=torch.int32, device=self.device)
            batch.positions = torch.arange(n, dtype=torch.int32, device=self.device)
            batch.out_loc = self.page_table[row, :n]  # the dummy slot, n times
            self.attn_backend.prepare_metadata(batch)
            self.forward_batch(batch, self.sampler.prepare(batch))
        synchronize(self.device)

    def _max_graph_tokens(self, config: EngineConfig, free_memory: int) -> int:
        """Tokens of the largest prefill/mixed step that replays a graph (0: none). One rank, and
        no MoE backend that lacks it (none declares it yet: a MoE layer's routing and the
        collectives of tp > 1 are not checked under these graphs)."""
        moe_ok = self.moe_backend is None or MoeCap.MIXED_GRAPH in self.moe_backend.caps
        if not moe_ok or config.tp_info.size > 1 or config.deterministic:
            return 0
        if config.cuda_graph_max_tokens is not None:
            return config.cuda_graph_max_tokens
        return default_max_tokens(free_memory)

    def _build_skinny_plan(self, config: EngineConfig) -> SkinnyPlan | None:
        """CUDA, one rank, Triton available: time the skinny-M GEMV kernels against cuBLAS for
        this model's projection shapes at the decode batch sizes, before the graphs capture them,
        and bind the plan to the model's projection ops (kernel/skinny.py)."""
        # (deterministic mode: every GEMM must stay a fixed-shape tile, see layers/batch_invariant.py)
        ok = is_cuda(self.device) and config.tp_info.size == 1 and not config.deterministic
        if not (ok and use_fused_on(self.device)):
            return None
        max_m = min(config.cuda_graph_max_bs or config.max_running_req, config.max_running_req)
        with torch.inference_mode():
            plan = build_skinny_plan(self.model, max_m, self.stream)
        if plan is not None:
            plan.bind(self.model)
        return plan

    @property
    def fast_step_tokens(self) -> int | None:
        """The most tokens a step may feed and run on the CPU decode loop (None: no loop, or a
        CUDA engine, whose eager and graph steps take any size)."""
        return self.cpu_runner.rows if self.cpu_runner is not None else None

    def _build_cpu_runner(self, config: EngineConfig) -> Any:
        """CPU: bind the model's GEMMs to the C kernels; the whole-step C loop where it applies."""
        from minisgl.engine.cpu_decode import build_cpu_runner

        return build_cpu_runner(self.model, self.kv_cache, self.device, config)

    def _cpu_gemms_invariant(self) -> bool:
        if self.device.type != "cpu":
            return False
        from minisgl.engine.cpu_decode import gemms_batch_invariant

        return gemms_batch_invariant(self.model)

    def _init_communication(self, config: EngineConfig) -> Any:
        """Join the other ranks (tp > 1 only): the device group (NCCL/gloo) for the layers'
        collectives and a gloo CPU group for host-side agreement, which is returned."""
        if config.tp_info.size == 1:
            return None
        return init_process_group(
            config.distributed_addr, config.tp_info.rank, config.tp_info.size, self.device, config.distributed_timeout,
            store_hosted=config.dist_store_hosted,
        )  # fmt: skip

    def _sync_get_memory(self) -> Tuple[int, int]:
        """(total, free) bytes on this device; `free` is the minimum over TP ranks, so every
        rank sizes the same KV pool and takes the same scheduling decisions."""
        if is_cuda(self.device):
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info(self.device)
        else:
            free, total = _host_available_memory(), os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        if self.tp_cpu_group is not None:
            free = all_reduce_min_int(free)
        return total, free

    def _load_weight_state_dict(self, config: EngineConfig) -> dict[str, torch.Tensor]:
        if config.use_dummy_weight:
            return dummy_weights(self.model, self.device, self.dtype)
        keep_fp8 = keeps_fp8(self.device, config.deterministic, config.quantization)  # CUDA + fp8: FP8 stays FP8
        keep_int4 = keeps_int4(self.device, config.deterministic, config.quantization)  # CUDA: 4-bit codes stay int4
        return load_weights(self.model, resolve_model_path(config.model_path), self.device, self.dtype, keep_fp8=keep_fp8,
                            keep_int4=keep_int4)  # fmt: skip

    def _determine_num_pages(self, old_free_memory: int, config: EngineConfig) -> Tuple[int, int | None]:
        """(main pages, window pages: None unless the model has sliding layers, kvcache/window.py)."""
        mc = config.model_config
        # (a scheduler's config bounds a step's prompt tokens and drafts; a bare engine's steps are
        # the caller's: SchedulerConfig's defaults)
        step_tokens = getattr(config, "max_extend_tokens", 8192)
        ahead = DECODE_AHEAD_TOKENS + getattr(config, "speculative_num_tokens", 4)
        sizing = kv_page_sizing(mc, config.kv_cache_dtype, self.dtype, config.tp_info.size, config.page_size,
                                config.max_running_req, step_tokens, ahead, config.max_seq_len)  # fmt: skip
        if self.reserve is not None:  # a draft model's pool holds as many pages: each main page costs both
            extra = self.reserve.kv_bytes_per_slot * config.page_size
            sizing = dataclasses.replace(sizing, page_bytes=sizing.page_bytes + extra, main_page_bytes=sizing.main_page_bytes + extra)
        num_pages = config.num_page_override
        window_pages = None
        if num_pages is None:
            new_free_memory = self._sync_get_memory()[1]
            model_memory = old_free_memory - new_free_memory
            available = int(config.memory_ratio * old_free_memory) - model_memory
            if self.reserve is not None:  # the draft's weights, loaded after this pool is made
                available -= self.reserve.weight_bytes
            if not is_cuda(self.device):
                available = min(available, config.cpu_kv_cache_bytes)
            num_pages, window_pages = sizing.pages(available)
        elif sizing.window is not None:
            window_pages = sizing.window.for_main(num_pages)
        if sizing.window is not None and config.num_window_page_override is not None:
            window_pages = config.num_window_page_override
            if window_pages < sizing.window.floor:
                raise ValueError(
                    f"num_window_page_override={window_pages} is below one request's window pages and a step's chunks "
                    f"({sizing.window.floor}): admission could never start a long request"
                )
        if window_pages is not None:
            window_pages = min(window_pages, num_pages)  # (a window page per main page at most: then never short)
        if num_pages <= 1:
            raise ValueError(
                f"not enough memory for the KV cache: num_pages={num_pages} (need > 1, {sizing.page_bytes} bytes each); "
                "raise memory_ratio / cpu_kv_cache_bytes or set num_page_override"
            )
        tokens, ps = num_pages * config.page_size, config.page_size
        if window_pages is None:
            logger.info_rank0(f"KV cache: {tokens} tokens, {gib(num_pages * sizing.page_bytes)}")
        else:
            used = num_pages * sizing.main_page_bytes + window_pages * sizing.window_page_bytes
            logger.info_rank0(
                f"KV cache: {tokens} tokens ({gib(num_pages * sizing.main_page_bytes)} for the global layers), the sliding "
                f"layers' in a window pool of {window_pages * ps} tokens ({gib(window_pages * sizing.window_page_bytes)}); "
                f"{gib(used)} would hold {used // sizing.page_bytes * ps} tokens with every layer keeping every token"
            )
        return num_pages, window_pages

    # ---- the one method callers use ----------------------------------------------------------
    def forward_batch(self, batch: Batch, args: BatchSamplingArgs) -> ForwardOutput:
        if batch.is_prefill:
            for req in batch.reqs:
                if req.device_len > self.max_seq_len:
                    raise ValueError(f"request {req.uid} needs {req.device_len} tokens, more than max_seq_len={self.max_seq_len}")
        self._move_inputs(batch)
        if self.pooler is not None:
            return self._embed_batch(batch, self.pooler)
        with torch.inference_mode(), self.ctx.forward_batch(batch):
            logits = pick_runner(self.runners, batch).run(batch)
            for req in batch.reqs:
                req.complete_one()
            logits = logits[: batch.size]
            next_tokens_gpu = self.sampler.sample(logits, args).to(torch.int32)
            if self.config.tp_info.size > 1 and args.temperatures is not None:
                # Every rank holds the same gathered logits, so greedy argmax agrees by itself; a
                # random draw is rank 0's, so every rank's token pool gets the same token.
                broadcast(next_tokens_gpu, src=0)
            next_tokens_cpu = next_tokens_gpu.to("cpu", non_blocking=True)
            logprobs = None
            if args.logprobs_k is not None:
                logprobs = _token_logprobs(logits, next_tokens_gpu, args.logprobs_k)
            prompt_logprobs = None
            verify_cpu = verify_lp = None
            if batch.verify_args is not None and batch.prompt_hidden is not None:
                # the same LM head as every row's, at every position of the rows with drafts
                lm_head: Any = self.model.lm_head
                with self._gemm_mode():
                    verify_logits = lm_head(batch.prompt_hidden)
                verify = verify_tokens(verify_logits, batch.verify_args, self.sampler.grammar)
                verify_cpu = verify.to(torch.int32).to("cpu", non_blocking=True)
                if batch.verify_args.logprobs_k is not None:  # (of the raw distribution, as a decode step's)
                    verify_lp = _token_logprobs(verify_logits, verify, batch.verify_args.logprobs_k)
                batch.prompt_hidden = None
            elif batch.prompt_hidden is not None:
                assert batch.prompt_logprob_targets is not None
                k = max((r.sampling_params.prompt_logprobs or 0) for r in batch.reqs)
                with self._gemm_mode():
                    prompt_logprobs = _prompt_logprobs(self.model.lm_head, batch.prompt_hidden, batch.prompt_logprob_targets, k)
                batch.prompt_hidden = None
        copy_done_event = create_event(self.device)
        copy_done_event.record(self.stream)
        return ForwardOutput(next_tokens_gpu, next_tokens_cpu, copy_done_event, logprobs, prompt_logprobs, verify_tokens=verify_cpu,
                             verify_logprobs=verify_lp)  # fmt: skip

    def _gemm_mode(self) -> Any:
        """The deterministic mode's batch-invariant GEMMs around an LM head call outside the model's
        forward (prompt-logprob and verify rows), so those rows' logits are the decode rows' bits."""
        return BatchInvariantMode() if self.gemm_tiles else contextlib.nullcontext()

    def _embed_batch(self, batch: Batch, pooler: Pooler) -> ForwardOutput:
        """The embed task's step: a prefill whose hidden rows are pooled; nothing is sampled."""
        if not batch.is_prefill:
            raise ValueError("the embed task runs prefill steps only (its requests never decode)")
        batch.return_hidden = True
        with torch.inference_mode(), self.ctx.forward_batch(batch):
            hidden = pick_runner(self.runners, batch).run(batch)
            vectors = pooler(batch, hidden)  # reads the fed ranges: before complete_one
            for req in batch.reqs:
                req.complete_one()
            tokens = torch.zeros(batch.size, dtype=torch.int32, device=self.device)
            tokens_cpu = tokens.to("cpu", non_blocking=True)
            vectors_cpu = vectors.to("cpu", non_blocking=True)
        copy_done_event = create_event(self.device)
        copy_done_event.record(self.stream)
        return ForwardOutput(tokens, tokens_cpu, copy_done_event, embeddings=vectors_cpu)

    def _move_inputs(self, batch: Batch) -> None:
        """The seed's manual loop builds input_ids/positions on the host: move what is elsewhere
        to the engine's device (a no-op for the scheduler's batches, already there)."""
        for name in ("input_ids", "positions", "out_loc"):
            t = getattr(batch, name, None)
            if t is not None and t.device != self.device:
                setattr(batch, name, t.to(self.device, non_blocking=True))

    def shutdown(self) -> None:
        """Free global state so another Engine can be built in this process."""
        runner = getattr(self, "graph_runner", None)
        if runner is not None:
            runner.destroy()
        for name in (
            "runners",
            "cpu_runner",
            "graph_runner",
            "skinny_plan",
            "attn_backend",
            "moe_backend",
            "kv_cache",
            "page_table",
            "model",
        ):
            if hasattr(self, name):
                delattr(self, name)
        if self.draft_of is not None:  # the process's state is the target engine's to clear
            return
        clear_global_ctx()
        if self.config.tp_info.size > 1:
            destroy_process_group()
        clear_tp_info()
        if is_cuda(self.device):
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
