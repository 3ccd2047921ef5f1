"""Tools round two: tools beside an output format, forced parallel calls, grammars that win over
min_tokens, and grammar errors in our words naming the client's field.

The grammars are checked in-process against xgrammar's own matcher (text of calls accepted or
refused; random walks through the grammar, token by token over the tiny chat model's real
vocabulary, must parse back with each parser); min_tokens on the offline LLM path; the rest
against a real `python -m minisgl` on the tiny chat model (hermes calls), through the openai SDK
and raw HTTP. Every check of a call's arguments or an answer uses jsonschema, an independent
validator.
"""

from __future__ import annotations

import json
import random
import re
from typing import Any, Dict, Iterator, List

import httpx
import pytest
import torch
from helpers import TEST_DEVICE
from server_helpers import API_KEY, ServerProcess, assert_error_body, serving

from minisgl.sampling_params import GrammarSpec, SamplingParams
from minisgl.server.tools import PARSERS, ToolParser, tool_turn_grammar

xgrammar = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

TOOLS: List[Dict[str, Any]] = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"type": "string", "maxLength": 5}}, "required": ["tz"], "additionalProperties": False}}},
]  # fmt: skip
NAMES = [t["function"]["name"] for t in TOOLS]
ARGS_SCHEMA = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ANSWER = {
    "type": "object",
    "properties": {"verdict": {"enum": ["sunny", "rainy"]}, "score": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["verdict", "score"],
    "additionalProperties": False,
}
ANSWER_FORMAT = {"type": "json_schema", "json_schema": {"name": "Forecast", "schema": ANSWER, "strict": True}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]

# two calls written as each parser's format writes them
CALL_TEXTS = {
    "hermes": ('{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}', '{"name": "get_time", "arguments": {"tz": "CET"}}'),
    "llama3_json": ('{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}', '{"name": "get_time", "parameters": {"tz": "CET"}}'),
    "mistral": ('{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}', '{"name": "get_time", "arguments": {"tz": "CET"}}'),
}  # fmt: skip


def _written(parser: ToolParser, calls: List[str]) -> str:
    return parser.prefix + parser.separator.join(parser.begin + c + parser.end for c in calls) + parser.suffix


def _turn(parser: ToolParser, tools: List[Dict[str, Any]] = TOOLS, **kw: Any) -> GrammarSpec:
    args: Dict[str, Any] = dict(must_call=True, parallel=True, answer=None, after_tool_result=False)
    spec = tool_turn_grammar(parser, tools, NAMES, **{**args, **kw})
    assert spec is not None
    return spec


def _check_calls(calls: List[Any]) -> None:
    assert calls
    for call in calls:
        jsonschema.validate(call.arguments, ARGS_SCHEMA[call.name])


# ---------------------------------------------------------------------------------------------
# In-process: the grammars, driven through xgrammar's matcher
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(tiny_chat_model: str) -> Any:
    from minisgl.utils.hf import load_tokenizer

    return load_tokenizer(tiny_chat_model)


@pytest.fixture(scope="module")
def backend(tokenizer: Any) -> Any:
    from minisgl.scheduler.grammar import GrammarBackend

    return GrammarBackend(tokenizer, len(tokenizer))


def _accepts(backend: Any, spec: GrammarSpec, text: str, eos: int) -> bool:
    """The whole of `text`, then the end of the output (a stop token)."""
    m = backend.matcher(spec)
    return bool(m.accept_string(text)) and bool(m.accept_token(eos)) and m.is_terminated()


FORCING = [name for name, p in PARSERS.items() if p.forces_calls]  # harmony's calls are refused (tests/test_harmony.py)


@pytest.mark.parametrize("name", FORCING)
def test_forced_calls_are_one_or_more_when_parallel(backend: Any, tokenizer: Any, name: str) -> None:
    parser = PARSERS[name]()
    eos = tokenizer.eos_token_id
    first, second = CALL_TEXTS[name]
    one, two = _written(parser, [first]), _written(parser, [first, second])
    parallel, single = _turn(parser), _turn(parser, parallel=False)
    assert _accepts(backend, parallel, one, eos) and _accepts(backend, parallel, two, eos)
    content, calls = parser.parse(two)
    assert content == "" and [c.name for c in calls] == NAMES
    _check_calls(calls)
    # parallel_tool_calls=false: the first call is the whole turn, a second is refused
    assert _accepts(backend, single, one, eos)
    m = backend.matcher(single)
    assert m.accept_string(one[: len(one) - len(parser.suffix)])
    assert not m.accept_string(parser.separator + parser.begin + second)
    assert not _accepts(backend, single, two, eos)
    # a named function: one or more calls of that function, never another one
    named = _turn(parser, [TOOLS[1]])
    assert _accepts(backend, named, _written(parser, [second, second]), eos)
    assert not _accepts(backend, named, _written(parser, [second, first]), eos)
    # the answer format is no way out of a forced call (before any tool result)
    forced = _turn(parser, answer=GrammarSpec("json_schema", json.dumps(ANSWER)))
    assert not _accepts(backend, forced, '{"verdict": "sunny", "score": 3}', eos) and _accepts(backend, forced, one, eos)


def _allowed(mask_row: torch.Tensor, vocab: int) -> List[int]:
    bits = (mask_row.unsqueeze(1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten()[:vocab].nonzero().flatten().tolist()


def _random_walk(backend: Any, spec: GrammarSpec, eos: int, vocab: int, rng: random.Random, max_steps: int = 600) -> List[int]:
    """Tokens drawn uniformly among what the grammar allows (ending as soon as a coin says so)."""
    m = backend.matcher(spec)
    out: List[int] = []
    for _ in range(max_steps):
        mask, _ = backend.batch_mask([m])
        allowed = _allowed(mask[0], vocab)
        token = eos if eos in allowed and rng.random() < 0.5 else rng.choice([t for t in allowed if t != eos] or [eos])
        assert m.accept_token(token)
        if m.is_terminated():
            return out
        out.append(token)
    raise AssertionError(f"no end after {max_steps} tokens")


@pytest.mark.parametrize("name", FORCING)
def test_calls_or_answer_parse_back(backend: Any, tokenizer: Any, name: str) -> None:
    """tool_choice auto + a response_format: whatever the grammar lets through parses into calls
    with valid arguments or is the answer, valid against its schema; both branches are reachable."""
    parser = PARSERS[name]()
    eos, vocab = tokenizer.eos_token_id, len(tokenizer)
    answer = GrammarSpec("json_schema", json.dumps(ANSWER))
    union = tool_turn_grammar(parser, TOOLS, NAMES, must_call=False, parallel=True, answer=answer, after_tool_result=False)
    assert union is not None
    assert _accepts(backend, union, _written(parser, list(CALL_TEXTS[name])), eos)
    assert _accepts(backend, union, '{"verdict": "rainy", "score": 7}', eos)
    assert not _accepts(backend, union, "Just some words", eos)
    rng = random.Random(f"walk-{name}")
    branches = set()
    for _ in range(12):
        text = tokenizer.decode(_random_walk(backend, union, eos, vocab, rng))
        content, calls = parser.parse(text)
        if calls:
            assert content == "", text
            _check_calls(calls)
            branches.add("calls")
        else:
            jsonschema.validate(json.loads(content), ANSWER)
            branches.add("answer")
    assert branches == {"calls", "answer"}
    # required + parallel: every walk parses into one or more valid calls
    for _ in range(4):
        text = tokenizer.decode(_random_walk(backend, _turn(parser), eos, vocab, rng))
        content, calls = parser.parse(text)
        assert content == "", text
        _check_calls(calls)


def test_parsers_read_only_real_calls() -> None:
    """A JSON answer with a "name" field is content (the union's answer branch), and a ";" inside
    a llama3_json string separates nothing."""
    answer = '{"name": "Ada", "age": 36}'
    for parser in (PARSERS["llama3_json"](), PARSERS["hermes"]()):
        assert parser.parse(answer) == (answer, [])
    assert PARSERS["mistral"]().parse("[TOOL_CALLS][" + answer + "]") == ("[TOOL_CALLS][" + answer + "]", [])
    content, calls = PARSERS["llama3_json"]().parse('{"name": "get_time", "parameters": {"tz": "a;b"}} ; {"name": "f", "parameters": {}}')
    assert content == "" and [(c.name, c.arguments) for c in calls] == [("get_time", {"tz": "a;b"}), ("f", {})]


def test_a_turn_after_a_tool_result_answers_in_the_format() -> None:
    parser = PARSERS["hermes"]()
    answer = GrammarSpec("json_schema", json.dumps(ANSWER))
    assert tool_turn_grammar(parser, TOOLS, NAMES, must_call=True, parallel=True, answer=answer, after_tool_result=True) is answer
    assert tool_turn_grammar(parser, TOOLS, NAMES, must_call=False, parallel=True, answer=None, after_tool_result=False) is None
    forced = tool_turn_grammar(parser, TOOLS, NAMES, must_call=True, parallel=True, answer=None, after_tool_result=True)
    assert forced is not None and forced.kind == "tool_call"  # no format: required stays required


# ---------------------------------------------------------------------------------------------
# The offline LLM: a grammar wins over min_tokens
# ---------------------------------------------------------------------------------------------

CHOICES = ["yes", "no", "maybe"]


@pytest.fixture(scope="module")
def llm(tiny_chat_model: str) -> Any:
    """The tiny chat model: its EOS (2) is not token 0, where a fully masked row's argmax lands."""
    from minisgl.llm import LLM

    engine = LLM(tiny_chat_model, dtype="float32", device=TEST_DEVICE, max_seq_len_override=256, num_page_override=4096, max_running_req=16)
    try:
        yield engine
    finally:
        engine.shutdown()


def _choice_spec() -> GrammarSpec:
    return GrammarSpec("ebnf", "root ::= " + " | ".join(json.dumps(c) for c in CHOICES), "guided_choice")


def test_choice_with_min_tokens_is_one_of_the_choices(llm: Any) -> None:
    greedy = SamplingParams(max_tokens=40, min_tokens=20, grammar=_choice_spec())
    sampled = [SamplingParams(temperature=1.0, seed=s, max_tokens=40, min_tokens=20, grammar=_choice_spec()) for s in range(4)]
    for r in llm.generate(["Answer:"] * 5, [greedy, *sampled]):
        assert r.text in CHOICES and r.finish_reason == "stop", r.text
    llm.scheduler.check_invariants()


def test_constrained_and_free_rows_with_min_tokens_share_a_step(llm: Any) -> None:
    """Constrained rows (choice, regex, JSON) whose grammar ends before min_tokens, beside free
    rows that min_tokens holds open: the grammars still win, the free rows are exactly what they
    are alone (the min_tokens ban still applies to them)."""
    free_prompts = ["Tell me about cats", "The quick brown fox"]
    free = SamplingParams(max_tokens=30, min_tokens=25)
    alone = llm.generate(free_prompts, free)
    pattern = "[0-9]{3}"
    schema = {"enum": ["red", "green", "blue"]}
    constrained = [
        SamplingParams(max_tokens=30, min_tokens=25, grammar=_choice_spec()),
        SamplingParams(temperature=1.0, seed=3, max_tokens=30, min_tokens=25, grammar=GrammarSpec("regex", pattern)),
        SamplingParams(temperature=1.0, seed=4, max_tokens=30, min_tokens=25, grammar=GrammarSpec("json_schema", json.dumps(schema))),
    ]
    out = llm.generate([*free_prompts, "a", "b", "c"], [free, free, *constrained])
    assert [r.token_ids for r in out[:2]] == [r.token_ids for r in alone]
    assert all(len(r.token_ids) >= 25 for r in out[:2])
    assert out[2].text in CHOICES
    assert re.fullmatch(pattern, out[3].text), out[3].text
    jsonschema.validate(json.loads(out[4].text), schema)
    llm.scheduler.check_invariants()


# ---------------------------------------------------------------------------------------------
# Against a server
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tiny_chat_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    # a longer context than the shared server's: the tools' system message and 200-token turns
    with serving(tiny_chat_model, "--dtype", "float32", "--max-seq-len", "1024", "--num-pages", "4096",
                 log_dir=tmp_path_factory.mktemp("tools_round2"), api_key=API_KEY) as srv:  # fmt: skip
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerProcess):
    with httpx.Client(base_url=server.base_url, headers=server.headers(), timeout=120) as c:
        yield c


def _answer_or_calls(message: Any) -> str:
    """'calls' or 'answer'; fails unless the message is exactly one of the two, and valid."""
    if message.tool_calls:
        for call in message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), ARGS_SCHEMA[call.function.name])
        return "calls"
    jsonschema.validate(json.loads(message.content), ANSWER)
    return "answer"


