"""OpenAI's harmony format (GPT-OSS): the model writes its reply as messages in channels, and this
module reads them back into what the OpenAI API returns.

A message is `<|start|>{header}<|message|>{body}` ended by `<|end|>` (more follows), `<|return|>`
(the last message) or `<|call|>` (a tool call: generation stops for its result). The prompt
already opened the first one (`<|start|>assistant`), so an output starts inside a header. The
header names the channel after `<|channel|>` and, for a tool call, the recipient `to=functions.NAME`
(before or after the channel) with the body's type, `<|constrain|>json` or plain `json`:

    <|channel|>analysis<|message|>thoughts<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}<|call|>
    <|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>

Mapped as: `analysis` -> reasoning_content; `final` -> content; a message with a recipient -> one
tool call (its body, JSON, the arguments; a body that is not a JSON object stays content, as with
the other tool parsers); `commentary` without a recipient (a preamble before calls) -> content.

`HarmonyStream` reads the text as the detokenizer hands it over (markers may be split across
pieces: a tail that may start one is held back) and returns deltas; a finished output is read by
feeding it whole, so a streamed reply adds up to exactly the non-streamed one. It needs the
special tokens in the text: the route detokenizes with skip_special_tokens off, and no marker or
header text ever reaches reasoning or content.

For the prompt side, `template_messages` adapts OpenAI messages to what GPT-OSS's own chat
template reads: an assistant's earlier reasoning as `thinking`, and one tool call per assistant
message (the template renders only the first), each followed by its result; `template_tools`
gives every function the description the template writes. `stop_token_ids` are the ids that end
a turn (<|return|>, <|call|>), added to each request's stop tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Dict, List, Tuple

from minisgl.server.tool_call import ToolCall

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, RETURN, CALL, ENDOFTEXT = "<|end|>", "<|return|>", "<|call|>", "<|endoftext|>"
# what ends a body: `<|start|>` too (a new message whose predecessor lacks its end marker)
BODY_ENDS = (END, RETURN, CALL, ENDOFTEXT, START)
HEADER_ENDS = (END, RETURN, CALL, ENDOFTEXT)  # a header they cut off was abandoned
# A header is a role, a channel and a recipient: longer text with no marker in it is not one (a
# model answering in plain text, or an output constrained by a grammar): it is content.
MAX_HEADER_CHARS = 256
TEMPLATE_MARK = CHANNEL  # a chat template that writes channels is a harmony template
FUNCTIONS = "functions."


def is_harmony_template(chat_template: str | None) -> bool:
    return TEMPLATE_MARK in (chat_template or "") and MESSAGE in (chat_template or "")


def enabled(reasoning_parser: str, tool_call_parser: str, chat_template: str | None) -> bool:
    """Whether replies are read as harmony: either flag says `harmony`, or both are `auto` and the
    chat template is a harmony template. The format carries reasoning and tool calls together, so
    harmony beside another named parser is refused (ValueError naming both flags)."""
    named = {"--reasoning-parser": reasoning_parser, "--tool-call-parser": tool_call_parser}
    if "harmony" not in named.values():
        return is_harmony_template(chat_template) and set(named.values()) == {"auto"}
    others = [f"{flag} {value}" for flag, value in named.items() if value not in ("auto", "harmony")]
    if others:
        raise ValueError(
            f"the harmony parser reads reasoning and tool calls together: {others[0]} cannot go with it "
            "(give --reasoning-parser and --tool-call-parser as harmony or auto)"
        )
    return True


def disabled_warning(reasoning_parser: str, tool_call_parser: str, chat_template: str | None) -> str | None:
    """The start-up warning of a harmony template whose parser a flag turned off, or None."""
    if not is_harmony_template(chat_template) or enabled(reasoning_parser, tool_call_parser, chat_template):
        return None
    return (
        f"the chat template is OpenAI's harmony format (GPT-OSS), and --reasoning-parser {reasoning_parser} "
        f"--tool-call-parser {tool_call_parser} turn its parser off: replies come back whole in `content`"
    )


def stop_token_ids(tokenizer_description: Dict[str, Any] | None) -> List[int]:
    """The ids of <|return|> and <|call|> among the tokenizer's added tokens: a harmony turn ends
    on them. GPT-OSS's generation_config lists both as eos, but copies of the checkpoint with the
    first release's config (eos 200002 and 199999 only) would not stop at a call and go on to
    invent its result; the route adds them to each request's stop tokens."""
    added = (tokenizer_description or {}).get("added_tokens") or {}
    return sorted(int(i) for i, token in added.items() if token in (RETURN, CALL))


