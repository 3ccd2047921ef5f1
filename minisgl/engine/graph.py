"""CUDA graphs for decode (and, through engine/mixed_graph.py, for steps with prompt tokens).

A decode step of a small model is dominated by kernel launches (an eager 28-layer forward costs
far more host time than the GPU needs for it), so decode steps replay graphs captured once per
batch size. Batches are padded with the dummy request (whose KV writes land on the dummy page)
up to the next captured size; larger batches and non-CUDA devices run eagerly. Prefill and
mixed steps of up to `max_graph_tokens` tokens replay the graphs of `MixedGraphs`, captured
first into the same memory pool.
"""

from __future__ import annotations

from typing import Any, Dict, List, cast

import torch
from torch import nn

from minisgl.attention.base import AttnCap, BaseAttnBackend, DecodeGraphHooks
from minisgl.core import Batch, Req, get_global_ctx
from minisgl.engine.graph_base import GraphInputs, capture_forward
from minisgl.engine.mixed_graph import MixedGraphs
from minisgl.moe.base import BaseMoeBackend, MoeCap
from minisgl.utils.device import is_cuda
from minisgl.utils.logger import init_logger

logger = init_logger(__name__)


def default_graph_batch_sizes(max_bs: int) -> List[int]:
    sizes = [bs for bs in (1, 2, 4, 8) if bs <= max_bs]
    sizes += list(range(16, max_bs + 1, 8))
    return sizes


def default_graph_max_bs(free_memory: int) -> int:
    gib = free_memory / (1 << 30)
    return 256 if gib > 40 else 128 if gib > 16 else 64


class GraphRunner:
    def __init__(
        self,
        stream: Any,
        device: torch.device,
        model: nn.Module,
        attn_backend: BaseAttnBackend,
        cuda_graph_bs: List[int] | None,
        cuda_graph_max_bs: int | None,
        free_memory: int,
        max_seq_len: int,
        vocab_size: int,
        dummy_req: Req,
        max_graph_tokens: int = 0,
        moe_backend: BaseMoeBackend | None = None,
    ) -> None:
        self.device, self.stream, self.model, self.attn_backend = device, stream, model, attn_backend
        self.dummy_req = dummy_req
        self.graphs: Dict[int, Any] = {}
        self.outputs: Dict[int, torch.Tensor] = {}
        self.batch_sizes: List[int] = []
        self.mixed: MixedGraphs | None = None
        if not is_cuda(device) or AttnCap.DECODE_GRAPH not in attn_backend.caps:
            return
        if moe_backend is not None and MoeCap.DECODE_GRAPH not in moe_backend.caps:
            return  # its routing syncs with the host: not capturable
        self.hooks = cast(DecodeGraphHooks, attn_backend)
        # A batch never holds more requests than the page table has rows (the last is the dummy's).
        max_reqs = get_global_ctx().page_table.shape[0] - 1  # type: ignore[union-attr]
        if cuda_graph_bs is not None:
            sizes = sorted(set(bs for bs in cuda_graph_bs if bs <= max_reqs))
        else:
            max_bs = cuda_graph_max_bs if cuda_graph_max_bs is not None else default_graph_max_bs(free_memory)
            sizes = default_graph_batch_sizes(min(max_bs, max_reqs))
        if not sizes or sizes[0] <= 0:
            return
        self.batch_sizes = sizes
        pool = None
        if max_graph_tokens > 0 and AttnCap.MIXED_GRAPH in attn_backend.caps:
            self.mixed = MixedGraphs(stream, device, model, attn_backend, dummy_req, max_graph_tokens, max_reqs)
            pool = self.mixed.capture(None)
        self._capture(max_seq_len, pool)

    @property
    def max_graph_bs(self) -> int:
        return self.batch_sizes[-1] if self.batch_sizes else 0

    def _capture(self, max_seq_len: int, pool: Any) -> None:
        max_bs = self.max_graph_bs
        self.inputs = GraphInputs(max_bs, self.dummy_req, self.device)
        self.hooks.init_capture_graph(max_seq_len, self.batch_sizes)
        torch.cuda.synchronize(self.device)
        # inference_mode as in Engine.forward_batch: the captured kernels are the eager ones
        with torch.inference_mode():
            for bs in reversed(self.batch_sizes):  # largest first: later graphs reuse its memory
                batch = self.inputs.bind(Batch(reqs=[self.dummy_req] * bs, phase="decode"), bs)
                self.hooks.prepare_for_capture(batch)
                self.graphs[bs], self.outputs[bs], pool = capture_forward(self.model, batch, self.stream, pool)
        torch.cuda.synchronize(self.device)
        logger.info_rank0(f"captured CUDA graphs for decode batch sizes {self.batch_sizes}")

    def _graph_size(self, size: int) -> int:
        return next(bs for bs in self.batch_sizes if bs >= size)

    def can_use_cuda_graph(self, batch: Batch) -> bool:
        if batch.is_prefill:
            return self.mixed is not None and self.mixed.can_run(batch)
        return bool(self.graphs) and batch.padded_size in self.graphs

    # the step-runner protocol (engine/runners.py): decode and mixed-step graphs, one memory pool
    def can_run(self, batch: Batch) -> bool:
        # the graphs end in the LM head's logits; an embed batch needs the hidden rows
        return not batch.return_hidden and self.can_use_cuda_graph(batch)

    def run(self, batch: Batch) -> torch.Tensor:
        return self.replay(batch)

    def pad_batch(self, batch: Batch) -> None:
        """Pad a decode batch with the dummy request up to the next captured batch size."""
        if self.graphs and batch.is_decode and batch.size <= self.max_graph_bs:
            padded = self._graph_size(batch.size)
            batch.padded_reqs = list(batch.reqs) + [self.dummy_req] * (padded - batch.size)
        else:
            batch.padded_reqs = list(batch.reqs)

    def replay(self, batch: Batch) -> torch.Tensor:
        if batch.is_prefill:
            assert self.mixed is not None
            return self.mixed.replay(batch)
        bs = batch.padded_size
        # fields filled over batch.reqs only (not padded_reqs): the padding rows are the dummy's
        self.inputs.load(batch, bs)
        self.hooks.prepare_for_replay(batch)
        self.graphs[bs].replay()
        return self.outputs[bs]

    def destroy(self) -> None:
        if self.mixed is not None:
            self.mixed.destroy()
        self.graphs.clear()
        self.outputs.clear()