def test_tools_with_a_response_format(server: ServerProcess) -> None:
    """auto + a response_format: each output is a valid call or a valid answer (one call at most
    here, so that every output ends within max_tokens; the parallel union is walked in-process)."""
    oai = server.openai()
    for seed in range(3):
        r = oai.chat.completions.create(
            model="tiny_chat_llama", messages=ASK, tools=TOOLS, response_format=ANSWER_FORMAT, tool_choice="auto",
            parallel_tool_calls=False, temperature=1.0, seed=seed, max_tokens=200,
        )  # fmt: skip
        choice = r.choices[0]
        kind = _answer_or_calls(choice.message)
        assert choice.finish_reason == ("tool_calls" if kind == "calls" else "stop"), choice


def test_agents_shaped_turns(server: ServerProcess) -> None:
    """openai-agents with an output_type and a tool: first turn forced to call, the second (after
    the tool's result) answers in the schema."""
    oai = server.openai()
    common: Dict[str, Any] = dict(model="tiny_chat_llama", tools=TOOLS, response_format=ANSWER_FORMAT, max_tokens=200)
    first = oai.chat.completions.create(messages=ASK, tool_choice="required", parallel_tool_calls=False, temperature=0, **common)
    assert first.choices[0].finish_reason == "tool_calls" and _answer_or_calls(first.choices[0].message) == "calls"
    call = first.choices[0].message.tool_calls[0]
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"},
    ]
    for choice_ in ("required", {"type": "function", "function": {"name": call.function.name}}):
        second = oai.chat.completions.create(messages=history, tool_choice=choice_, temperature=1.0, seed=5, **common).choices[0]
        assert second.finish_reason == "stop" and _answer_or_calls(second.message) == "answer"


