"""Request bodies of the HTTP API (pydantic), and how they become `SamplingParams`.

Typing is strict where OpenAI is strict: a number field takes a JSON number (`"0.5"` is refused),
an integer field a JSON integer (`true`, `5.0` are refused), a boolean a JSON boolean; `NaN`,
`Infinity` and numbers that overflow to infinity (`1e309`) are refused. Every integer is bounded
to int64 here, so nothing unbounded reaches msgpack; ranges that depend on the model (top_k and
token ids below the vocabulary size, max_tokens within the context) are checked by
`SamplingParams.validate` once the body is parsed.

Unknown fields are refused with 400 naming the field (as OpenAI does). Fields of the OpenAI API
that minisgl does not implement (`tools`, `response_format`, `logit_bias`, ...) are refused with a
message that says so when they ask for something; sent as null, false or empty they mean nothing
and are accepted (clients that fill every field with a neutral value keep working).
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Dict, List, Literal, Optional, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from minisgl.sampling_params import (
    INT64_MAX,
    INT64_MIN,
    MAX_GRAMMAR_CHARS,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_LOGPROBS,
    MAX_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TEMPERATURE,
    GrammarSpec,
    InvalidRequest,
    SamplingParams,
)
from minisgl.server.limits import MalformedJSON, parse_json

MAX_N = 64
MAX_CHOICES = 256  # prompts x n of one request
MAX_MESSAGES = 4096
MAX_TEMPLATE_KWARGS = 32
MAX_NAME_CHARS = 256

Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]
Temperature = Annotated[float, Field(ge=0.0, le=MAX_TEMPERATURE)]
Penalty = Annotated[float, Field(ge=-MAX_PENALTY, le=MAX_PENALTY)]
RepetitionPenalty = Annotated[float, Field(gt=0.0, le=MAX_REPETITION_PENALTY)]
TopP = Annotated[float, Field(gt=0.0, le=1.0)]
MinP = Annotated[float, Field(ge=0.0, le=1.0)]
TopK = Annotated[int, Field(ge=-1, le=INT64_MAX)]
MaxTokens = Annotated[int, Field(ge=1, le=INT64_MAX)]
ShortStr = Annotated[str, Field(max_length=MAX_NAME_CHARS)]
StopStr = Annotated[str, Field(max_length=MAX_STOP_CHARS)]


def _check_stop_count(v: Any) -> Any:
    if isinstance(v, list) and len(v) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
    return v


StopStrings = Optional[Annotated[Union[StopStr, List[StopStr]], AfterValidator(_check_stop_count)]]

# OpenAI fields minisgl does not implement: refused when they ask for something.
UNSUPPORTED_CHAT_FIELDS = (
    "functions", "function_call", "prediction", "audio", "web_search_options",
)  # fmt: skip
UNSUPPORTED_COMPLETION_FIELDS: tuple[str, ...] = ()

# OpenAI fields that change nothing minisgl computes (routing hints, bookkeeping, a tier that only
# OpenAI has): accepted on chat and completions when their value is one minisgl can honour by
# doing nothing, and named in one logged warning per request (`ignored_fields`). Their types and
# allowed values are declared on `SamplingFields`; docs/SERVER.md lists them.
IGNORED_FIELDS = ("prompt_cache_key", "safety_identifier", "verbosity", "service_tier", "store", "metadata", "modalities", "user")
MAX_METADATA_ENTRIES = 16  # OpenAI's bounds on `metadata`
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512

# apply_chat_template's own parameters: a client must not set them through chat_template_kwargs
# (a client-side `chat_template` is arbitrary Jinja run in the tokenizer worker).
RESERVED_TEMPLATE_KWARGS = frozenset(
    {"chat_template", "tools", "documents", "tokenize", "return_dict", "return_tensors", "padding", "truncation",
     "max_length", "tokenizer_kwargs", "return_assistant_tokens_mask", "conversation"}
)  # fmt: skip


class _Base(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, protected_namespaces=())


def is_unset(value: Any) -> bool:
    """A value that asks for nothing: null, false, an empty string/list/object, or "none"."""
    return value is None or value is False or value == "none" or (isinstance(value, (str, list, dict)) and not value)


class StreamOptions(_Base):
    include_usage: bool = False
    # vLLM's: every chunk also carries its choice's usage so far (load generators such as
    # guidellm ask for it)
    continuous_usage_stats: bool = False


class JsonSchemaFormat(_Base):
    name: Optional[ShortStr] = None
    description: Optional[str] = None
    schema_: Optional[Dict[str, Any]] = Field(None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(_Base):
    """OpenAI's response_format: free text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None

    def grammar(self) -> Optional[GrammarSpec]:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return GrammarSpec("json_object")
        if self.json_schema is None or self.json_schema.schema_ is None:
            raise InvalidRequest("response_format json_schema needs json_schema.schema", param="response_format")
        return GrammarSpec("json_schema", json.dumps(self.json_schema.schema_))


