"""The engine's plain data: sampling parameters, requests, batches, and the forward Context."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, List, Literal

import torch

if TYPE_CHECKING:
    from minisgl.attention.base import BaseAttnBackend
    from minisgl.kvcache.pool import KVCachePool
    from minisgl.moe.base import BaseMoeBackend


@dataclass
class SamplingParams:
    """Per-request sampling settings. The defaults are greedy decoding."""

    temperature: float = 0.0
    top_k: int = -1  # -1: no top-k filter
    top_p: float = 1.0
    min_p: float = 0.0
    max_tokens: int = 1024
    ignore_eos: bool = False
    stop_token_ids: List[int] = field(default_factory=list)
    seed: int | None = None
    # OpenAI-style penalties on tokens generated so far; HF-style repetition penalty on all tokens.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # Return the chosen token's logprob and this many top alternatives (None: no logprobs).
    logprobs: int | None = None

    def validate(self) -> None:
        """Raise ValueError naming the first field outside its allowed range."""
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or not (self.top_k == -1 or self.top_k >= 1):
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.min_p, (int, float)) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        if not isinstance(self.repetition_penalty, (int, float)) or not 0.0 < self.repetition_penalty <= 10.0:
            raise ValueError(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            raise ValueError(f"logprobs must be an integer in [0, 20], got {self.logprobs!r}")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def is_greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1


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
