"""What a scheduler step produces: one TokenOutput per request and token, and the SchedulerStats
counters. Both cross to the tokenizer worker (and the stats on to the API server) as themselves:
`scheduler.step()` returns them, the scheduler process sends them, nothing copies them.

Torch-free, like every message. Tuples arrive as lists after a trip through msgpack.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Tuple

from minisgl.message.serialize import register_message


@register_message
@dataclass(slots=True)
class TokenOutput:
    """One generated token (or a final notice) for one request."""

    uid: int
    token_id: int | None  # None for a request aborted before producing a token, and for an embedding
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    logprob: float | None = None
    top_logprobs: List[Tuple[int, float]] | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    # with the first token of a request that asked: [(token_id, logprob, [(id, logprob), ...]), ...]
    prompt_logprobs: List[List[Any]] | None = None
    # the embed task (token_id None): the request's pooled vector, float32 little-endian bytes
    embedding: bytes | None = None


@register_message
@dataclass
class SchedulerStats:
    """The scheduler's counters (`Scheduler.stats()`). The scheduler process pushes them when they
    change (at most a few times a second) and whenever the scheduler becomes idle, after filling in
    the last three fields, which only it knows."""

    num_running: int
    num_waiting: int
    total_pages: int
    free_pages: int  # free + evictable (cached but unpinned)
    cached_pages: int
    prompt_tokens: int
    cache_hit_tokens: int
    generated_tokens: int
    prefill_steps: int = 0
    decode_steps: int = 0
    mixed_steps: int = 0  # prefill steps that carried decode rows too
    num_retracted: int = 0  # waiting to resume after retraction
    retractions: int = 0  # requests retracted so far (pages taken back, later recomputed)
    peak_running: int = 0  # most requests admitted at once so far
    new_token_ratio: float = 0.0  # the admission estimate in use
    host_s: float = 0.0  # scheduling + launching (host time the device may hide with overlap)
    wait_s: float = 0.0  # waiting for the device's results
    # speculative decoding: draft tokens verified, of them accepted, and the rows that verified
    # drafts (each also gets the target's own token: tokens per verify row = (accepted + rows) / rows)
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_verify_rows: int = 0
    # a model with sliding layers (kvcache/window.py): the window pool's pages, and those free or
    # held only where no admitted request reads them (as free_pages counts evictable ones); 0: none
    window_total_pages: int = 0
    window_free_pages: int = 0
    # set by the scheduler process (scheduler/process.py)
    num_active: int = 0  # requests holding a table row (running + finished but not yet released)
    aborted_requests: int = 0
    gen_throughput: float = 0.0  # output tokens/s over the last interval (0 when idle)

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.free_pages / self.total_pages

    @property
    def spec_acceptance_rate(self) -> float:
        return self.spec_accepted_tokens / self.spec_proposed_tokens if self.spec_proposed_tokens else 0.0

    @property
    def spec_mean_accepted_length(self) -> float:
        """Tokens a verify row produced on average (accepted drafts + the target's own)."""
        return (self.spec_accepted_tokens + self.spec_verify_rows) / self.spec_verify_rows if self.spec_verify_rows else 0.0

    @property
    def cache_hit_rate(self) -> float:
        return self.cache_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