MAX_GUIDED_CHOICES = 256


class StructuredOutputs(_Base):
    """vLLM's `structured_outputs`: one of json (a schema, or its JSON text), regex, choice, grammar (EBNF)."""

    json_: Union[Annotated[str, Field(max_length=MAX_GRAMMAR_CHARS)], Dict[str, Any], None] = Field(None, alias="json")
    regex: Optional[Annotated[str, Field(max_length=MAX_GRAMMAR_CHARS)]] = None
    choice: Optional[
        Annotated[List[Annotated[str, Field(min_length=1, max_length=MAX_NAME_CHARS)]], Field(min_length=1, max_length=MAX_GUIDED_CHOICES)]
    ] = None
    grammar: Optional[Annotated[str, Field(max_length=MAX_GRAMMAR_CHARS)]] = None


def _guided_grammar(kind: str, value: Any, param: str) -> GrammarSpec:
    """vLLM's guided_json / regex / choice / grammar as the GrammarSpec that /generate would build."""
    if kind == "json":
        if isinstance(value, str):
            parse_json(value, param, f"{param} (a JSON schema)")
            return GrammarSpec("json_schema", value, param)
        return GrammarSpec("json_schema", json.dumps(value), param)
    if kind == "regex":
        return GrammarSpec("regex", value, param)
    if kind == "choice":  # exactly one of the strings: an EBNF alternation of their literals
        return GrammarSpec("ebnf", "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in value), param)
    return GrammarSpec("ebnf", value, param)


def _stop_list(stop: StopStrings) -> List[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop] if stop else []
    return [s for s in stop if s]


class SamplingFields(_Base):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI + vLLM/SGLang extras)."""

    model: Optional[ShortStr] = None
    temperature: Optional[Temperature] = None
    top_p: Optional[TopP] = None
    top_k: Optional[TopK] = None
    min_p: Optional[MinP] = None
    max_tokens: Optional[MaxTokens] = None
    stop: StopStrings = None
    stop_token_ids: Optional[Annotated[List[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)]] = None
    seed: Optional[Int64] = None
    n: int = Field(1, ge=1, le=MAX_N)
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: RepetitionPenalty = 1.0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    # IGNORED_FIELDS: accepted, logged, no effect
    user: Optional[ShortStr] = None
    prompt_cache_key: Optional[ShortStr] = None
    safety_identifier: Optional[ShortStr] = None
    verbosity: Optional[Literal["low", "medium", "high"]] = None
    service_tier: Optional[Literal["auto", "default"]] = None  # "flex", "priority", "scale": OpenAI's alone
    store: Optional[bool] = None  # true is accepted: nothing is stored
    metadata: Optional[
        Annotated[
            Dict[Annotated[str, Field(max_length=MAX_METADATA_KEY_CHARS)], Annotated[str, Field(max_length=MAX_METADATA_VALUE_CHARS)]],
            Field(max_length=MAX_METADATA_ENTRIES),
        ]
    ] = None
    modalities: Optional[Annotated[List[Literal["text"]], Field(max_length=1)]] = None  # text output only
    # vLLM's constrained decoding (at most one of them, nor with response_format; see `grammar`)
    guided_json: Union[Annotated[str, Field(max_length=MAX_GRAMMAR_CHARS)], Dict[str, Any], None] = None
    guided_regex: Optional[Annotated[str, Field(max_length=MAX_GRAMMAR_CHARS)]] = None
    guided_choice: Optional[
        Annotated[List[Annotated[str, Field(min_length=1, max_length=MAX_NAME_CHARS)]], Field(min_length=1, max_length=MAX_GUIDED_CHOICES)]
    ] = None
    guided_grammar: Optional[Annotated[str, Field(max_length=MAX_GRAMMAR_CHARS)]] = None
    structured_outputs: Optional[StructuredOutputs] = None
    # OpenAI: {"token id as a string": bias in [-100, 100]}
    logit_bias: Optional[Annotated[Dict[Annotated[str, Field(max_length=24)], float], Field(max_length=MAX_LOGIT_BIAS_ENTRIES)]] = None
    min_tokens: Annotated[int, Field(ge=0, le=INT64_MAX)] = 0
    include_stop_str_in_output: bool = False
    response_format: Optional[ResponseFormat] = None
    # vLLM's: each choice (and each streamed chunk) carries the ids of its tokens as `token_ids`
    return_token_ids: bool = False
    # vLLM's: lower is admitted first under --schedule-policy priority (FCFS accepts only 0)
    priority: Annotated[int, Field(ge=-(2**31), le=2**31 - 1)] = 0

    def stop_list(self) -> List[str]:
        return _stop_list(self.stop)

    def wants_grammar(self) -> bool:
        return bool(self._constraints())

    def ignored_fields(self) -> List[str]:
        """The IGNORED_FIELDS this request set to something (for the one warning that names them)."""
        return [name for name in IGNORED_FIELDS if name in self.model_fields_set and not is_unset(getattr(self, name))]

    def _constraints(self) -> List[tuple[str, GrammarSpec]]:
        """(the field as the client named it, its grammar) for every constraint the request sets."""
        out: List[tuple[str, GrammarSpec]] = []
        if self.response_format is not None and self.response_format.type != "text":
            spec = self.response_format.grammar()
            assert spec is not None
            out.append(("response_format", spec))
        guided = (("guided_json", self.guided_json), ("guided_regex", self.guided_regex),
                  ("guided_choice", self.guided_choice), ("guided_grammar", self.guided_grammar))  # fmt: skip
        out += [(name, _guided_grammar(name.removeprefix("guided_"), value, name)) for name, value in guided if value is not None]
        if self.structured_outputs is not None:
            so = self.structured_outputs
            given = (("json", so.json_), ("regex", so.regex), ("choice", so.choice), ("grammar", so.grammar))
            out += [(f"structured_outputs.{k}", _guided_grammar(k, v, "structured_outputs")) for k, v in given if v is not None]
        return out

    def grammar(self) -> Optional[GrammarSpec]:
        """The one output constraint of the request (response_format, guided_* or structured_outputs)."""
        given = self._constraints()
        if len(given) > 1:
            names = [name for name, _ in given]
            raise InvalidRequest(f"give at most one output constraint, got {' and '.join(names)}", param=names[0].split(".")[0])
        return given[0][1] if given else None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """Choice 0's parameters (`SamplingParams.for_choice` derives the others)."""
        grammar = self.grammar()
        return _to_sampling_params(self, max_tokens=max_tokens, min_tokens=self.min_tokens, grammar=grammar, logprobs=logprobs)