@dataclass
class HarmonyDelta:
    reasoning: str = ""
    content: str = ""
    calls: List[ToolCall] = field(default_factory=list)

    def __iadd__(self, other: "HarmonyDelta") -> "HarmonyDelta":
        self.reasoning += other.reasoning
        self.content += other.content
        self.calls += other.calls
        return self


@dataclass
class _Header:
    kind: str  # "reasoning", "content" or "call"
    recipient: str = ""


def parse_header(text: str) -> _Header:
    """What a message is, from the text between `<|start|>` (or the output's start) and `<|message|>`:
    `assistant<|channel|>analysis`, `<|channel|>commentary to=functions.f <|constrain|>json`,
    ` to=functions.f<|channel|>commentary json`, ..."""
    role_part, _, channel_part = text.replace(CONSTRAIN, " ").partition(CHANNEL)
    role_words = role_part.split()
    channel_words = channel_part.split()
    role = role_words[0] if role_words and not role_words[0].startswith("to=") else "assistant"
    recipient = next((w[3:] for w in role_words + channel_words if w.startswith("to=")), "")
    channel = channel_words[0] if channel_words and not channel_words[0].startswith("to=") else ""
    if role == "assistant" and recipient and recipient != "assistant":
        return _Header("call", recipient)
    return _Header("reasoning" if channel == "analysis" else "content")


def _marker_tail(text: str, markers: Tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that starts one of `markers` (held back: the next
    piece may complete it)."""
    for k in range(min(max(len(m) for m in markers) - 1, len(text)), 0, -1):
        tail = text[-k:]
        if tail[0] == "<" and any(m.startswith(tail) for m in markers):
            return k
    return 0


def _as_arguments(body: str) -> Dict[str, Any] | None:
    try:
        value = json.loads(body)
        if isinstance(value, str):  # arguments written as a JSON string of JSON
            value = json.loads(value)
    except (json.JSONDecodeError, RecursionError):  # model output nested past the recursion limit is text
        return None
    return value if isinstance(value, dict) else None


class HarmonyStream:
    """One choice's output, read incrementally. `parse_calls`: the request has tools (without
    them a message to a recipient is content, as other parsers leave calls in the text)."""

    def __init__(self, parse_calls: bool = True) -> None:
        self.parse_calls = parse_calls
        self.buf = ""  # text not consumed yet: a header, a held marker tail, or a call's body
        self.header: _Header | None = None  # the message whose body is being read (None: in a header)
        self.started = {"reasoning": False, "content": False}  # text of that kind already sent
        self.fresh = True  # the message being read has sent nothing yet (a separator goes first)
        self.saw_reasoning = False
        self.saw_marker = False  # past the first header: what reads as a header now is one
        self.calls: List[ToolCall] = []

    def feed(self, text: str) -> HarmonyDelta:
        self.buf += text
        return self._run(final=False)

    def finish(self) -> HarmonyDelta:
        """What is left once the output has ended (at a stop, or cut off anywhere)."""
        return self._run(final=True)

    def _run(self, final: bool) -> HarmonyDelta:
        out = HarmonyDelta()
        while True:
            if self.header is None:
                if not self._read_header(out, final):
                    return out
            elif not self._read_body(out, final):
                return out

    def _read_header(self, out: HarmonyDelta, final: bool) -> bool:
        """Consume a header if one is complete; False when more text is needed."""
        at = self.buf.find(MESSAGE)
        head = self.buf if at == -1 else self.buf[:at]
        # a new <|start|> or an end marker inside the header: what precedes it heads no message
        breaks = [(p, m) for m in (START, *HEADER_ENDS) if (p := head.find(m)) != -1]
        if breaks:
            cut, marker = min(breaks)
            self._stray(self.buf[:cut], out)
            self.buf = self.buf[cut + len(marker) :]
            self.saw_marker = True
            return True
        if at != -1:
            self.header = parse_header(head)
            self.buf = self.buf[at + len(MESSAGE) :]
            self.fresh = self.saw_marker = True
            return True
        if self._plain_text(final):
            self.header = _Header("content")
            self.fresh = True
            return True
        if final:  # cut off inside a header: nothing of it is the reply
            self.buf = ""
        return False

    def _plain_text(self, final: bool) -> bool:
        """Whether the output, markerless so far, is plain text (a model answering outside the
        format, or an output a grammar constrained) rather than a header still arriving."""
        head = self.buf.lstrip()
        if self.saw_marker or "<|" in self.buf or head.startswith("to=") or (head and "to=".startswith(head)):
            return False  # (a header that starts with its recipient: ` to=functions.f<|channel|>...`)
        return final or len(self.buf) > MAX_HEADER_CHARS

    def _stray(self, text: str, out: HarmonyDelta) -> None:
        """Text outside any message (before a <|start|>): kept as content unless it is header text."""
        if text.strip() and "<|" not in text:
            self._emit("content", text, out)

    def _read_body(self, out: HarmonyDelta, final: bool) -> bool:
        assert self.header is not None
        ends = [(p, m) for m in BODY_ENDS if (p := self.buf.find(m)) != -1]
        if ends:
            at, marker = min(ends)
            self._body_text(self.buf[:at], out, done=True)
            self.buf = self.buf[at + (0 if marker == START else len(marker)) :]
            self.header = None
            return True
        if final:
            self._body_text(self.buf, out, done=True)
            self.buf, self.header = "", None
            return False
        if self.header.kind == "call":  # a call's arguments are read whole, at its end
            return False
        keep = _marker_tail(self.buf, BODY_ENDS)
        self._body_text(self.buf[: len(self.buf) - keep], out, done=False)
        self.buf = self.buf[len(self.buf) - keep :]
        return False

    def _body_text(self, text: str, out: HarmonyDelta, done: bool) -> None:
        header = self.header
        assert header is not None
        if header.kind == "reasoning":
            self.saw_reasoning = True
        if header.kind != "call":
            self._emit(header.kind, text, out)
            return
        if not done:
            return
        args = _as_arguments(text.strip()) if self.parse_calls else None
        if args is None:  # not a call this reply can return: its text is content
            self._emit("content", text, out)
            return
        call = ToolCall(header.recipient.removeprefix(FUNCTIONS), args)
        self.calls.append(call)
        out.calls.append(call)

    def _emit(self, kind: str, text: str, out: HarmonyDelta) -> None:
        if not text:
            return
        if self.fresh and self.started[kind]:  # a second message of this kind: set it apart
            text = "\n\n" + text
        self.fresh = False
        self.started[kind] = True
        if kind == "reasoning":
            out.reasoning += text
        else:
            out.content += text


def parse(text: str, parse_calls: bool = True) -> Tuple[str | None, str, List[ToolCall]]:
    """(reasoning or None, content, calls) of a finished output."""
    stream = HarmonyStream(parse_calls)
    out = stream.feed(text)
    out += stream.finish()
    return (out.reasoning if stream.saw_reasoning else None), out.content, out.calls


def template_tools(tools: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Tools as GPT-OSS's template renders them: it writes each function's description as a
    comment line without checking that there is one (a tool without a description, as OpenAI
    allows, would make the template fail), so a missing one is empty."""
    return [{**t, "function": {"description": "", **t["function"]}} for t in tools]


