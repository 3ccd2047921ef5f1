"""The request body of POST /v1/responses (OpenAI's Responses API), and its translation into the
chat request it means.

A Responses request is a chat request in other clothes: `input` items are chat messages,
`instructions` a leading system message, function tools and `tool_choice` the chat ones in a
flatter shape, `text.format` chat's `response_format`, `max_output_tokens` chat's
`max_completion_tokens`. `to_chat_request` builds that `ChatCompletionRequest`, so the chat
template, the tool parser, the grammars and every sampling check are the chat route's own.

The state this API keeps at OpenAI (`previous_response_id`, `conversation`, `background` runs,
item references) does not exist here and is refused by name; so are built-in tools and image,
file and audio inputs. Typing is as strict as on chat (protocol.py).
"""

from __future__ import annotations

from typing import Annotated, Any, Dict, List, Literal, Optional, Union

from pydantic import Field, ValidationError, field_validator, model_validator

from minisgl.sampling_params import INT64_MAX, MAX_LOGIT_BIAS_ENTRIES, MAX_STOP_TOKEN_IDS, InvalidRequest
from minisgl.server.protocol import (
    IGNORED_FIELDS,
    MAX_MESSAGES,
    MAX_METADATA_ENTRIES,
    MAX_METADATA_KEY_CHARS,
    MAX_METADATA_VALUE_CHARS,
    CalledFunction,
    ChatCompletionRequest,
    ChatMessage,
    Int64,
    MaxTokens,
    MessageToolCall,
    MinP,
    Penalty,
    RepetitionPenalty,
    ShortStr,
    StopStrings,
    Temperature,
    TokenId,
    TopK,
    TopP,
    _Base,
    is_unset,
)

# Responses fields minisgl does not implement: refused (400 unsupported_parameter) when they ask
# for something, accepted when null/false/empty.
UNSUPPORTED_RESPONSES_FIELDS = (
    "conversation", "prompt", "include", "max_tool_calls", "top_logprobs", "context_management",
)  # fmt: skip

NOT_STORED = "responses are not stored on this server; send the whole conversation in input"
TEXT_PARTS = ("input_text", "output_text")
MAX_ITEM_CHARS = 1 << 24  # one text; the body limit (--max-request-bytes) is the real bound


class FunctionTool(_Base):
    """A function tool in the Responses shape (chat nests the same fields under `function`)."""

    type: Literal["function"]
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    description: Optional[str] = None
    parameters: Optional[Dict[str, Any]] = None
    strict: Optional[bool] = None

    def to_chat(self) -> Dict[str, Any]:
        return {"type": "function", "function": self.model_dump(exclude={"type"}, exclude_none=True)}


class NamedFunctionChoice(_Base):
    type: Literal["function"]
    name: ShortStr


class TextFormat(_Base):
    """`text.format`: free text, any JSON object, or JSON matching `schema`."""

    type: Literal["text", "json_object", "json_schema"]
    name: Optional[ShortStr] = None
    description: Optional[str] = None
    schema_: Optional[Dict[str, Any]] = Field(None, alias="schema")
    strict: Optional[bool] = None

    @model_validator(mode="after")
    def _check(self) -> "TextFormat":
        if self.type == "json_schema" and self.schema_ is None:
            raise ValueError("format json_schema needs schema")
        return self

    def to_response_format(self) -> Dict[str, Any]:
        if self.type != "json_schema":
            return {"type": self.type}
        schema = {"name": self.name, "description": self.description, "schema": self.schema_, "strict": self.strict}
        return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items() if v is not None}}

    def to_openai(self) -> Dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_none=True)


class TextConfig(_Base):
    format: Optional[TextFormat] = None
    verbosity: Optional[Literal["low", "medium", "high"]] = None  # accepted and logged, as on chat


class StreamOptions(_Base):
    # OpenAI pads delta events with random text against side channels; minisgl sends none
    include_obfuscation: bool = True


