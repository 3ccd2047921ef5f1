"""Typed messages between the server's processes, and their msgpack serialization.

The flow (see docs/ARCHITECTURE.md, "Serving: processes and messages"):

    API server --TokenizeMsg/AbortReq--> tokenizer worker --UserMsg/AbortMsg--> scheduler
    API server <--ReplyBatchMsg/ErrorMsg/SchedulerStats-- tokenizer worker <--TokenBatchMsg/ErrorMsg/SchedulerStats-- scheduler

Nothing here imports torch: every process can decode every message.
"""

from minisgl.message.messages import (
    AbortMsg,
    AbortReq,
    ErrorMsg,
    ExitMsg,
    FlushCacheDone,
    FlushCacheMsg,
    Message,
    ReplyBatchMsg,
    ReplyMsg,
    TokenBatchMsg,
    TokenizeMsg,
    TokenizeOnlyMsg,
    ToolReply,
    UserMsg,
)
from minisgl.message.outputs import SchedulerStats, TokenOutput
from minisgl.message.serialize import decode_msg, encode_msg, register_message

__all__ = [
    "AbortMsg",
    "AbortReq",
    "ErrorMsg",
    "ExitMsg",
    "FlushCacheDone",
    "FlushCacheMsg",
    "Message",
    "ReplyBatchMsg",
    "ReplyMsg",
    "SchedulerStats",
    "TokenBatchMsg",
    "TokenOutput",
    "TokenizeMsg",
    "TokenizeOnlyMsg",
    "ToolReply",
    "UserMsg",
    "decode_msg",
    "encode_msg",
    "register_message",
]
