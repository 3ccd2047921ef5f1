"""What one HTTP request may ask of the server, checked before any work is done for it.

Every cap is the same on /v1 and on /generate. The body is refused by size before it is read
(413), by JSON depth and lone UTF-16 surrogates before it is validated (400), and a prompt by its
size in bytes before it is tokenized (400): tokenizing 15 MB of text takes the tokenizer worker
seconds, during which nobody else's request moves.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Dict

from minisgl.sampling_params import InvalidRequest

MAX_JSON_DEPTH = 32
# A token is at least one byte and, averaged over a prompt, far less than this many: a prompt this
# many bytes per context token cannot fit the context and is refused without tokenizing it.
PROMPT_BYTES_PER_TOKEN = 32
MIN_PROMPT_BYTES = 64 << 10

_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass(frozen=True)
class RequestLimits:
    max_request_bytes: int  # the body, in bytes (413 beyond)
    max_prompt_bytes: int  # UTF-8 bytes of one prompt (all its messages for chat)
    max_seq_len: int  # the context: token-id prompts must be shorter
    vocab_size: int
    max_json_depth: int = MAX_JSON_DEPTH

    @staticmethod
    def for_server(max_request_bytes: int, max_prompt_bytes: int | None, scheduler_info: Dict[str, Any]) -> "RequestLimits":
        max_seq_len = int(scheduler_info.get("max_seq_len") or 1 << 20)
        if max_prompt_bytes is None:
            max_prompt_bytes = max(MIN_PROMPT_BYTES, PROMPT_BYTES_PER_TOKEN * max_seq_len)
        return RequestLimits(
            max_request_bytes=max_request_bytes,
            max_prompt_bytes=max_prompt_bytes,
            max_seq_len=max_seq_len,
            vocab_size=int(scheduler_info.get("vocab_size") or 1 << 31),
        )

    def check_prompt_text(self, text_bytes: int, param: str) -> None:
        if text_bytes > self.max_prompt_bytes:
            raise InvalidRequest(
                f"the prompt is {text_bytes} bytes, more than this server accepts ({self.max_prompt_bytes} bytes, "
                f"--max-prompt-bytes); it could not fit the {self.max_seq_len}-token context anyway",
                param=param,
                code="context_length_exceeded",
            )

    def check_prompt_ids(self, ids: list, param: str) -> None:
        if len(ids) >= self.max_seq_len:
            raise InvalidRequest(
                f"This model's maximum context length is {self.max_seq_len} tokens, but the prompt has {len(ids)} "
                "tokens (at least one token must be left for the output). Shorten the prompt.",
                param=param,
                code="context_length_exceeded",
            )


def check_json_tree(data: Any, max_depth: int) -> None:
    """Refuse objects nested deeper than `max_depth` and strings holding a lone UTF-16 surrogate
    (JSON's `"\\ud800"` decodes to one; it cannot be encoded as UTF-8, so no process could pass it
    on). Iterative: a hostile body cannot exhaust the stack here."""
    stack: list[tuple[Any, int, str | None]] = [(data, 1, None)]
    while stack:
        value, depth, top = stack.pop()
        if isinstance(value, str):
            if _SURROGATE.search(value):
                raise InvalidRequest(
                    "the request holds a lone UTF-16 surrogate (such as \\ud800) in a string: send valid Unicode",
                    param=top,
                    code="invalid_unicode",
                )
            continue
        if not isinstance(value, (dict, list)):
            continue
        if depth > max_depth:
            raise InvalidRequest(f"the request body is nested deeper than {max_depth} levels", param=top, code="invalid_json")
        if isinstance(value, dict):
            for key, item in value.items():
                here = top if top is not None else key
                stack.append((key, depth + 1, here))
                stack.append((item, depth + 1, here))
        else:
            stack.extend((item, depth + 1, top) for item in value)
