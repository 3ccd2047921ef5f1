"""What one HTTP request may ask of the server, checked before any work is done for it.

Every cap is the same on /v1 and on /generate. The body is refused by size before it is read
(413), by JSON depth before it is parsed and by duplicate keys and lone UTF-16 surrogates before it
is validated (400), and a prompt by its size in bytes before it is tokenized (400): tokenizing 15 MB
of text takes the tokenizer worker seconds, during which nobody else's request moves.

`parse_json` is the one parser of client JSON text: the body, and every string field the server
parses as JSON (tool-call arguments, guided_json, structured_outputs.json, /generate's json_schema).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from itertools import accumulate
from typing import Any, Dict, List, Tuple

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


def check_json_tree(data: Any, max_depth: int, param: str | None = None) -> None:
    """Refuse objects nested deeper than `max_depth`, objects with a duplicate key (from
    `parse_json`) and strings holding a lone UTF-16 surrogate (JSON's `"\\ud800"` decodes to one;
    it cannot be encoded as UTF-8, so no process could pass it on). Errors name `param`, or for a
    whole body the top-level field they are in. Iterative: a hostile value cannot exhaust the stack."""
    stack: list[tuple[Any, int, str | None]] = [(data, 1, param)]
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
        if isinstance(value, _DuplicateKeys):
            raise InvalidRequest(
                f"the key {value.duplicate!r} appears twice in one JSON object: send each key once",
                param=top if top is not None else value.duplicate,
                code="invalid_json",
            )
        if isinstance(value, dict):
            for key, item in value.items():
                here = top if top is not None else key
                stack.append((key, depth + 1, here))
                stack.append((item, depth + 1, here))
        else:
            stack.extend((item, depth + 1, top) for item in value)


class MalformedJSON(InvalidRequest):
    """Text that is not JSON at all (a tool call's arguments may then be kept as plain text)."""


# JSON string literals (escapes included), and the runs of other non-brackets between them: no
# bracket in there nests anything. An unterminated string runs to the end (a lone backslash last
# included), so the pattern matches wherever it is tried: failing there, the search would retry at
# each later quote, escaped ones too, and `"\"\"\"...` would cost quadratic time. Possessive
# quantifiers never backtrack, and a match covers whole runs of strings (`"a","b",...` is one), so
# the scan is one linear pass in C, about as fast as json.loads.
_STRING = rb'"[^"\\]*+(?:\\.[^"\\]*+)*+(?:"|\\?\Z)'
_JSON_STRINGS = re.compile(_STRING + rb'(?:[^"\[\]{}]*+' + _STRING + rb")*+", re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_DEPTH_STEP = [1 if b in b"[{" else -1 if b in b"]}" else 0 for b in range(256)]
_JSON_SPACE = re.compile(r"[ \t\n\r]*")


def json_depth(text: str | bytes | bytearray) -> int:
    """How deep JSON text nests arrays and objects, found without parsing it. json.loads, pydantic,
    a chat template and msgpack all recurse once per level, so this must come first; every step
    here is a C loop (a regex, bytes.translate, accumulate): linear time, no stack."""
    data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else bytes(text)
    brackets = _JSON_STRINGS.sub(b"", data).translate(None, _NOT_BRACKETS)
    return max(accumulate(map(_DEPTH_STEP.__getitem__, brackets)), default=0)


def parse_json(text: str | bytes | bytearray, param: str | None, what: str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """`text` parsed, or InvalidRequest naming `param`: nested deeper than `max_depth` (checked
    before parsing), a key twice in one object (json.loads would keep the last one silently, as
    with logit_bias {"10": 1, "10": -100}) or a lone surrogate; MalformedJSON if it is not JSON.
    With `param` None (the request body) a too deep body names its top-level field."""
    depth = json_depth(text)
    if depth > max_depth:
        if param is None:
            param = _deep_member(text, max_depth)
        raise InvalidRequest(f"{what} is nested {depth} levels deep, more than the limit of {max_depth}", param=param, code="invalid_json")
    try:
        value = json.loads(text, object_pairs_hook=_unique_keys)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise MalformedJSON(f"{what} is not valid JSON: {exc}", param=param, code="invalid_json") from None
    check_json_tree(value, max_depth, param)
    return value


class _DuplicateKeys(dict):
    """An object in which `duplicate` appeared more than once (refused by check_json_tree, which
    knows which field it sits in)."""

    def __init__(self, pairs: List[Tuple[str, Any]], duplicate: str) -> None:
        super().__init__(pairs)
        self.duplicate = duplicate


def _unique_keys(pairs: List[Tuple[str, Any]]) -> Dict[str, Any]:
    obj = dict(pairs)
    if len(obj) == len(pairs):
        return obj
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            return _DuplicateKeys(pairs, key)
        seen.add(key)
    raise AssertionError("unreachable")


def _deep_member(text: str | bytes | bytearray, max_depth: int) -> str | None:
    """The top-level key of a too deep JSON object whose value is too deep (None if there is no
    such object): only on the error path, to name the field. The C decoder it uses stops at
    Python's recursion limit with a RecursionError, never a crash."""
    try:
        s = text.decode("utf-8") if isinstance(text, (bytes, bytearray)) else text
    except UnicodeDecodeError:
        return None
    decoder = json.JSONDecoder()
    pos = _skip_space(s, 0)
    if not s.startswith("{", pos):
        return None
    pos += 1
    while True:
        try:
            key, pos = decoder.raw_decode(s, _skip_space(s, pos))
            pos = _skip_space(s, pos)
            if not isinstance(key, str) or not s.startswith(":", pos):
                return None
            start = _skip_space(s, pos + 1)
            _, end = decoder.raw_decode(s, start)
        except RecursionError:
            return key
        except ValueError:
            return None
        if json_depth(s[start:end]) >= max_depth:  # the member's value sits one level below the body
            return key
        pos = _skip_space(s, end)
        if not s.startswith(",", pos):
            return None
        pos += 1


def _skip_space(s: str, pos: int) -> int:
    match = _JSON_SPACE.match(s, pos)
    return match.end() if match else pos