def test_forced_parallel_calls_end_to_end(server: ServerProcess) -> None:
    """required, parallel by default: one or more valid calls (a random model may keep calling
    until max_tokens; a cut-off last call is dropped, the complete ones stay); without parallel
    calls exactly one, and the turn ends after it."""
    oai = server.openai()
    common: Dict[str, Any] = dict(model="tiny_chat_llama", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=160)
    for seed in range(2):
        r = oai.chat.completions.create(temperature=1.0, seed=seed, **common).choices[0]
        assert r.finish_reason in ("tool_calls", "length") and _answer_or_calls(r.message) == "calls"
    greedy = oai.chat.completions.create(temperature=0, **common).choices[0]
    assert greedy.finish_reason in ("tool_calls", "length") and _answer_or_calls(greedy.message) == "calls"
    single = oai.chat.completions.create(temperature=0, parallel_tool_calls=False, **common).choices[0]
    assert single.finish_reason == "tool_calls" and len(single.message.tool_calls) == 1
    server.wait_idle()


def test_guided_choice_with_min_tokens_over_http(client: httpx.Client) -> None:
    for seed in range(2):
        body = {"messages": ASK, "guided_choice": CHOICES, "min_tokens": 20, "max_tokens": 30, "temperature": 1.0, "seed": seed}
        resp = client.post("/v1/chat/completions", json=body)
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["message"]["content"] in CHOICES