# ---- input items ----------------------------------------------------------------------------------


class MessageItem(_Base):
    """A message: EasyInputMessage (`type` optional), an input message item, or an earlier output
    message passed back (with its `id`, `status`, `annotations`)."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Union[Annotated[str, Field(max_length=MAX_ITEM_CHARS)], List[Dict[str, Any]]]
    id: Optional[ShortStr] = None
    status: Optional[Literal["in_progress", "completed", "incomplete"]] = None
    phase: Optional[Literal["commentary", "final_answer"]] = None


class FunctionCallItem(_Base):
    type: Literal["function_call"]
    call_id: ShortStr
    name: ShortStr
    arguments: str  # JSON text
    id: Optional[ShortStr] = None
    status: Optional[Literal["in_progress", "completed", "incomplete"]] = None


class FunctionCallOutputItem(_Base):
    type: Literal["function_call_output"]
    call_id: ShortStr
    output: Union[Annotated[str, Field(max_length=MAX_ITEM_CHARS)], List[Dict[str, Any]]]
    id: Optional[ShortStr] = None
    status: Optional[Literal["in_progress", "completed", "incomplete"]] = None


class ReasoningItem(_Base):
    """An earlier reasoning output passed back: its `reasoning_text` becomes the next assistant
    message's reasoning_content (templates that render earlier thoughts read it: GPT-OSS's before
    a tool call; the others drop it themselves); summaries and encrypted content are not read."""

    type: Literal["reasoning"]
    id: Optional[ShortStr] = None
    summary: List[Dict[str, Any]] = []
    content: Optional[List[Dict[str, Any]]] = None
    encrypted_content: Optional[str] = None
    status: Optional[Literal["in_progress", "completed", "incomplete"]] = None


InputItem = Union[MessageItem, FunctionCallItem, FunctionCallOutputItem, ReasoningItem]
_ITEM_TYPES: Dict[str, type[_Base]] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
    "reasoning": ReasoningItem,
}


def _parse_item(index: int, raw: Any) -> InputItem:
    if not isinstance(raw, dict):
        raise ValueError(f"item {index} must be an object, got {type(raw).__name__}")
    kind = raw.get("type", "message")
    if kind == "item_reference":
        raise ValueError(f"item {index} is an item_reference: {NOT_STORED}")
    model = _ITEM_TYPES.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise ValueError(f"item {index} has type {kind!r}: minisgl takes message, function_call, function_call_output and reasoning items")
    try:
        return model.model_validate(raw)  # type: ignore[return-value]
    except ValidationError as exc:  # named by its place in input, not by pydantic's union tags
        first = exc.errors()[0]
        loc = [p for p in first.get("loc", ()) if isinstance(p, int) or not ("[" in p or "-" in p or p == "str")]
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc)
        raise ValueError(f"item {index}{where}: {first.get('msg', 'invalid value')}") from None


def _text_of(parts: Union[str, List[Dict[str, Any]]], where: str) -> str:
    """The text of a content list; a part that is not text (an image, a file, audio) is refused."""
    if isinstance(parts, str):
        return parts
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type")
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise InvalidRequest(
                f"{where}[{j}] has type {kind!r}: minisgl takes only text parts ({', '.join(TEXT_PARTS)}); "
                "image, file and audio inputs are not supported",
                param="input",
            )
        texts.append(part["text"])
    return "".join(texts)


# ---- the request ----------------------------------------------------------------------------------


class ReasoningConfig(_Base):
    """`reasoning`: the effort goes to the chat template as chat's reasoning_effort; summaries are
    not written here (refused when asked for)."""

    effort: Optional[Literal["low", "medium", "high"]] = None
    summary: Optional[Literal["auto", "concise", "detailed"]] = None


class ResponsesRequest(_Base):
    model: Optional[ShortStr] = None
    input: Union[Annotated[str, Field(min_length=1, max_length=MAX_ITEM_CHARS)], List[InputItem]]
    instructions: Optional[Annotated[str, Field(max_length=MAX_ITEM_CHARS)]] = None
    max_output_tokens: Optional[MaxTokens] = None
    temperature: Optional[Temperature] = None
    top_p: Optional[TopP] = None
    tools: Optional[Annotated[List[FunctionTool], Field(max_length=128)]] = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedFunctionChoice, None] = None
    parallel_tool_calls: Optional[bool] = None
    text: Optional[TextConfig] = None
    reasoning: Optional[ReasoningConfig] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    # refused by name in the route (the message says why): nothing is stored, nothing runs detached
    previous_response_id: Optional[ShortStr] = None
    background: Optional[bool] = None
    truncation: Optional[Literal["disabled"]] = None  # "auto" would drop input: not implemented
    # IGNORED_FIELDS: accepted, logged, no effect (store: true stores nothing)
    user: Optional[ShortStr] = None
    prompt_cache_key: Optional[ShortStr] = None
    safety_identifier: Optional[ShortStr] = None
    service_tier: Optional[Literal["auto", "default"]] = None
    store: Optional[bool] = None
    metadata: Optional[
        Annotated[
            Dict[Annotated[str, Field(max_length=MAX_METADATA_KEY_CHARS)], Annotated[str, Field(max_length=MAX_METADATA_VALUE_CHARS)]],
            Field(max_length=MAX_METADATA_ENTRIES),
        ]
    ] = None
    # the sampling extras chat takes (vLLM/SGLang names), under the same bounds
    top_k: Optional[TopK] = None
    min_p: Optional[MinP] = None
    seed: Optional[Int64] = None
    stop: StopStrings = None
    stop_token_ids: Optional[Annotated[List[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)]] = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: RepetitionPenalty = 1.0
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0, le=INT64_MAX)] = 0
    logit_bias: Optional[Annotated[Dict[Annotated[str, Field(max_length=24)], float], Field(max_length=MAX_LOGIT_BIAS_ENTRIES)]] = None
    priority: Annotated[int, Field(ge=-(2**31), le=2**31 - 1)] = 0
    chat_template_kwargs: Optional[Dict[ShortStr, Union[bool, int, float, Annotated[str, Field(max_length=4096)], None]]] = None

    @field_validator("input", mode="before")
    @classmethod
    def _items(cls, v: Any) -> Any:
        if isinstance(v, list):
            if not v:
                raise ValueError("input is empty")
            if len(v) > MAX_MESSAGES:
                raise ValueError(f"at most {MAX_MESSAGES} input items")
            return [_parse_item(i, raw) for i, raw in enumerate(v)]
        return v

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools_only(cls, v: Any) -> Any:
        for i, tool in enumerate(v if isinstance(v, list) else []):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise ValueError(f"item {i} is a {kind!r} tool: minisgl runs function tools only (built-in tools are not supported)")
        return v

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _function_choice_only(cls, v: Any) -> Any:
        if isinstance(v, dict) and v.get("type") != "function":
            raise ValueError(f"{{'type': {v.get('type')!r}}} is not supported: give none, auto, required or a function")
        return v

    def check(self) -> None:
        """What the schema cannot say, refused by name: state kept between requests, a tool
        choice without tools."""
        if self.previous_response_id is not None:
            raise InvalidRequest(f"previous_response_id: {NOT_STORED}", param="previous_response_id", code="unsupported_parameter")
        if self.background:
            raise InvalidRequest(
                "background responses are not supported: send the request without background and wait (or stream)",
                param="background",
                code="unsupported_parameter",
            )
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            raise InvalidRequest("tool_choice needs tools", param="tool_choice")
        if self.reasoning is not None and self.reasoning.summary is not None:
            raise InvalidRequest(
                "reasoning.summary: reasoning summaries are not written by this server (the reasoning item holds the text itself)",
                param="reasoning",
                code="unsupported_parameter",
            )

    def ignored_fields(self) -> List[str]:
        """The accepted fields that change nothing, as set by this request (for log_ignored)."""
        names = [n for n in IGNORED_FIELDS if n in self.model_fields_set and not is_unset(getattr(self, n, None))]
        if self.text is not None and self.text.verbosity is not None:
            names.append("text.verbosity")
        options = self.stream_options
        if options is not None and "include_obfuscation" in options.model_fields_set and options.include_obfuscation:
            names.append("stream_options.include_obfuscation")
        return names

    def chat_messages(self) -> List[ChatMessage]:
        """`instructions` and `input` as chat messages: consecutive function_call items (and the
        assistant text before them) are one assistant message with tool_calls, each
        function_call_output a tool message, a reasoning item's text the reasoning_content of the
        assistant message it precedes."""
        out: List[ChatMessage] = []
        thought: str | None = None  # a reasoning item's text, for the next assistant message
        if self.instructions:
            out.append(ChatMessage(role="system", content=self.instructions))
        if isinstance(self.input, str):
            return out + [ChatMessage(role="user", content=self.input)]
        for i, item in enumerate(self.input):
            if isinstance(item, ReasoningItem):
                parts = [p.get("text") for p in item.content or [] if p.get("type") == "reasoning_text"]
                thought = "".join(p for p in parts if isinstance(p, str)) or thought
                continue
            if isinstance(item, MessageItem):
                out.append(ChatMessage(role=item.role, content=_text_of(item.content, f"input[{i}].content")))
            elif isinstance(item, FunctionCallItem):
                try:  # (the arguments are parsed here, depth-checked: name the item, not a chat field)
                    function = CalledFunction(name=item.name, arguments=item.arguments)
                except ValidationError as exc:
                    reason = exc.errors()[0]["msg"].removeprefix("Value error, ")
                    raise InvalidRequest(f"input[{i}].arguments: {reason}", param=f"input[{i}].arguments") from None
                call = MessageToolCall(id=item.call_id, function=function)
                last = out[-1] if out else None
                if last is not None and last.role == "assistant":
                    last.tool_calls = [*(last.tool_calls or []), call]
                else:
                    out.append(ChatMessage(role="assistant", content="", tool_calls=[call]))
            elif isinstance(item, FunctionCallOutputItem):
                out.append(ChatMessage(role="tool", tool_call_id=item.call_id, content=_text_of(item.output, f"input[{i}].output")))
            last = out[-1] if out else None
            if last is not None and last.role == "assistant" and thought is not None and last.reasoning_content is None:
                last.reasoning_content = thought
            thought = None
        if not out:
            raise InvalidRequest("input holds no message (only reasoning items)", param="input")
        return out

    def to_chat_request(self) -> ChatCompletionRequest:
        """The chat request this one means (n = 1; streaming is the route's business)."""
        extras = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "presence_penalty", "frequency_penalty",
                  "repetition_penalty", "ignore_eos", "min_tokens", "logit_bias", "priority", "chat_template_kwargs", "parallel_tool_calls")  # fmt: skip
        fields: Dict[str, Any] = {name: getattr(self, name) for name in extras if name in self.model_fields_set}
        fields["messages"] = self.chat_messages()
        fields["max_completion_tokens"] = self.max_output_tokens
        if self.tools:
            fields["tools"] = [t.to_chat() for t in self.tools]
        if isinstance(self.tool_choice, NamedFunctionChoice):
            fields["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            fields["tool_choice"] = self.tool_choice
        if self.text is not None and self.text.format is not None:
            fields["response_format"] = self.text.format.to_response_format()
        if self.reasoning is not None and self.reasoning.effort is not None:
            fields["reasoning_effort"] = self.reasoning.effort
        return ChatCompletionRequest.model_validate(fields)

    def text_format(self) -> Dict[str, Any]:
        return self.text.format.to_openai() if self.text is not None and self.text.format is not None else {"type": "text"}
