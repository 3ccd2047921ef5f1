"""Tool calling: how each model family writes a call, reading calls out of the output, and the
grammar that makes a model call a tool when `tool_choice` says it must.

A parser knows one format:
- `hermes` (Qwen2.5 / Qwen3, Hermes, and our default): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  one block per call, text around them is content.
- `llama3_json` (Llama 3.1+): the whole output is `{"name": ..., "parameters": {...}}` (optionally
  after `<|python_tag|>`), several separated by `;`.
- `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`.
- `harmony` (GPT-OSS): a commentary message to `functions.NAME` whose body is the arguments;
  the whole reply is read by `minisgl.server.harmony` (its channels carry reasoning too), chosen
  for a harmony chat template by `routes.common.ServerState`.

`auto` picks by the chat template (its own call syntax), else hermes. A template that does not
render `tools` at all (many small models' templates) gets the tool list and the expected call
syntax as a system message, so the definitions always reach the model: never silently dropped.

`tool_turn_grammar` is the constraint of a turn with tools (docs/SERVER.md, "Tools and output
formats"): forced calls (`required` or a named function) are one call, or one or more with
`parallel_tool_calls`, in the parser's syntax; a response_format (or guided_*) beside tools
allows either those calls or the answer in that format.
"""

from __future__ import annotations

import json
import re
from typing import Any, Dict, List, Tuple

from minisgl.sampling_params import GrammarSpec
from minisgl.server.tool_call import ToolCall


def _as_call(obj: Any, args_key: str) -> ToolCall | None:
    # a call names its arguments: an answer that merely has a "name" field is content, not a call
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not ({"arguments", "parameters"} & obj.keys()):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters")))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except (json.JSONDecodeError, RecursionError):  # model output nested past the recursion limit is text
            return None
    return ToolCall(obj["name"], args) if isinstance(args, dict) else None


class ToolParser:
    name = ""
    markers: Tuple[str, ...] = ()  # text that starts a call (streams hold text from here on)
    skip_special_tokens = True
    forces_calls = True  # tool_choice required / named can constrain the output to its calls (tool_turn_grammar)
    args_key = "arguments"
    # How the format writes calls: prefix, then each call's JSON between begin and end, calls
    # separated by separator, then suffix (the grammar of forced calls is built from these).
    prefix = ""
    begin = ""
    end = ""
    separator = ""
    suffix = ""

    def parse(self, text: str) -> Tuple[str, List[ToolCall]]:
        """(content, calls) of a finished output; text that is not a well-formed call is content."""
        raise NotImplementedError

    def call_schema(self, tool: Dict[str, Any]) -> Dict[str, Any]:
        """The JSON schema of one call of `tool` in this format."""
        return {
            "type": "object",
            "properties": {
                "name": {"const": tool["function"]["name"]},
                self.args_key: tool["function"].get("parameters") or {"type": "object"},
            },
            "required": ["name", self.args_key],
            "additionalProperties": False,
        }

    def format_hint(self) -> str:
        raise NotImplementedError


class HermesParser(ToolParser):
    name = "hermes"
    markers = ("<tool_call>",)
    begin, end, separator = "<tool_call>\n", "\n</tool_call>", "\n"
    _block = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> Tuple[str, List[ToolCall]]:
        calls: List[ToolCall] = []
        content = text
        for match in self._block.finditer(text):
            try:
                call = _as_call(json.loads(match.group(1)), "arguments")
            except (json.JSONDecodeError, RecursionError):  # model output nested past the recursion limit is text
                call = None
            if call is not None:
                calls.append(call)
                content = content.replace(match.group(0), "", 1)
        return (content.strip() if calls else text), calls

    def format_hint(self) -> str:
        return (
            'To call a function, reply with <tool_call>{"name": <function name>, "arguments": <arguments as a JSON '
            "object>}</tool_call> (one block per call)."
        )


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    markers = ("<|python_tag|>",)

    args_key = "parameters"
    separator = ";"
    _decoder = json.JSONDecoder()

    def parse(self, text: str) -> Tuple[str, List[ToolCall]]:
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return text, []
        calls = []
        at = 0
        while True:  # JSON objects separated by ";" (a ";" inside a string separates nothing)
            try:
                obj, at = self._decoder.raw_decode(body, at)
            except (json.JSONDecodeError, RecursionError):  # model output nested past the recursion limit is text
                return text, []
            call = _as_call(obj, "parameters")
            if call is None:
                return text, []
            calls.append(call)
            rest = body[at:].lstrip()
            if not rest:
                return "", calls
            if not rest.startswith(";"):
                return text, []
            at = len(body) - len(rest[1:].lstrip())

    def format_hint(self) -> str:
        return 'To call a function, reply with only {"name": <function name>, "parameters": <arguments as a JSON object>}.'


