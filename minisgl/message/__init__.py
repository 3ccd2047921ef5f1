"""Typed messages between the server's processes, and their msgpack serialization.

The flow (see docs/ARCHITECTURE.md, "Serving: processes and messages"):

    API server --TokenizeMsg/AbortReq--> tokenizer worker --UserMsg/AbortMsg--> scheduler
    API server <--ReplyBatchMsg/ErrorMsg/StatsMsg-- tokenizer worker <--TokenBatchMsg/ErrorMsg/StatsMsg-- scheduler

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
    StatsMsg,
    TokenBatchMsg,
    TokenizeMsg,
    TokenizeOnlyMsg,
    TokenOut,
    ToolReply,
    UserMsg,
)
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
    "StatsMsg",
    "TokenBatchMsg",
    "TokenOut",
    "TokenizeMsg",
    "TokenizeOnlyMsg",
    "ToolReply",
    "UserMsg",
    "decode_msg",
    "encode_msg",
    "register_message",
]
