"""Issue 26's small API items: OpenAI fields accepted and ignored, vLLM's guided_* /
structured_outputs on the OpenAI routes, /tokenizer_info, HEAD wherever GET exists, and a --tp
that cannot split the model refused before anything starts.

The request models and the route table are checked in-process; the rest against a real
`python -m minisgl` on the tiny chat model (tests/server_helpers.py), with the openai SDK and raw
HTTP.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from typing import Any, Dict

import httpx
import pytest
from server_helpers import MAX_SEQ_LEN, REPO, ServerProcess, assert_error_body

from minisgl.sampling_params import GrammarSpec, InvalidRequest
from minisgl.server.protocol import IGNORED_FIELDS, ChatCompletionRequest, CompletionRequest

MSGS = [{"role": "user", "content": "Answer yes or no: is the sky blue?"}]

# one accepted value of each ignored field
HARMLESS: Dict[str, Any] = {
    "prompt_cache_key": "session-42",
    "safety_identifier": "user-hash-abc",
    "verbosity": "low",
    "service_tier": "auto",
    "store": True,
    "metadata": {"team": "eval", "run": "7"},
    "modalities": ["text"],
    "user": "alice",
}

# a value of each that asks for something minisgl cannot do by doing nothing
BAD_VALUES = [
    ("service_tier", "flex"),
    ("service_tier", "priority"),
    ("modalities", ["text", "audio"]),
    ("modalities", ["audio"]),
    ("verbosity", "maximal"),
    ("metadata", {"n": 1}),
    ("metadata", {f"k{i}": "v" for i in range(17)}),
    ("metadata", {"k": "v" * 513}),
    ("store", "yes"),
]

# ---------------------------------------------------------------------------------------------
# In-process: request models and routes
# ---------------------------------------------------------------------------------------------


def test_ignored_fields_are_declared_once_and_named() -> None:
    assert set(HARMLESS) == set(IGNORED_FIELDS)
    chat = ChatCompletionRequest.model_validate({"messages": MSGS, **HARMLESS})
    assert chat.ignored_fields() == list(IGNORED_FIELDS)
    cmpl = CompletionRequest.model_validate({"prompt": "hi", "store": False, "service_tier": "default"})
    assert cmpl.ignored_fields() == ["service_tier"]  # store=false asks for nothing
    assert ChatCompletionRequest.model_validate({"messages": MSGS}).ignored_fields() == []


def _grammar(**fields: Any) -> GrammarSpec | None:
    return ChatCompletionRequest.model_validate({"messages": MSGS, **fields}).grammar()


def test_guided_fields_map_onto_grammar_specs() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    as_format = _grammar(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert _grammar(guided_json=schema) == as_format
    assert _grammar(guided_json=json.dumps(schema)) == as_format
    assert _grammar(structured_outputs={"json": schema}) == as_format
    assert _grammar(guided_regex="[0-9]+") == GrammarSpec("regex", "[0-9]+")
    assert _grammar(structured_outputs={"regex": "[0-9]+"}) == GrammarSpec("regex", "[0-9]+")
    assert _grammar(guided_grammar='root ::= "a"') == GrammarSpec("ebnf", 'root ::= "a"')
    choice = _grammar(guided_choice=["yes", 'say "no"'])
    assert choice == GrammarSpec("ebnf", 'root ::= "yes" | "say \\"no\\""')
    assert _grammar(structured_outputs={"choice": ["yes", 'say "no"']}) == choice
    assert _grammar(guided_json=None, response_format={"type": "text"}) is None


@pytest.mark.parametrize(
    "fields, names",
    [
        ({"guided_json": {"type": "object"}, "response_format": {"type": "json_object"}}, ["response_format", "guided_json"]),
        ({"guided_regex": "a", "guided_choice": ["a"]}, ["guided_regex", "guided_choice"]),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, ["structured_outputs.regex", "structured_outputs.choice"]),
        ({"guided_grammar": 'root ::= "a"', "structured_outputs": {"json": {}}}, ["guided_grammar", "structured_outputs.json"]),
    ],
)
def test_two_constraints_are_refused_naming_both(fields: Dict[str, Any], names: list) -> None:
    with pytest.raises(InvalidRequest) as info:
        _grammar(**fields)
    assert all(n in info.value.message for n in names), info.value.message
    assert info.value.param == names[0].split(".")[0]


def test_every_get_route_answers_head() -> None:
    from fastapi.routing import APIRoute

    from minisgl.server.routes import admin, chat, completions, native

    routes = [r for m in (admin, chat, completions, native) for r in m.router.routes] + list(admin.open_router.routes)
    gets = [r for r in routes if isinstance(r, APIRoute) and "GET" in r.methods]
    assert {r.path for r in gets} >= {"/health", "/metrics", "/v1/models", "/tokenizer_info", "/server_info"}
    assert [r.path for r in gets if "HEAD" not in r.methods] == []


def test_tokenizer_info_without_a_tokenizer_is_refused() -> None:
    from fastapi.testclient import TestClient

    from minisgl.server.api_server import create_app
    from minisgl.server.args import parse_args
    from minisgl.server.metrics import ServerMetrics

    args = parse_args(["--skip-tokenizer-init"])
    args.model_path = "/models/x"
    app = create_app(args, {"max_seq_len": 512, "vocab_size": 100}, object(), ServerMetrics())  # type: ignore[arg-type]
    with TestClient(app) as client:
        assert_error_body(client.get("/tokenizer_info"), 400, code="tokenizer_required")
        assert client.head("/tokenizer_info").status_code == 400


# ---------------------------------------------------------------------------------------------
# A real server
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(chat_server: ServerProcess) -> ServerProcess:
    return chat_server  # the session's (conftest): this module needs no flags of its own


@pytest.fixture(scope="module")
def client(server: ServerProcess):
    with httpx.Client(base_url=server.base_url, headers=server.headers(), timeout=120) as c:
        yield c


def _chat(client: httpx.Client, **fields: Any) -> httpx.Response:
    return client.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 4, "temperature": 0, **fields})


def _completion(client: httpx.Client, **fields: Any) -> httpx.Response:
    return client.post("/v1/completions", json={"prompt": "The sky is", "max_tokens": 4, "temperature": 0, **fields})


def test_harmless_fields_through_the_openai_sdk(server: ServerProcess) -> None:
    oai = server.openai()
    out = oai.chat.completions.create(model=oai.models.list().data[0].id, messages=MSGS, max_tokens=4, **HARMLESS)
    assert out.choices[0].message.content is not None
    cmpl = oai.completions.create(
        model=out.model, prompt="The sky is", max_tokens=4, user="alice",
        extra_body={k: v for k, v in HARMLESS.items() if k != "user"},
    )  # fmt: skip
    assert cmpl.choices[0].text is not None
    # one warning per request, naming every ignored field
    warnings = [line for line in server.log().splitlines() if "ignoring prompt_cache_key" in line]
    assert len(warnings) >= 2 and all(", ".join(IGNORED_FIELDS) in w for w in warnings), warnings


@pytest.mark.parametrize("name", list(HARMLESS))
def test_each_harmless_field_is_accepted(client: httpx.Client, name: str) -> None:
    for resp in (_chat(client, **{name: HARMLESS[name]}), _completion(client, **{name: HARMLESS[name]})):
        assert resp.status_code == 200, resp.text
    assert _chat(client, store=False, service_tier="default", modalities=None, metadata={}).status_code == 200


@pytest.mark.parametrize("name, value", BAD_VALUES)
def test_a_value_that_asks_for_something_is_refused(client: httpx.Client, name: str, value: Any) -> None:
    for resp in (_chat(client, **{name: value}), _completion(client, **{name: value})):
        assert_error_body(resp, 400, param=name)


def test_behaviour_changing_fields_stay_refused(client: httpx.Client) -> None:
    assert_error_body(_chat(client, audio={"voice": "alloy", "format": "wav"}), 400, param="audio", code="unsupported_parameter")
    assert_error_body(_chat(client, no_such_field=1), 400, param="no_such_field", code="unknown_parameter")


SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 8}}, "required": ["answer"]}


def test_guided_json_equals_response_format(server: ServerProcess) -> None:
    pytest.importorskip("xgrammar")
    oai = server.openai()
    model = oai.models.list().data[0].id
    common: Dict[str, Any] = dict(model=model, messages=MSGS, max_tokens=48, temperature=0)
    by_format = oai.chat.completions.create(
        **common, response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    ).choices[0]
    by_guided = oai.chat.completions.create(**common, extra_body={"guided_json": SCHEMA}).choices[0]
    by_so = oai.chat.completions.create(**common, extra_body={"structured_outputs": {"json": SCHEMA}}).choices[0]
    assert by_guided.message.content == by_format.message.content == by_so.message.content
    if by_format.finish_reason == "stop":
        assert set(json.loads(by_format.message.content or "")) == {"answer"}
    cmpl = dict(model=model, prompt="JSON:", max_tokens=48, temperature=0)
    a = oai.completions.create(**cmpl, extra_body={"guided_json": SCHEMA}).choices[0].text
    b = oai.completions.create(**cmpl, extra_body={"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}})
    assert a == b.choices[0].text


def test_guided_choice_regex_and_grammar(client: httpx.Client) -> None:
    pytest.importorskip("xgrammar")
    choices = ["yes", "no", "it depends"]
    for fields in ({"guided_choice": choices}, {"structured_outputs": {"choice": choices}}):
        for seed in range(3):
            resp = _chat(client, max_tokens=16, temperature=1.0, seed=seed, **fields)
            assert resp.status_code == 200, resp.text
            assert resp.json()["choices"][0]["message"]["content"] in choices
        resp = _completion(client, max_tokens=16, **fields)
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["text"] in choices
    resp = _completion(client, max_tokens=8, guided_regex="[0-9]{3}")
    assert re.fullmatch("[0-9]{3}", resp.json()["choices"][0]["text"]), resp.text
    resp = _chat(client, max_tokens=8, guided_grammar='root ::= "A" | "B" "C"')
    assert resp.json()["choices"][0]["message"]["content"] in ("A", "BC"), resp.text


def test_constraint_errors_are_openai_style(client: httpx.Client) -> None:
    err = assert_error_body(_chat(client, guided_json={"type": "object"}, response_format={"type": "json_object"}), 400)
    assert "guided_json" in err["message"] and "response_format" in err["message"]
    err = assert_error_body(_completion(client, guided_regex="a", guided_choice=["a"]), 400, param="guided_regex")
    assert "guided_choice" in err["message"]
    assert_error_body(_chat(client, guided_json="{not json"), 400, param="guided_json")
    assert_error_body(_chat(client, guided_choice=[]), 400, param="guided_choice")
    assert_error_body(_chat(client, structured_outputs={"xml": "<a/>"}), 400, param="structured_outputs")


def test_tokenizer_info(server: ServerProcess, client: httpx.Client, tiny_chat_model: str) -> None:
    from minisgl.utils.hf import load_tokenizer

    tok = load_tokenizer(tiny_chat_model)
    resp = client.get("/tokenizer_info")
    assert resp.status_code == 200, resp.text
    info = resp.json()
    assert info["vocab_size"] == len(tok) == 49152
    assert info["tokenizer_class"] == type(tok).__name__
    assert (info["eos_token"], info["eos_token_id"]) == (tok.eos_token, tok.eos_token_id)
    assert info["bos_token_id"] == tok.bos_token_id
    assert info["added_tokens"]["2"] == "<|im_end|>"
    assert info["chat_template"] == tok.chat_template
    assert info["max_model_len"] == MAX_SEQ_LEN
    assert_error_body(httpx.get(server.base_url + "/tokenizer_info"), 401)


HEAD_OPEN = ["/health", "/metrics", "/version"]
HEAD_KEYED = ["/v1/models", "/v1/models/tiny", "/tokenizer_info", "/server_info"]


def test_head_wherever_get(server: ServerProcess, client: httpx.Client) -> None:
    for path in HEAD_OPEN + HEAD_KEYED:
        got = client.get(path)
        head = client.head(path)
        assert head.status_code == got.status_code, (path, head.status_code, got.status_code)
        assert head.content == b"", path
        assert head.headers.get("content-type") == got.headers.get("content-type"), path
    for path in HEAD_OPEN:
        assert httpx.head(server.base_url + path).status_code == 200, path
    for path in HEAD_KEYED:  # the same auth as GET
        assert httpx.head(server.base_url + path).status_code == 401, path
        assert httpx.get(server.base_url + path).status_code == 401, path
    assert client.head("/v1/chat/completions").status_code == 405  # POST-only routes stay POST-only


# ---------------------------------------------------------------------------------------------
# --tp that cannot split the model
# ---------------------------------------------------------------------------------------------


def test_tp_that_cannot_split_the_heads_exits_2(tiny_chat_model: str) -> None:
    # 4 attention heads, 2 KV heads, MLP 128: tp 1, 2 and 4 fit (4: each KV head on two ranks)
    proc = subprocess.run(
        [sys.executable, "-m", "minisgl", "--model", tiny_chat_model, "--tp", "3", "--port", "0"],
        cwd=REPO, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "Traceback" not in out, out
    assert "--tp 3" in out and "num_attention_heads=4" in out and "tp values that fit: [1, 2, 4]" in out, out
    assert "scheduler" not in out.lower().replace("shutdown complete", ""), out  # nothing was started