def template_messages(messages: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """OpenAI chat messages as GPT-OSS's chat template reads them (it is the template's format):

    - an assistant's `reasoning_content` is its `thinking` (the template renders it before that
      turn's tool call, and drops it once a final answer follows, as the model was trained);
    - an assistant message with several tool calls becomes one message per call, each followed
      by the tool message that answers it (matched by tool_call_id, else in order): the template
      renders only an assistant message's first call, and names a tool result by the call just
      before it. The reasoning goes with the first call.
    - beside tool calls the template takes the reasoning or the content (a preamble) as that
      turn's analysis, not both: with both, the reasoning is kept.
    """
    out: List[Dict[str, Any]] = []
    i = 0
    while i < len(messages):
        msg = dict(messages[i])
        i += 1
        thinking = msg.pop("reasoning_content", None)
        if msg["role"] != "assistant":
            out.append(msg)
            continue
        if thinking:
            msg["thinking"] = thinking
        calls = msg.get("tool_calls") or []
        if calls and thinking:
            msg["content"] = ""
        if len(calls) <= 1:
            out.append(msg)
            continue
        ids = {c.get("id") for c in calls if c.get("id") is not None}
        results: List[Dict[str, Any]] = []
        while i < len(messages) and messages[i]["role"] == "tool":
            results.append(messages[i])
            i += 1
        for j, call in enumerate(calls):
            part = {k: v for k, v in msg.items() if k not in ("tool_calls", "thinking")}
            if j:
                part["content"] = ""
            elif "thinking" in msg:
                part["thinking"] = msg["thinking"]
            part["tool_calls"] = [call]
            out.append(part)
            answer = next((r for r in results if call.get("id") is not None and r.get("tool_call_id") == call["id"]), None)
            if answer is None:  # a result that names no call of this message answers the next call
                answer = next((r for r in results if r.get("tool_call_id") not in ids), None)
            if answer is not None:
                results.remove(answer)
                out.append(answer)
        out.extend(results)  # answers that match no call stay, in order, after the calls
    return out