class MistralParser(ToolParser):
    name = "mistral"
    markers = ("[TOOL_CALLS]",)
    skip_special_tokens = False  # [TOOL_CALLS] is a special token
    prefix, separator, suffix = "[TOOL_CALLS][", ", ", "]"

    def parse(self, text: str) -> Tuple[str, List[ToolCall]]:
        head, sep, tail = text.partition("[TOOL_CALLS]")
        if not sep:
            return text, []
        try:
            items = json.loads(tail.strip())
        except (json.JSONDecodeError, RecursionError):  # model output nested past the recursion limit is text
            return text, []
        items = items if isinstance(items, list) else [items]
        calls = [c for c in (_as_call(i, "arguments") for i in items) if c is not None]
        return (head.strip(), calls) if calls else (text, [])

    def format_hint(self) -> str:
        return 'To call functions, reply with [TOOL_CALLS][{"name": <function name>, "arguments": <arguments as a JSON object>}, ...].'


class HarmonyParser(ToolParser):
    name = "harmony"
    markers = ("<|start|>",)
    skip_special_tokens = False  # the channel markers are special tokens
    forces_calls = False  # the function's name is in the message header, outside any call JSON

    def parse(self, text: str) -> Tuple[str, List[ToolCall]]:
        from minisgl.server import harmony

        _, content, calls = harmony.parse(text)
        return content, calls

    def format_hint(self) -> str:
        return (
            "To call a function, write a commentary message to it: <|start|>assistant<|channel|>commentary "
            "to=functions.<function name> <|constrain|>json<|message|><arguments as a JSON object><|call|>"
        )


PARSERS: Dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser, HarmonyParser)}


def pick_parser(name: str, chat_template: str | None) -> ToolParser:
    """`name` from --tool-call-parser; `auto` reads the call syntax off the chat template (a harmony
    template is `ServerState`'s to resolve: its parser reads reasoning as well)."""
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


def tool_turn_grammar(
    parser: ToolParser,
    tools: List[Dict[str, Any]],
    declared: List[str],
    *,
    must_call: bool,
    parallel: bool,
    answer: GrammarSpec | None,
    after_tool_result: bool,
) -> GrammarSpec | None:
    """The output constraint of a chat turn with `tools` (the active ones; `declared`: the names
    of the request's tools in order, so that a bad schema is refused as `tools[i]`).

    - forced (`required` / a named function): the calls alone; one or more with `parallel`,
      exactly one without. With an `answer` format too, the turn right after a tool result is the
      answer instead: the calls were made, their results are in, the format is for the reply
      (without that the model could only ever call again).
    - `auto` with an `answer` format: either the calls or the answer.
    - `auto` alone: free text (None), the calls are parsed out of it.
    """
    if must_call and answer is not None and after_tool_result:
        return answer
    if not must_call and answer is None:
        return None
    calls = [
        {"param": f"tools[{declared.index(t['function']['name'])}].function.parameters", "schema": parser.call_schema(t)} for t in tools
    ]
    turn = {
        "calls": calls,
        "prefix": parser.prefix,
        "begin": parser.begin,
        "end": parser.end,
        "separator": parser.separator,
        "suffix": parser.suffix,
        "parallel": parallel,
        "answer": None if must_call or answer is None else {"kind": answer.kind, "value": answer.value, "param": answer.param},
    }
    return GrammarSpec("tool_call", json.dumps(turn, ensure_ascii=False), "tools")


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