def _to_sampling_params(
    src: Any,
    *,
    max_tokens: int | None,
    min_tokens: int,
    grammar: Optional[GrammarSpec],
    logprobs: int | None,
    bias_param: str = "logit_bias",
) -> SamplingParams:
    """The fields /v1 and /generate share, under the same names, as one SamplingParams."""
    return SamplingParams(
        temperature=1.0 if src.temperature is None else float(src.temperature),
        top_k=-1 if src.top_k in (None, 0) else int(src.top_k),  # 0 means off, as in vLLM
        top_p=1.0 if src.top_p is None else float(src.top_p),
        min_p=0.0 if src.min_p is None else float(src.min_p),
        max_tokens=max_tokens,
        ignore_eos=src.ignore_eos,
        stop_token_ids=list(src.stop_token_ids or []),
        stop=src.stop_list(),
        include_stop_str_in_output=bool(getattr(src, "include_stop_str_in_output", False) or getattr(src, "no_stop_trim", False)),
        seed=src.seed,
        presence_penalty=float(src.presence_penalty),
        frequency_penalty=float(src.frequency_penalty),
        repetition_penalty=float(src.repetition_penalty),
        logprobs=logprobs,
        logit_bias=_parse_logit_bias(src.logit_bias, bias_param),
        min_tokens=min_tokens,
        grammar=grammar,
        priority=getattr(src, "priority", 0),
    )


# A token id as OpenAI writes it: ASCII decimal without sign, spaces, separators or leading zeros.
# int() also reads " 10", "+10", "1_0" and "١٠" (Arabic-Indic digits), and "010" as 10 (merging two
# keys silently); [0-9] matches ASCII digits only, unlike \d.
_TOKEN_ID_KEY = re.compile(r"0|[1-9][0-9]*")


def _parse_logit_bias(bias: Optional[Dict[str, float]], param: str = "logit_bias") -> Optional[Dict[int, float]]:
    """OpenAI's string keys as token ids (their range is checked by SamplingParams.validate)."""
    if not bias:
        return None
    out: Dict[int, float] = {}
    for key, value in bias.items():
        if not _TOKEN_ID_KEY.fullmatch(key):
            raise InvalidRequest(
                f'{param} keys must be token ids in canonical decimal form ("0", or ASCII digits without a sign, '
                f"spaces, separators or leading zeros), got {key!r}",
                param=param,
            )
        token = int(key)
        if token in out:  # cannot happen with canonical keys; kept so that a bias is never lost silently
            raise InvalidRequest(f"{param} gives token id {token} twice", param=param)
        out[token] = float(value)
    return out