BAD_SCHEMA = {"type": "objec"}
BAD_REGEX = "a("
BAD_EBNF = "root ::= missing_rule"


@pytest.mark.parametrize(
    "path, fields, param, message",
    [
        ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": BAD_SCHEMA}}}, "response_format", "invalid JSON schema: "),
        ("/v1/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": BAD_SCHEMA}}}, "response_format", "invalid JSON schema: "),
        ("/v1/chat/completions", {"guided_json": BAD_SCHEMA}, "guided_json", "invalid JSON schema: "),
        ("/v1/completions", {"guided_regex": BAD_REGEX}, "guided_regex", "invalid regex "),
        ("/v1/chat/completions", {"guided_grammar": BAD_EBNF}, "guided_grammar", "invalid EBNF grammar "),
        ("/v1/chat/completions", {"structured_outputs": {"regex": BAD_REGEX}}, "structured_outputs", "invalid regex "),
        ("/v1/completions", {"structured_outputs": {"json": BAD_SCHEMA}}, "structured_outputs", "invalid JSON schema: "),
        ("/generate", {"sampling_params": {"regex": BAD_REGEX, "max_new_tokens": 4}}, "sampling_params.regex", "invalid regex "),
        ("/generate", {"sampling_params": {"json_schema": json.dumps(BAD_SCHEMA), "max_new_tokens": 4}}, "sampling_params.json_schema", "invalid JSON schema: "),
        ("/generate", {"sampling_params": {"ebnf": BAD_EBNF, "max_new_tokens": 4}}, "sampling_params.ebnf", "invalid EBNF grammar "),
    ],
)  # fmt: skip
def test_bad_grammars_are_refused_in_our_words(client: httpx.Client, path: str, fields: Dict[str, Any], param: str, message: str) -> None:
    base: Dict[str, Any] = {"/v1/chat/completions": {"messages": ASK, "max_tokens": 4}, "/v1/completions": {"prompt": "x", "max_tokens": 4}}
    body = {**base.get(path, {"text": "x"}), **fields}
    err = assert_error_body(client.post(path, json=body), 400, param=param)
    assert err["message"].startswith(message), err
    assert "/project/" not in err["message"] and ".cc:" not in err["message"]  # no library source locations


