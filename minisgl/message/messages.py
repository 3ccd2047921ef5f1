"""The messages themselves. Each is a plain dataclass registered for msgpack transport.

Sampling parameters travel typed: `minisgl.sampling_params.SamplingParams` (torch-free) is
registered here, so a request's parameters are validated once, in the API server, and arrive in the
scheduler as the same dataclass.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Union

from minisgl.message.outputs import SchedulerStats, TokenOutput
from minisgl.message.serialize import register_message
from minisgl.sampling_params import GrammarSpec, SamplingParams

register_message(SamplingParams)
register_message(GrammarSpec)

# ---- API server -> tokenizer worker -------------------------------------------------------------


@register_message
@dataclass
class TokenizeMsg:
    """A new request. Exactly one of `text`, `messages` (chat) or `input_ids` is set."""

    uid: int
    text: str | None = None
    messages: List[Dict[str, Any]] | None = None
    input_ids: List[int] | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)  # validated by the API server
    max_tokens_explicit: bool = False  # the client asked for max_tokens: reject, never clip
    want_logprobs: bool = False
    skip_special_tokens: bool = True
    chat_template_kwargs: Dict[str, Any] | None = None
    tools: List[Dict[str, Any]] | None = None  # function definitions for the chat template
    group: int = 0  # fair admission: the requests of one client call share it (0: none; set by Frontend.submit)


@register_message
@dataclass
class TokenizeOnlyMsg:
    """/tokenize (`text` or chat `messages`) and /detokenize (`token_ids`): answered with a ToolReply."""

    uid: int
    text: str | None = None
    messages: List[Dict[str, Any]] | None = None
    token_ids: List[int] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


@register_message
@dataclass
class ToolReply:
    """The answer to a TokenizeOnlyMsg: token ids, or the decoded text."""

    uid: int
    token_ids: List[int] | None = None
    text: str | None = None


@register_message
@dataclass
class AbortReq:
    """The client went away or cancelled: forget the request and abort it in the scheduler."""

    uid: int


# ---- tokenizer worker -> scheduler --------------------------------------------------------------


@register_message
@dataclass
class UserMsg:
    uid: int
    input_ids: List[int]
    sampling: SamplingParams
    max_tokens_explicit: bool = False
    group: int = 0  # TokenizeMsg.group


@register_message
@dataclass
class AbortMsg:
    uid: int


@register_message
@dataclass
class FlushCacheMsg:
    """Drop every unpinned page of the prefix cache; answered with a FlushCacheDone for `uid`."""

    uid: int = 0


@register_message
@dataclass
class ExitMsg:
    """Leave the loop and exit cleanly."""


# ---- scheduler -> tokenizer worker (also TokenOutput and SchedulerStats, message/outputs.py) --------------------------------------------------------------


@register_message
@dataclass
class FlushCacheDone:
    """The answer to FlushCacheMsg `uid`: `flushed` is False while requests are running (the cache
    holds their prefixes), and then nothing was dropped."""

    uid: int
    flushed: bool
    freed_pages: int = 0


@register_message
@dataclass
class TokenBatchMsg:
    """One scheduler step's outputs, in one message."""

    outputs: List[TokenOutput]


# ---- both workers -> API server -----------------------------------------------------------------


@register_message
@dataclass
class ErrorMsg:
    """A request failed (bad input: status 400; an internal error: 500). Final for its uid."""

    uid: int
    message: str
    status: int = 400
    param: str | None = None
    code: str | None = None


# ---- tokenizer worker -> API server -------------------------------------------------------------


@register_message
@dataclass
class ReplyMsg:
    """New output of one request: `text` is the delta since the previous reply."""

    uid: int
    text: str
    num_tokens: int  # tokens this reply accounts for
    finished: bool = False
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0  # tokens generated so far
    cached_tokens: int = 0
    # per token: [token text, logprob, [[alt text, alt logprob], ...], token id]
    logprobs: List[List[Any]] | None = None
    matched_stop: Union[str, int, None] = None
    token_ids: List[int] | None = None  # the new token ids
    # the prompt's tokens, with the first reply of a request that asked for prompt logprobs:
    # [token text, logprob or None (the first token), [[alt text, alt logprob], ...], token id]
    prompt_logprobs: List[List[Any]] | None = None
    # the embed task, with the final reply: the pooled vector (float32 little-endian bytes)
    embedding: bytes | None = None


@register_message
@dataclass
class ReplyBatchMsg:
    replies: List[ReplyMsg]


Message = Union[
    TokenizeMsg,
    AbortReq,
    UserMsg,
    AbortMsg,
    FlushCacheMsg,
    FlushCacheDone,
    TokenizeOnlyMsg,
    ToolReply,
    ExitMsg,
    TokenBatchMsg,
    SchedulerStats,
    ErrorMsg,
    ReplyMsg,
    ReplyBatchMsg,
]