class FunctionDef(_Base):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    description: Optional[str] = None
    parameters: Optional[Dict[str, Any]] = None
    strict: Optional[bool] = None


class ToolDef(_Base):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Base):
    name: ShortStr


class NamedToolChoice(_Base):
    type: Literal["function"]
    function: NamedFunction


class CalledFunction(_Base):
    name: ShortStr
    arguments: str  # JSON text, as OpenAI sends it
    _value: Any = PrivateAttr(None)

    @model_validator(mode="after")
    def _parse_arguments(self) -> "CalledFunction":
        # Parsed once, here, with the depth checked first: chat templates render the arguments as
        # a mapping (`arguments | tojson`); text that is not JSON is rendered as it is.
        try:
            self._value = parse_json(self.arguments, "arguments", "the tool call's arguments")
        except MalformedJSON:
            self._value = self.arguments
        except InvalidRequest as exc:  # pydantic's location ends at `function`: name the field
            raise InvalidRequest(exc.message if exc.message.startswith("the tool call's") else f"arguments: {exc.message}") from None
        return self

    def arguments_value(self) -> Any:
        return self._value


class MessageToolCall(_Base):
    id: Optional[ShortStr] = None
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(_Base):
    role: Literal["system", "user", "assistant", "tool", "developer", "function"]
    content: Union[str, List[Dict[str, Any]], None] = None
    name: Optional[ShortStr] = None
    tool_calls: Optional[Annotated[List[MessageToolCall], Field(max_length=128)]] = None
    tool_call_id: Optional[ShortStr] = None
    # an assistant's earlier reasoning, as this server returns it (`reasoning` is the newer name)
    reasoning_content: Optional[str] = None
    reasoning: Optional[str] = None

    @model_validator(mode="after")
    def _check_reasoning(self) -> "ChatMessage":
        given = [name for name in ("reasoning_content", "reasoning") if getattr(self, name) is not None]
        if given and self.role != "assistant":
            raise ValueError(f"{given[0]} is only for assistant messages, not {self.role!r}")
        if len(given) == 2 and self.reasoning_content != self.reasoning:
            raise ValueError("reasoning_content and reasoning differ: give one of them")
        return self

    def to_template(self) -> Dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            texts = []
            for i, part in enumerate(content):
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError(f"content part {i} has type {part.get('type')!r}: only text parts are supported")
                texts.append(part["text"])
            content = "".join(texts)
        msg: Dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": content or ""}
        if self.name is not None:
            msg["name"] = self.name
        if self.tool_call_id is not None:
            msg["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            msg["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments_value()}}
                for c in self.tool_calls
            ]
        thought = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if thought is not None:  # templates that render earlier thoughts read it (Qwen3; harmony as `thinking`)
            msg["reasoning_content"] = thought
        return msg


TemplateValue = Union[bool, int, float, Annotated[str, Field(max_length=4096)], None]


