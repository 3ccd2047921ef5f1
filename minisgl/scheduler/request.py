"""What the scheduler keeps per request, around the engine's Req."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, List

import torch

from minisgl.core import Req, SamplingParams
from minisgl.kvcache.base import MatchResult
from minisgl.message.outputs import TokenOutput  # defined with the messages: it crosses processes as itself


@dataclass
class UserRequest:
    """A tokenized request as it arrives at the scheduler."""

    uid: int
    input_ids: List[int]
    sampling_params: SamplingParams
    # The client set max_tokens: beyond the context it is refused, not clipped (as OpenAI).
    strict_max_tokens: bool = False
    # Fair admission's unit (scheduler/queue.py): the requests of one client call (its n choices,
    # its prompts) share a group; None: a group of its own.
    group: int | None = None


class Status(enum.Enum):
    """Where a request is; the policy's queues and maps only order requests of one status."""

    WAITING = "waiting"  # queued, never admitted
    PREFILLING = "prefilling"  # holds a row and pages, its prompt (or resume) is being prefilled
    RUNNING = "running"  # decoding
    RETRACTED = "retracted"  # pages taken back; queued to resume by recompute
    FINISHED = "finished"  # ended (stop, length, abort, error); resources released after its last step


class SchedReq(Req):
    """A request in the scheduler: the engine's Req plus its status, pages, cache pin and stop state.

    While the prompt is being prefilled in chunks, `device_len` stops at the end of the current
    chunk (< prefill_len); the token sampled after a non-final chunk is discarded.

    A retracted request (its pages were taken back when the pool ran out) keeps this object:
    its tokens, counters, grammar state and stream position survive, and on re-admission it
    prefills `prefill_len` = prompt + generated tokens (from the prefix cache where pages
    survived) before it samples its next token.
    """

    def __init__(self, user: UserRequest, output_len: int) -> None:
        super().__init__(
            input_ids=torch.tensor(user.input_ids, dtype=torch.int32),
            table_idx=-1,
            cached_len=0,
            output_len=output_len,
            uid=user.uid,
            sampling_params=user.sampling_params,
            cache_handle=None,
        )
        self.status = Status.WAITING
        self.group = user.uid if user.group is None else user.group
        self.pages: List[int] = []  # page i holds positions [i*page_size, (i+1)*page_size)
        self.num_cached_prompt = 0
        self.matched_len = 0  # tokens whose pages came from the prefix cache (this admission)
        self.reserved_pages = 0  # pages promised to this request but not yet allocated
        # with window pages (kvcache/window.py): pages before this one had their window dropped
        self.window_from = 0
        self.window_claim = 0  # window pages counted for it while it holds a row (Policy._window_claim)
        self.finish_reason: str | None = None
        self.stop_ids: set[int] = set()
        self.kv_trusted = True  # False after a failed step: its KV must not enter the prefix cache
        self.grammar_matcher: Any = None  # xgrammar GrammarMatcher of a structured-output request
        # prompt logprobs: [token id, logprob, [(id, logprob), ...]] for prompt tokens 1.., gathered
        # chunk by chunk and sent with the first output token
        self.prompt_lp: List[List[Any]] = []
        self.prefill_len = self.prompt_len  # tokens to prefill before the next sample counts
        self.admit_seq = 0  # admission order: the latest admitted is retracted first
        self.num_retractions = 0
        self.trusted_len = 0  # cached_len before the current mixed step (a failure rolls back to it)
        # speculative decoding: its DraftLength (scheduler/spec_ngram.py), made on first use, and
        # the n-gram proposer's index (scheduler/spec_proposer.py)
        self.spec: Any = None
        self.draft_state: Any = None

    def admit(self, table_idx: int, match: MatchResult, page_size: int) -> None:
        """Take a row: prefill every token (prompt, or prompt + generated on a resume) but the
        prefix `match` found in the cache."""
        self.table_idx = table_idx
        self.cache_handle = match.handle
        self.pages = list(match.pages)
        self.window_from = 0
        self.cached_len = self.matched_len = match.num_pages * page_size
        if self.status is Status.WAITING:
            self.num_cached_prompt = self.cached_len
        self.prefill_len = len(self._ids)
        self.device_len = self.prefill_len
        self.status = Status.PREFILLING

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def holds_row(self) -> bool:
        return self.table_idx >= 0

    _ids: List[int]
    _ids_tensor: torch.Tensor | None

    # Token ids live in a Python list: appending one per step must not copy the whole sequence.
    @property  # type: ignore[override]
    def input_ids(self) -> torch.Tensor:
        if self._ids_tensor is None or len(self._ids_tensor) != len(self._ids):
            self._ids_tensor = torch.tensor(self._ids, dtype=torch.int32)
        return self._ids_tensor

    @input_ids.setter
    def input_ids(self, value: torch.Tensor) -> None:
        self._ids = value.tolist()
        self._ids_tensor = value

    @property
    def token_ids(self) -> List[int]:
        return self._ids

    def append_host(self, next_token: torch.Tensor) -> None:
        self._ids.extend(next_token.view(-1).tolist())

    def append_token(self, token: int) -> None:
        self._ids.append(token)

    @property
    def prefill_done(self) -> bool:
        return self.cached_len >= self.prefill_len

    @property
    def num_output(self) -> int:
        return len(self._ids) - self.prompt_len

    @property
    def can_decode(self) -> bool:
        return self.status is Status.RUNNING and self.prefill_done and self.device_len < self.max_device_len


__all__ = ["UserRequest", "TokenOutput", "SchedReq", "Status", "field"]
