"""Large prompts are encoded in helper processes, off the tokenizer worker's loop.

The worker's loop also detokenizes every running request, and the tokenizers library holds the
GIL while it encodes (a megabyte prompt blocks a Python thread for a noticeable time), so one client's
large prompt would pause everyone's stream. Prompts of at least `threshold_chars` characters go to
a `ProcessPoolExecutor` of `--num-tokenizer-workers` processes, each with its own copy of the
tokenizer; the loop polls the futures and carries on. Small prompts (nearly all of them) are
encoded inline, where the round trip to a pool would cost more than the encoding. /tokenize's
large texts and chats go the same way (`submit_tokenize_only`): they are the same work.
"""

from __future__ import annotations

import multiprocessing as mp
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any, Dict, List

from minisgl.tokenizer.tokenize import PromptEncoder

_ENCODER: PromptEncoder | None = None


def _init(model_path: str, log_level: str) -> None:
    global _ENCODER
    from minisgl.server.process_utils import setup_child_process
    from minisgl.utils.hf import load_tokenizer

    setup_child_process("minisgl-encode", log_level)  # dies with the worker, ignores Ctrl-C

    _ENCODER = PromptEncoder(load_tokenizer(model_path))


def _encode(
    text: str | None,
    messages: List[Dict[str, Any]] | None,
    template_kwargs: Dict[str, Any] | None,
    tools: List[Dict[str, Any]] | None = None,
) -> List[int]:
    assert _ENCODER is not None
    if messages is not None:
        return _ENCODER.encode_chat(messages, template_kwargs, tools)
    assert text is not None
    return _ENCODER.encode_text(text)


def _tokenize_only(
    text: str | None, messages: List[Dict[str, Any]] | None, add_special_tokens: bool, add_generation_prompt: bool
) -> List[int]:
    assert _ENCODER is not None
    return _ENCODER.tokenize_only(text, messages, add_special_tokens, add_generation_prompt)


def prompt_chars(text: str | None, messages: List[Dict[str, Any]] | None) -> int:
    if messages is not None:
        return sum(len(m.get("content") or "") for m in messages)
    return len(text or "")


class EncodePool:
    def __init__(self, model_path: str, num_workers: int, log_level: str = "warning", threshold_chars: int = 16_384) -> None:
        self.threshold_chars = threshold_chars
        self._others = {p.pid for p in mp.active_children()}  # this process's children that are not the pool's
        self._executor = ProcessPoolExecutor(
            num_workers, mp_context=mp.get_context("spawn"), initializer=_init, initargs=(model_path, log_level)
        )
        self._executor.submit(_encode, "warm up", None, None)  # start the processes now, not on the first big prompt

    def wants(self, text: str | None, messages: List[Dict[str, Any]] | None) -> bool:
        return prompt_chars(text, messages) >= self.threshold_chars

    def submit(
        self,
        text: str | None,
        messages: List[Dict[str, Any]] | None,
        template_kwargs: Dict[str, Any] | None,
        tools: List[Dict[str, Any]] | None = None,
    ) -> "Future[List[int]]":
        return self._executor.submit(_encode, text, messages, template_kwargs, tools)

    def submit_tokenize_only(
        self, text: str | None, messages: List[Dict[str, Any]] | None, add_special_tokens: bool, add_generation_prompt: bool
    ) -> "Future[List[int]]":
        return self._executor.submit(_tokenize_only, text, messages, add_special_tokens, add_generation_prompt)

    def shutdown(self, timeout_s: float = 2.0) -> None:
        """End the workers, then the executor. An encode already handed to a worker (the warm-up,
        while a worker still loads its tokenizer at start-up) cannot be cancelled, and the
        executor, then the interpreter's exit, waited for it until the parent's SIGKILL: the
        tokenizer worker stopped 5 s late, its queues' 5 named semaphores left to the resource
        tracker ("leaked semaphore objects"). Dead workers break the pool instead: its manager
        thread fails what is pending, closes the queues and ends, and we wait for that (an exit
        racing it would write to its closed wake-up pipe)."""
        workers = [p for p in mp.active_children() if p.pid not in self._others]
        for proc in workers:
            proc.terminate()
        for proc in workers:
            proc.join(timeout_s)
        self._executor.shutdown(wait=True, cancel_futures=True)
