"""The engine's plain data: requests, batches and the forward Context (and `SamplingParams`,
which lives in the torch-free `minisgl.sampling_params` and is re-exported here)."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, List, Literal

import torch

from minisgl.sampling_params import SamplingParams

__all__ = ["SamplingParams", "Req", "Batch", "Context", "get_global_ctx", "set_global_ctx", "clear_global_ctx", "global_ctx"]

if TYPE_CHECKING:
    from minisgl.attention.base import BaseAttnBackend
    from minisgl.kvcache.pool import KVCachePool
    from minisgl.moe.base import BaseMoeBackend


class Req:
    """One request as the engine sees it.

    `input_ids` (host, int32) holds prompt + generated tokens. Tokens [0, cached_len) already
    have KV in the pool; [cached_len, device_len) are fed in the next forward. The request may
    grow up to `max_device_len = len(prompt) + output_len` tokens.
    """

    def __init__(
        self,
        *,
        input_ids: torch.Tensor,
        table_idx: int,
        cached_len: int,
        output_len: int,
        uid: int,
        sampling_params: SamplingParams,
        cache_handle: Any,
    ) -> None:
        assert input_ids.dim() == 1 and input_ids.device.type == "cpu"
        self.input_ids = input_ids.to(torch.int32)
        self.prompt_len = len(input_ids)
        self.table_idx = table_idx
        self.cached_len = cached_len
        self.device_len = len(input_ids)
        self.output_len = output_len  # tokens this request may generate at most
        self.max_device_len = len(input_ids) + output_len
        self.uid = uid
        self.sampling_params = sampling_params
        self.cache_handle = cache_handle
        assert 0 <= cached_len < self.device_len <= self.max_device_len

    @property
    def extend_len(self) -> int:
        """Tokens this request feeds in the next forward."""
        return self.device_len - self.cached_len

    @property
    def remain_len(self) -> int:
        return self.max_device_len - self.device_len

    def complete_one(self) -> None:
        """Mark the current forward done: its tokens are cached, one more token is on the way."""
        self.cached_len = self.device_len
        self.device_len += 1

    @property
    def output_ids(self) -> torch.Tensor:
        """Tokens generated so far and known on the host."""
        return self.input_ids[self.prompt_len :]

    def append_host(self, next_token: torch.Tensor) -> None:
        self.input_ids = torch.cat([self.input_ids, next_token.view(-1).to(torch.int32)])

    def __repr__(self) -> str:
        return (
            f"Req(uid={self.uid}, table_idx={self.table_idx}, cached_len={self.cached_len}, "
            f"device_len={self.device_len}, max_device_len={self.max_device_len})"
        )


Phase = Literal["prefill", "decode"]


@dataclass
class Batch:
    """One forward's worth of requests. The scheduler fills input_ids/positions/out_loc over
    `padded_reqs` (reqs + dummy requests up to a CUDA-graph size); the attention backend
    fills `attn_metadata`."""

    reqs: List[Req]
    phase: Phase
    input_ids: torch.Tensor = field(init=False)
    positions: torch.Tensor = field(init=False)
    out_loc: torch.Tensor = field(init=False)
    padded_reqs: List[Req] = field(init=False)
    attn_metadata: Any = field(init=False, default=None)
    # Prefill only: token rows (into the flattened batch) whose logits are wanted for prompt
    # logprobs, the prompt token each row predicts, and where the model leaves those rows' final
    # hidden states (the engine runs the LM head over them in chunks: bounded memory).
    prompt_logprob_rows: torch.Tensor | None = field(init=False, default=None)
    prompt_logprob_targets: torch.Tensor | None = field(init=False, default=None)
    prompt_hidden: torch.Tensor | None = field(init=False, default=None)
    prompt_logprob_counts: List[int] = field(init=False, default_factory=list)  # per request
    # A verify step (speculative decoding, engine/spec_verify.py): prompt_logprob_rows are the
    # rows of the rows with drafts, and the engine returns the target's token at each of them
    # (by these VerifyArgs) instead of prompt logprobs.
    verify_args: Any = field(init=False, default=None)
    # A mixed batch (phase "prefill") starts with this many decode rows (one token each).
    num_decode_rows: int = field(init=False, default=0)
    # The embed task: the model returns every fed row's final-normed hidden state instead of
    # logits (prefill only; the module path runs it, CUDA graphs and the CPU decode loop refuse it).
    return_hidden: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        self.padded_reqs = list(self.reqs)

    @property
    def size(self) -> int:
        return len(self.reqs)

    @property
    def padded_size(self) -> int:
        return len(self.padded_reqs)

    @property
    def is_prefill(self) -> bool:
        return self.phase == "prefill"

    @property
    def is_decode(self) -> bool:
        return self.phase == "decode"


class Context:
    """Per-engine state that every layer may need during a forward: the batch being run, the KV
    pool, the page table and the backends. Set globally by the Engine; cleared on shutdown."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self._batch: Batch | None = None
        self.kv_cache: KVCachePool | None = None
        self.page_table: torch.Tensor | None = None
        self.attn_backend: BaseAttnBackend | None = None
        self.moe_backend: BaseMoeBackend | None = None

    @property
    def batch(self) -> Batch:
        assert self._batch is not None, "no batch: call the model inside ctx.forward_batch(batch)"
        return self._batch

    @contextmanager
    def forward_batch(self, batch: Batch) -> Iterator[None]:
        assert self._batch is None, "forward_batch does not nest"
        self._batch = batch
        try:
            yield
        finally:
            self._batch = None


_GLOBAL_CTX: Context | None = None


def set_global_ctx(ctx: Context) -> None:
    global _GLOBAL_CTX
    assert _GLOBAL_CTX is None, "a Context is already set: shut the previous Engine down first"
    _GLOBAL_CTX = ctx


def get_global_ctx() -> Context:
    assert _GLOBAL_CTX is not None, "no global Context: create an Engine first"
    return _GLOBAL_CTX


def clear_global_ctx() -> None:
    global _GLOBAL_CTX
    _GLOBAL_CTX = None


@contextmanager
def global_ctx(ctx: Context) -> Iterator[None]:
    """`ctx` is the global Context inside the block, the previous one (or none) after it. A second
    model in the process (the draft model of speculative decoding, scheduler/spec_draft.py) is
    built and run inside this: every layer, attention backend and step runner reads the Context
    of the model being run without being told which one it is. The scheduler loop is one thread,
    so the swap is never seen by the other model's forwards."""
    global _GLOBAL_CTX
    previous, _GLOBAL_CTX = _GLOBAL_CTX, ctx
    try:
        yield
    finally:
        _GLOBAL_CTX = previous
