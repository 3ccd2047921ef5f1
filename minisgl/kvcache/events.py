"""KV events: what the prefix cache stored and dropped, for cache-aware routers.

The radix cache reports its changes here (only when a recorder is attached: with none, the cache
computes no hashes and records nothing). Events follow vLLM's KV-event format (its
`vllm/distributed/kv_events.py`), which SGLang, TensorRT-LLM, LMCache and the routers that read
them (llm-d's KV-cache indexer, NVIDIA Dynamo, SMG) share:

    BlockStored(block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium)
    BlockRemoved(block_hashes, medium)
    AllBlocksCleared()

A block is one KV page (`--page-size` tokens). Its hash is chained, so equal hashes mean equal
prefixes: `block_hash(parent, tokens)` is the first 8 bytes, read as a big-endian unsigned
integer, of SHA-256 over the parent's hash as 8 big-endian bytes (0 for a prompt's first page)
followed by the page's token ids, each as 4 big-endian bytes. The first page's event carries
`parent_block_hash = None`. The hash depends only on token ids: the same prefix hashes the same
on every replica and across restarts.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Any, List, Sequence

ROOT_PARENT = 0  # what the first page of a prompt is chained to


def block_hash(parent: int | None, token_ids: Sequence[int]) -> int:
    data = struct.pack(f">Q{len(token_ids)}I", ROOT_PARENT if parent is None else parent, *token_ids)
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "big")


def chain_hashes(parent: int | None, token_ids: Sequence[int], page_size: int) -> List[int]:
    """The hashes of the whole pages of `token_ids` following a page hashed `parent`."""
    hashes: List[int] = []
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        parent = block_hash(parent, token_ids[start : start + page_size])
        hashes.append(parent)
    return hashes


class KVEventRecorder:
    """Collects events as plain lists in vLLM's msgpack layout (msgspec array_like, tag first), to
    be published in one batch per scheduler iteration (`take`)."""

    def __init__(self, page_size: int, medium: str | None) -> None:
        self.page_size = page_size
        self.medium = medium
        self._events: List[List[Any]] = []

    def stored(self, parent: int | None, token_ids: Sequence[int]) -> List[int]:
        """Record new pages (their token ids, whole pages) under `parent`; returns their hashes."""
        hashes = chain_hashes(parent, token_ids, self.page_size)
        self._events.append(["BlockStored", hashes, parent, list(token_ids), self.page_size, None, self.medium])
        return hashes

    def removed(self, hashes: List[int]) -> None:
        if hashes:
            self._events.append(["BlockRemoved", list(hashes), self.medium])

    def cleared(self) -> None:
        self._events.append(["AllBlocksCleared"])

    def take(self) -> List[List[Any]]:
        events, self._events = self._events, []
        return events
