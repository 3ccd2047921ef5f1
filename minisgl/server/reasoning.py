"""Reasoning output: models that think between `<think>` and `</think>` (Qwen3, DeepSeek-R1, QwQ)
get their thoughts in `message.reasoning_content` (and `reasoning`, the newer name) instead of
`content`, as vLLM and SGLang return them.

`auto` (the default of --reasoning-parser) turns this on when the chat template knows the tags.
OpenAI's harmony format (GPT-OSS) writes thoughts in an `analysis` channel instead: that is
`minisgl.server.harmony`, chosen for a harmony template (`--reasoning-parser harmony`).
The opening tag may be in the output or already in the prompt (templates that open the thought
for the model): text before `</think>` is reasoning either way. Output without the tags (thinking
switched off, e.g. `chat_template_kwargs: {"enable_thinking": false}`) is all content.
"""

from __future__ import annotations

from typing import Tuple

OPEN, CLOSE = "<think>", "</think>"


def wants_reasoning(name: str, chat_template: str | None) -> bool:
    if name == "none":
        return False
    if name == "think":
        return True
    return CLOSE in (chat_template or "")


def split_reasoning(text: str, opened_in_prompt: bool = False) -> Tuple[str | None, str]:
    """(reasoning or None, content) of a finished output."""
    head, sep, tail = text.partition(CLOSE)
    if sep:
        return head.replace(OPEN, "", 1).strip(), tail.lstrip()
    stripped = text.lstrip()
    if stripped.startswith(OPEN) or opened_in_prompt:  # cut off while still thinking
        return stripped.removeprefix(OPEN).strip(), ""
    return None, text


class ReasoningStream:
    """Splits streamed text into reasoning and content deltas, holding back partial tags."""

    def __init__(self, opened_in_prompt: bool = False) -> None:
        self.text = ""
        self.sent = 0
        self.thinking: bool | None = True if opened_in_prompt else None  # None: not decided yet
        self.done_thinking = False
        self.content_started = False

    def feed(self, delta: str) -> Tuple[str, str]:
        self.text += delta
        reasoning, content = "", ""
        while True:
            pending = self.text[self.sent :]
            if self.thinking is None:
                stripped = pending.lstrip()
                if stripped.startswith(OPEN):
                    self.thinking = True
                    self.sent += len(pending) - len(stripped) + len(OPEN)
                    continue
                if OPEN.startswith(stripped):  # "", "<", "<thi": wait for more
                    return reasoning, content
                self.thinking = False
            if self.thinking:
                pos = pending.find(CLOSE)
                if pos != -1:
                    reasoning += pending[:pos]
                    self.sent += pos + len(CLOSE)
                    self.thinking, self.done_thinking = False, True
                    continue
                keep = _partial_suffix(pending, CLOSE)
                reasoning += pending[: len(pending) - keep]
                self.sent += len(pending) - keep
                return reasoning, content
            if self.done_thinking and not self.content_started:  # the blank lines after </think>
                stripped = pending.lstrip()
                self.sent += len(pending) - len(stripped)
                if not stripped:
                    return reasoning, content
                self.content_started = True
                pending = stripped
            content += pending
            self.sent = len(self.text)
            return reasoning, content

    def finish(self) -> Tuple[str, str]:
        """What is left: (reasoning, content)."""
        rest = self.text[self.sent :]
        self.sent = len(self.text)
        return (rest, "") if self.thinking else ("", rest)


def _partial_suffix(text: str, tag: str) -> int:
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0
