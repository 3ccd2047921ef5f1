"""Per-request sampling parameters and the checks every request passes, in one torch-free module.

`SamplingParams` is the one representation of a request's sampling settings: the offline `LLM`
API takes it, the HTTP API builds it from a request body, it travels typed inside the messages
between the server's processes (msgpack, see `minisgl.message`), and the scheduler reads it.
`validate()` is the one range check; `check_context()` the one check of prompt + output length
against the model's context; `check_token_ids()` the one check of client-supplied token ids.
Each raises `InvalidRequest` (a ValueError) naming the offending field, which the server turns
into an HTTP 400 with that field as the OpenAI error's `param`.

Nothing here imports torch, so the API server and the tokenizer worker can use it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Dict, List, Sequence

INT64_MIN = -(1 << 63)
INT64_MAX = (1 << 63) - 1

# Documented bounds (docs/SERVER.md). OpenAI caps temperature at 2; vLLM and SGLang accept more,
# so we do too, up to a value where the distribution is already uniform to float precision.
MAX_TEMPERATURE = 100.0
MAX_PENALTY = 2.0  # presence / frequency, as OpenAI
MAX_REPETITION_PENALTY = 10.0
MAX_LOGPROBS = 20
MAX_STOP_TOKEN_IDS = 256
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_LOGIT_BIAS = 100.0  # as OpenAI: -100 bans a token, +100 all but forces it
# Below this temperature sampling is greedy: logits / T would overflow to infinity (as vLLM).
GREEDY_TEMPERATURE = 1e-5


class InvalidRequest(ValueError):
    """A request the server refuses: `status` (400 unless said otherwise), the offending `param`
    (the field's name as the client sent it) and an OpenAI error `code`."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.status = status


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_range(name: str, value: object, low: float, high: float, *, low_open: bool = False) -> None:
    ok = _is_number(value) and math.isfinite(value) and (value > low if low_open else value >= low) and value <= high  # type: ignore[arg-type,operator]
    if not ok:
        bracket = "(" if low_open else "["
        raise InvalidRequest(f"{name} must be a finite number in {bracket}{low:g}, {high:g}], got {value!r}", param=name)


GRAMMAR_KINDS = ("json_object", "json_schema", "regex", "ebnf", "tool_call")
MAX_GRAMMAR_CHARS = 64 << 10


@dataclass
class GrammarSpec:
    """Constrained decoding: the output must match this grammar (compiled by xgrammar in the
    scheduler). `value` is a JSON schema as JSON text, a regex or an EBNF grammar; unused for
    json_object (any JSON object); for tool_call, the JSON description of a tool turn that
    `minisgl.server.tools.tool_turn_grammar` writes (calls, their syntax, and an optional answer).
    `param` is the request field the client sent the grammar in (`guided_regex`, `tools`, ...), so
    that a grammar refused where it is compiled is named the way the client wrote it; it is no part
    of the grammar's identity."""

    kind: str
    value: str = ""
    param: str = field(default="response_format", compare=False)

    def validate(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise InvalidRequest(f"grammar kind must be one of {GRAMMAR_KINDS}, got {self.kind!r}", param=self.param)
        if not isinstance(self.value, str) or len(self.value) > MAX_GRAMMAR_CHARS:
            raise InvalidRequest(f"a grammar is a string of at most {MAX_GRAMMAR_CHARS} characters", param=self.param)
        if self.kind != "json_object" and not self.value:
            raise InvalidRequest(f"a {self.kind} grammar needs its definition", param=self.param)


@dataclass
class SamplingParams:
    """Per-request sampling settings. The defaults are greedy decoding."""

    temperature: float = 0.0
    top_k: int = -1  # -1: no top-k filter
    top_p: float = 1.0
    min_p: float = 0.0
    # Tokens to generate at most; None: until the context is full.
    max_tokens: int | None = 1024
    ignore_eos: bool = False
    stop_token_ids: List[int] = field(default_factory=list)
    # Stop strings, matched on the detokenized output (vLLM's `stop`): the output ends before the
    # first one that appears, or after it with include_stop_str_in_output.
    stop: List[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    seed: int | None = None
    # OpenAI-style penalties on tokens generated so far; HF-style repetition penalty on all tokens.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # Return the chosen token's logprob and this many top alternatives (None: no logprobs).
    logprobs: int | None = None
    # Added to the logits of these token ids before sampling (OpenAI's logit_bias).
    logit_bias: Dict[int, float] | None = None
    # Stop tokens (EOS, stop_token_ids) cannot end the output before this many tokens.
    min_tokens: int = 0
    # The output must match this grammar (structured output); None: free text.
    grammar: GrammarSpec | None = None
    # Logprobs of the prompt's tokens (each but the first) with this many top alternatives
    # (None: none). Such a request is never served from the prefix cache: its logits are needed.
    prompt_logprobs: int | None = None
    # Scheduling priority under --schedule-policy priority: lower values are admitted first
    # (and retracted last), as in vLLM; under FCFS only 0 is accepted.
    priority: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):  # one stop string, as vLLM and OpenAI accept
            self.stop = [self.stop]

    def validate(self, vocab_size: int | None = None, max_seq_len: int | None = None) -> None:
        """Raise InvalidRequest naming the first field outside its allowed range. Token-id and
        top_k bounds need `vocab_size`; with `max_seq_len`, max_tokens must also fit the context
        (for a client's explicit max_tokens; a default is clipped by `check_context` instead).
        Without them only the types and the int64 bounds are checked."""
        _check_range("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        top_k_max = vocab_size if vocab_size is not None else INT64_MAX
        if not _is_int(self.top_k) or not (self.top_k == -1 or 1 <= self.top_k <= top_k_max):
            raise InvalidRequest(f"top_k must be -1 (disabled) or an integer in [1, {top_k_max}], got {self.top_k!r}", param="top_k")
        _check_range("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _check_range("min_p", self.min_p, 0.0, 1.0)
        if self.max_tokens is not None:
            if not _is_int(self.max_tokens) or not 1 <= self.max_tokens <= INT64_MAX:
                raise InvalidRequest(f"max_tokens must be a positive integer, got {self.max_tokens!r}", param="max_tokens")
            if max_seq_len is not None and self.max_tokens >= max_seq_len:
                raise InvalidRequest(
                    f"max_tokens is {self.max_tokens}, but this model's maximum context length is {max_seq_len} tokens "
                    "(prompt + output): ask for fewer tokens",
                    param="max_tokens",
                    code="context_length_exceeded",
                )
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequest(f"ignore_eos must be a boolean, got {self.ignore_eos!r}", param="ignore_eos")
        if not isinstance(self.stop_token_ids, list) or len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequest(f"stop_token_ids must be a list of at most {MAX_STOP_TOKEN_IDS} token ids", param="stop_token_ids")
        check_token_ids(self.stop_token_ids, vocab_size, "stop_token_ids", allow_empty=True)
        _check_stop_strings(self.stop)
        if not isinstance(self.include_stop_str_in_output, bool):
            raise InvalidRequest(
                f"include_stop_str_in_output must be a boolean, got {self.include_stop_str_in_output!r}", param="include_stop_str_in_output"
            )
        if self.seed is not None and (not _is_int(self.seed) or not INT64_MIN <= self.seed <= INT64_MAX):
            raise InvalidRequest(f"seed must be a 64-bit signed integer, got {self.seed!r}", param="seed")
        _check_range("presence_penalty", self.presence_penalty, -MAX_PENALTY, MAX_PENALTY)
        _check_range("frequency_penalty", self.frequency_penalty, -MAX_PENALTY, MAX_PENALTY)
        _check_range("repetition_penalty", self.repetition_penalty, 0.0, MAX_REPETITION_PENALTY, low_open=True)
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise InvalidRequest(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}", param="logprobs")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
                raise InvalidRequest(f"logit_bias must map at most {MAX_LOGIT_BIAS_ENTRIES} token ids to biases", param="logit_bias")
            check_token_ids(list(self.logit_bias), vocab_size, "logit_bias", allow_empty=True)
            for value in self.logit_bias.values():
                _check_range("logit_bias", value, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= INT64_MAX:
            raise InvalidRequest(f"min_tokens must be a non-negative integer, got {self.min_tokens!r}", param="min_tokens")
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise InvalidRequest(
                f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs!r}", param="logprobs"
            )
        if not _is_int(self.priority) or not -(2**31) <= self.priority < 2**31:
            raise InvalidRequest(f"priority must be a 32-bit signed integer, got {self.priority!r}", param="priority")
        if self.grammar is not None:
            if not isinstance(self.grammar, GrammarSpec):
                raise InvalidRequest("grammar must be a GrammarSpec", param="response_format")
            self.grammar.validate()
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequest(
                f"min_tokens is {self.min_tokens}, but max_tokens is {self.max_tokens}: min_tokens must be in [0, {self.max_tokens}]",
                param="min_tokens",
            )
        if max_seq_len is not None and self.min_tokens >= max_seq_len:  # the prompt takes a token at least
            raise InvalidRequest(
                f"min_tokens is {self.min_tokens}, but this model's maximum context length is {max_seq_len} tokens "
                f"(prompt + output): min_tokens must be in [0, {max_seq_len - 1}]",
                param="min_tokens",
                code="context_length_exceeded",
            )

    def for_choice(self, index: int) -> "SamplingParams":
        """The parameters of choice `index` of an `n > 1` request: a seed becomes seed + index,
        wrapped into the int64 range so that every choice's seed stays valid."""
        bias = dict(self.logit_bias) if self.logit_bias is not None else None
        lists = dict(stop_token_ids=list(self.stop_token_ids), stop=list(self.stop), logit_bias=bias)
        if self.seed is None or index == 0:
            return replace(self, **lists)  # type: ignore[arg-type]
        seed = (self.seed + index - INT64_MIN) % (1 << 64) + INT64_MIN
        return replace(self, seed=seed, **lists)  # type: ignore[arg-type]

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1


def _check_stop_strings(stop: object) -> None:
    if not isinstance(stop, list) or len(stop) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"stop must be a list of at most {MAX_STOP_STRINGS} strings, got {stop!r:.200}", param="stop")
    for s in stop:
        if not isinstance(s, str) or not 1 <= len(s) <= MAX_STOP_CHARS:
            raise InvalidRequest(
                f"each stop string must be a non-empty string of at most {MAX_STOP_CHARS} characters, got {s!r:.200}", param="stop"
            )
        try:
            s.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidRequest("a stop string holds a lone surrogate, which is not valid text", param="stop") from None


def check_token_ids(ids: Sequence[object], vocab_size: int | None, param: str, *, allow_empty: bool = False) -> None:
    """Every id an integer in [0, vocab_size); raise InvalidRequest naming `param` otherwise."""
    if not ids and not allow_empty:
        raise InvalidRequest(f"{param} is empty: give at least one token id", param=param)
    high = vocab_size if vocab_size is not None else INT64_MAX
    for t in ids:
        if not _is_int(t) or not 0 <= t < high:  # type: ignore[operator]
            raise InvalidRequest(f"{param} must hold integer token ids in [0, {high}), got {t!r}", param=param)


def check_context(prompt_len: int, max_tokens: int | None, max_seq_len: int, *, strict: bool, min_tokens: int = 0) -> int:
    """The number of tokens a request may generate, checked against the context length.

    A prompt must leave room for at least one token. `max_tokens=None` means the rest of the
    context. With `strict` (the client asked for max_tokens explicitly) a prompt + max_tokens beyond
    the context is refused, as OpenAI does; otherwise (a default) it is clipped to what fits.
    prompt + min_tokens beyond the context is always refused: such a request could never be met.
    """
    if prompt_len >= max_seq_len:
        raise InvalidRequest(
            f"This model's maximum context length is {max_seq_len} tokens, but the prompt has {prompt_len} tokens "
            "(at least one token must be left for the output). Shorten the prompt.",
            param="prompt",
            code="context_length_exceeded",
        )
    room = max_seq_len - prompt_len
    if min_tokens > room:
        raise InvalidRequest(
            f"min_tokens is {min_tokens}, but the prompt has {prompt_len} tokens and this model's maximum context length "
            f"is {max_seq_len} tokens: min_tokens must be in [0, {room}] for this prompt",
            param="min_tokens",
            code="context_length_exceeded",
        )
    if max_tokens is None:
        return room
    if strict and max_tokens > room:
        raise InvalidRequest(
            f"This model's maximum context length is {max_seq_len} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the completion). "
            "Reduce the prompt or max_tokens.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return min(max_tokens, room)