class ChatCompletionRequest(SamplingFields):
    messages: List[ChatMessage] = Field(..., min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: Optional[MaxTokens] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    # Extra variables for the server's chat template (e.g. enable_thinking): JSON scalars only.
    chat_template_kwargs: Optional[Dict[ShortStr, TemplateValue]] = None
    tools: Optional[Annotated[List[ToolDef], Field(max_length=128)]] = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: Optional[bool] = None
    # OpenAI's: handed to a chat template that takes it (GPT-OSS's), refused otherwise
    reasoning_effort: Optional[Literal["low", "medium", "high"]] = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, v: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
        if v is None:
            return v
        if len(v) > MAX_TEMPLATE_KWARGS:
            raise ValueError(f"at most {MAX_TEMPLATE_KWARGS} chat_template_kwargs")
        reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(v))
        if reserved:
            raise ValueError(f"{reserved[0]!r} cannot be set through chat_template_kwargs: the server renders its own chat template")
        return v

    @model_validator(mode="after")
    def _check(self) -> "ChatCompletionRequest":
        if self.top_logprobs is not None and self.top_logprobs > 0 and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            raise ValueError("tool_choice needs tools")
        return self

    def active_tools(self) -> List[Dict[str, Any]]:
        """The tools the model may call (none with tool_choice "none"), as template dicts."""
        if not self.tools or self.tool_choice == "none":
            return []
        tools = [t.model_dump(exclude_none=True) for t in self.tools]
        if isinstance(self.tool_choice, NamedToolChoice):
            chosen = [t for t in tools if t["function"]["name"] == self.tool_choice.function.name]
            if not chosen:
                raise InvalidRequest(f"tool_choice names {self.tool_choice.function.name!r}, which is not in tools", param="tool_choice")
            return chosen
        return tools

    def must_call(self) -> bool:
        return self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)

    def effective_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def logprobs_k(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


Prompt = Union[str, List[str], List[TokenId], List[List[TokenId]]]


class CompletionRequest(SamplingFields):
    prompt: Prompt
    # 0 only with echo: score the prompt, generate nothing (lm-eval's loglikelihood requests)
    max_tokens: Optional[Annotated[int, Field(ge=0, le=INT64_MAX)]] = None
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: Optional[int] = Field(None, ge=1, le=MAX_N)
    suffix: Optional[str] = None

    @model_validator(mode="after")
    def _check(self) -> "CompletionRequest":
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of is not supported (it must equal n)")
        return self

    def prompts(self) -> List[Union[str, List[int]]]:
        return _prompt_list(self.prompt)


def _prompt_list(p: Any) -> List[Union[str, List[int]]]:
    if isinstance(p, str):
        return [p]
    if not p:
        raise ValueError("prompt is empty")
    if all(isinstance(x, int) for x in p):
        return [list(p)]
    return list(p)


class GenerateSampling(_Base):
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = -1
    min_p: MinP = 0.0
    max_new_tokens: Optional[MaxTokens] = 128
    stop: StopStrings = None
    stop_token_ids: Optional[Annotated[List[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)]] = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: RepetitionPenalty = 1.0
    seed: Optional[Int64] = None
    n: int = Field(1, ge=1, le=MAX_N)
    logit_bias: Optional[Annotated[Dict[Annotated[str, Field(max_length=24)], float], Field(max_length=MAX_LOGIT_BIAS_ENTRIES)]] = None
    min_new_tokens: Annotated[int, Field(ge=0, le=INT64_MAX)] = 0
    no_stop_trim: bool = False  # SGLang's name for include_stop_str_in_output
    # SGLang's structured output: at most one of them
    json_schema: Optional[Annotated[str, Field(max_length=MAX_GRAMMAR_CHARS)]] = None
    regex: Optional[Annotated[str, Field(max_length=MAX_GRAMMAR_CHARS)]] = None
    ebnf: Optional[Annotated[str, Field(max_length=MAX_GRAMMAR_CHARS)]] = None

    def grammar(self) -> Optional[GrammarSpec]:
        given = [(k, v) for k, v in (("json_schema", self.json_schema), ("regex", self.regex), ("ebnf", self.ebnf)) if v is not None]
        if len(given) > 1:
            raise InvalidRequest("give at most one of json_schema, regex and ebnf", param="sampling_params")
        if not given:
            return None
        kind, value = given[0]
        if kind == "json_schema":  # parsed here, depth first, not only by the scheduler's compiler
            parse_json(value, "sampling_params.json_schema", "sampling_params.json_schema")
        return GrammarSpec(kind, value, f"sampling_params.{kind}")

    def stop_list(self) -> List[str]:
        return _stop_list(self.stop)

    def sampling_params(self, logprobs: int | None) -> SamplingParams:
        return _to_sampling_params(
            self,
            max_tokens=self.max_new_tokens,
            min_tokens=self.min_new_tokens,
            grammar=self.grammar(),
            logprobs=logprobs,
            bias_param="sampling_params.logit_bias",
        )


class GenerateRequest(_Base):
    """SGLang's native /generate."""

    text: Union[str, List[str], None] = None
    input_ids: Union[List[TokenId], List[List[TokenId]], None] = None
    sampling_params: GenerateSampling = Field(default_factory=GenerateSampling)
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = Field(0, ge=0, le=MAX_LOGPROBS)
    # with return_logprob: prompt logprobs from this position on (-1: none, as SGLang)
    logprob_start_len: int = Field(-1, ge=-1, le=INT64_MAX)

    @model_validator(mode="after")
    def _check(self) -> "GenerateRequest":
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of text or input_ids")
        return self

    def prompts(self) -> List[Union[str, List[int]]]:
        return _prompt_list(self.text if self.text is not None else self.input_ids)

    @property
    def batched(self) -> bool:
        if self.text is not None:
            return not isinstance(self.text, str)
        return bool(self.input_ids) and isinstance(self.input_ids[0], list)  # type: ignore[index]
