"""CUDA graphs for steps that carry prompt tokens: prefills and mixed batches (decode rows + chunks).

An eager forward of a 28-layer model costs several ms of kernel-launch time on the host, a few
graph decode steps. Under steady arrivals every step that carries a new prompt's chunk ran
eagerly, and those steps were the inter-token latency tail. Such a step now replays a graph
captured per padded token count T (`token_buckets`):

- the GEMMs, norms and the fused attention prologue run over T rows; padding rows feed token 0
  at position 0 and store their K/V on the dummy page (like a padded decode batch's rows);
- attention is the backend's prefill launch pair (attention/triton_backend.py): the decode kernel
  over up to min(T, max requests) decode rows and the extend kernel over up to
  MAX_EXTEND_REQS chunks of up to T tokens, both grids fixed by those bounds, the step's real
  rows and lengths in a static metadata buffer (padding programs exit at once);
- the LM head runs on the rows named by the static last-index buffer (the step's decode rows and
  each chunk's last token, then row 0 for padding): the caller keeps the first `batch.size`.

Steps larger than the largest bucket (an arrival burst's big prefills), with more chunks than
MAX_EXTEND_REQS, or that want prompt logprobs run eagerly as before; there launch time is small
next to the work.
"""

from __future__ import annotations

from typing import Any, Dict, List, cast

import torch
from torch import nn

from minisgl.attention.base import BaseAttnBackend, MixedGraphHooks
from minisgl.core import Batch, Req
from minisgl.engine.graph_base import GraphInputs, capture_forward
from minisgl.utils.logger import init_logger

logger = init_logger(__name__)

MAX_EXTEND_REQS = 16  # chunks (new or continued prompts) in one graph step


def default_max_tokens(free_memory: int) -> int:
    """The largest captured step for a device with `free_memory` bytes free before loading: each
    bucket keeps its own logits output (up to ~270 rows x vocab), ~1 GiB over the 2048 list for
    a 150k vocabulary, so smaller devices capture fewer buckets (as default_graph_max_bs does)."""
    gib = free_memory / (1 << 30)
    return 2048 if gib > 40 else 1024 if gib > 16 else 512


def token_buckets(max_tokens: int) -> List[int]:
    """Captured token counts: from 256 on, each at most 25% above the one before (a padded step
    computes at most 25% more rows than it needs)."""
    sizes = [32, 64, 128, 192] + list(range(256, 513, 64)) + list(range(640, 1025, 128)) + list(range(1280, 1 << 20, 256))
    out = [t for t in sizes if t <= max_tokens]
    if max_tokens > 0 and (not out or out[-1] != max_tokens):
        out.append(max_tokens)
    return out


class MixedGraphs:
    def __init__(
        self,
        stream: Any,
        device: torch.device,
        model: nn.Module,
        attn_backend: BaseAttnBackend,
        dummy_req: Req,
        max_tokens: int,
        max_reqs: int,
    ) -> None:
        self.stream, self.device, self.model = stream, device, model
        self.hooks = cast(MixedGraphHooks, attn_backend)  # the caller checked AttnCap.MIXED_GRAPH
        self.dummy_req = dummy_req
        self.max_reqs = max_reqs
        self.buckets = token_buckets(max_tokens)
        self.graphs: Dict[int, Any] = {}
        self.outputs: Dict[int, torch.Tensor] = {}

    @property
    def max_tokens(self) -> int:
        return self.buckets[-1] if self.buckets else 0

    def _num_decode(self, tokens: int) -> int:
        return min(tokens, self.max_reqs)

    def _num_extend(self, tokens: int) -> int:
        return min(tokens, MAX_EXTEND_REQS)

    def _bucket(self, tokens: int) -> int:
        return next(t for t in self.buckets if t >= tokens)

    def capture(self, pool: Any) -> Any:
        """Capture every bucket, largest first, in `pool` (None: a new one); returns the pool."""
        if not self.buckets:
            return pool
        n = self.max_tokens
        self.inputs = GraphInputs(n, self.dummy_req, self.device)
        self.hooks.init_mixed_graph(self._num_decode(n) + self._num_extend(n))
        torch.cuda.synchronize(self.device)
        with torch.inference_mode():
            for t in reversed(self.buckets):
                batch = self.inputs.bind(Batch(reqs=[self.dummy_req], phase="prefill"), t)
                self.hooks.prepare_for_mixed_capture(batch, self._num_decode(t), self._num_extend(t), t)
                self.graphs[t], self.outputs[t], pool = capture_forward(self.model, batch, self.stream, pool)
        torch.cuda.synchronize(self.device)
        logger.info_rank0(f"captured CUDA graphs for prefill/mixed steps of {self.buckets} tokens")
        return pool

    def can_run(self, batch: Batch) -> bool:
        if not self.graphs or not batch.is_prefill or batch.prompt_logprob_rows is not None:
            return False
        tokens = batch.input_ids.shape[0]
        if tokens > self.max_tokens or batch.padded_size != batch.size:
            return False
        return batch.size - batch.num_decode_rows <= self._num_extend(self._bucket(tokens))

    def replay(self, batch: Batch) -> torch.Tensor:
        n = batch.input_ids.shape[0]
        t = self._bucket(n)
        self.inputs.load(batch, t)
        self.hooks.prepare_for_mixed_replay(batch)
        self.graphs[t].replay()
        return self.outputs[t]

    def destroy(self) -> None:
        self.graphs.clear()
        self.outputs.clear()