def test_a_bad_tool_schema_is_named_by_its_index(client: httpx.Client) -> None:
    bad_tools = [TOOLS[0], {"type": "function", "function": {"name": "broken", "parameters": BAD_SCHEMA}}]
    for extra in ({"tool_choice": "required"}, {"tool_choice": "auto", "response_format": ANSWER_FORMAT}):
        body = {"messages": ASK, "tools": bad_tools, "max_tokens": 4, **extra}
        err = assert_error_body(client.post("/v1/chat/completions", json=body), 400, param="tools[1].function.parameters")
        assert err["message"].startswith("invalid JSON schema: "), err
    # the named tool keeps its index in the request
    body = {"messages": ASK, "tools": bad_tools, "max_tokens": 4, "tool_choice": {"type": "function", "function": {"name": "broken"}}}
    assert_error_body(client.post("/v1/chat/completions", json=body), 400, param="tools[1].function.parameters")
    # a bad answer format beside good tools is the format's error
    body = {"messages": ASK, "tools": TOOLS, "max_tokens": 4, "guided_regex": BAD_REGEX}
    assert_error_body(client.post("/v1/chat/completions", json=body), 400, param="guided_regex")
    # nothing leaked: the server is idle and serves the next request
    ok = client.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 2})
    assert ok.status_code == 200, ok.text
