"""Tool calling: how each model family writes a call, reading calls out of the output, and the
grammar that makes a model call a tool when `tool_choice` says it must.

A parser knows one format:
- `hermes` (Qwen2.5 / Qwen3, Hermes, and our default): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  one block per call, text around them is content.
- `llama3_json` (Llama 3.1+): the whole output is `{"name": ..., "parameters": {...}}` (optionally
  after `<|python_tag|>`), several separated by `;`.
- `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`.

`auto` picks by the chat template (its own call syntax), else hermes. A template that does not
render `tools` at all (many small models' templates) gets the tool list and the expected call
syntax as a system message, so the definitions always reach the model: never silently dropped.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Dict, List, Tuple

from minisgl.sampling_params import GrammarSpec


@dataclass
class ToolCall:
    name: str
    arguments: Dict[str, Any]

    def to_openai(self, index: int | None = None) -> Dict[str, Any]:
        call: Dict[str, Any] = {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": self.name, "arguments": json.dumps(self.arguments, ensure_ascii=False)},
        }
        if index is not None:
            call["index"] = index
        return call


def _as_call(obj: Any, args_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    return ToolCall(obj["name"], args) if isinstance(args, dict) else None


class ToolParser:
    name = ""
    markers: Tuple[str, ...] = ()  # text that starts a call (streams hold text from here on)
    skip_special_tokens = True

    def parse(self, text: str) -> Tuple[str, List[ToolCall]]:
        """(content, calls) of a finished output; text that is not a well-formed call is content."""
        raise NotImplementedError

    def call_grammar(self, schema: Dict[str, Any]) -> GrammarSpec:
        """The grammar of exactly one call whose JSON matches `schema`."""
        raise NotImplementedError

    def call_schema(self, tools: List[Dict[str, Any]]) -> Dict[str, Any]:
        args_key = "parameters" if self.name == "llama3_json" else "arguments"
        options = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": t["function"]["name"]},
                    args_key: t["function"].get("parameters") or {"type": "object"},
                },
                "required": ["name", args_key],
                "additionalProperties": False,
            }
            for t in tools
        ]
        return options[0] if len(options) == 1 else {"anyOf": options}

    def format_hint(self) -> str:
        raise NotImplementedError


class HermesParser(ToolParser):
    name = "hermes"
    markers = ("<tool_call>",)
    _block = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> Tuple[str, List[ToolCall]]:
        calls: List[ToolCall] = []
        content = text
        for match in self._block.finditer(text):
            try:
                call = _as_call(json.loads(match.group(1)), "arguments")
            except json.JSONDecodeError:
                call = None
            if call is not None:
                calls.append(call)
                content = content.replace(match.group(0), "", 1)
        return (content.strip() if calls else text), calls

    def call_grammar(self, schema: Dict[str, Any]) -> GrammarSpec:
        return GrammarSpec("tool_call", json.dumps({"prefix": "<tool_call>\n", "schema": schema, "suffix": "\n</tool_call>"}))

    def format_hint(self) -> str:
        return (
            'To call a function, reply with <tool_call>{"name": <function name>, "arguments": <arguments as a JSON '
            "object>}</tool_call> (one block per call)."
        )


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    markers = ("<|python_tag|>",)

    def parse(self, text: str) -> Tuple[str, List[ToolCall]]:
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return text, []
        calls = []
        for part in body.split(";"):
            try:
                call = _as_call(json.loads(part), "parameters")
            except json.JSONDecodeError:
                return text, []
            if call is None:
                return text, []
            calls.append(call)
        return "", calls

    def call_grammar(self, schema: Dict[str, Any]) -> GrammarSpec:
        return GrammarSpec("tool_call", json.dumps({"prefix": "", "schema": schema, "suffix": ""}))

    def format_hint(self) -> str:
        return 'To call a function, reply with only {"name": <function name>, "parameters": <arguments as a JSON object>}.'


class MistralParser(ToolParser):
    name = "mistral"
    markers = ("[TOOL_CALLS]",)
    skip_special_tokens = False  # [TOOL_CALLS] is a special token

    def parse(self, text: str) -> Tuple[str, List[ToolCall]]:
        head, sep, tail = text.partition("[TOOL_CALLS]")
        if not sep:
            return text, []
        try:
            items = json.loads(tail.strip())
        except json.JSONDecodeError:
            return text, []
        items = items if isinstance(items, list) else [items]
        calls = [c for c in (_as_call(i, "arguments") for i in items) if c is not None]
        return (head.strip(), calls) if calls else (text, [])

    def call_grammar(self, schema: Dict[str, Any]) -> GrammarSpec:
        return GrammarSpec("tool_call", json.dumps({"prefix": "[TOOL_CALLS][", "schema": schema, "suffix": "]"}))

    def format_hint(self) -> str:
        return 'To call functions, reply with [TOOL_CALLS][{"name": <function name>, "arguments": <arguments as a JSON object>}, ...].'


PARSERS: Dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)}


def pick_parser(name: str, chat_template: str | None) -> ToolParser:
    """`name` from --tool-call-parser; `auto` reads the call syntax off the chat template."""
    if name != "auto":
        if name not in PARSERS:
            raise ValueError(f"unknown tool-call parser {name!r}; choose one of {sorted(PARSERS)} or auto")
        return PARSERS[name]()
    template = chat_template or ""
    if "[TOOL_CALLS]" in template:
        return MistralParser()
    if "<|python_tag|>" in template and "<tool_call>" not in template:
        return Llama3JsonParser()
    return HermesParser()


def template_renders_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in (chat_template or "")


def tools_system_message(tools: List[Dict[str, Any]], parser: ToolParser) -> Dict[str, str]:
    """For templates that ignore `tools`: the definitions and the call syntax as a system message."""
    listing = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    return {"role": "system", "content": f"You can call these functions:\n{listing}\n{parser.format_hint()}"}


class ToolStream:
    """Streams a choice's content while holding back anything that may be a tool call; the calls
    are parsed when the choice finishes."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self.sent = 0
        self.holding = False  # a marker (or, for llama3_json, a leading "{") was seen

    def feed(self, delta: str) -> str:
        self.text += delta
        if self.holding:
            return ""
        if isinstance(self.parser, Llama3JsonParser) and self.text.lstrip()[:1] in ("{", "<"):
            self.holding = True
            return ""
        cut = len(self.text)
        for marker in self.parser.markers:
            pos = self.text.find(marker, self.sent)
            if pos != -1:
                self.holding, cut = True, min(cut, pos)
        if not self.holding:  # a marker may be arriving: hold a tail that starts one
            for marker in self.parser.markers:
                for k in range(min(len(marker) - 1, len(self.text) - self.sent), 0, -1):
                    if self.text.endswith(marker[:k]):
                        cut = min(cut, len(self.text) - k)
                        break
        out = self.text[self.sent : cut]
        self.sent = max(self.sent, cut)
        return out

    def finish(self) -> Tuple[str, List[ToolCall]]:
        """(content not yet sent, calls)."""
        content, calls = self.parser.parse(self.text)
        if calls:
            already = self.text[: self.sent]
            rest = content[len(already) :] if content.startswith(already) else ""
            return rest, calls
        return self.text[self.sent :], []
