"""POST /v1/responses (OpenAI's Responses API) end to end: the openai SDK's `client.responses`
against a real `python -m minisgl` on the tiny chat model (one server for the module).

The oracle is the chat route: a Responses request means a chat conversation, so its greedy output
must equal /v1/chat/completions' output for that conversation token for token (text, token
counts, finish), with tools and output constraints too. Reasoning items need a model that thinks,
so they are checked in-process on a canned output (test_server_units' fake frontend).
"""

from __future__ import annotations

import json
from typing import Any, Dict, List

import httpx
import jsonschema
import pytest
from server_helpers import MAX_SEQ_LEN, ServerProcess, assert_error_body

from minisgl.server.protocol import ChatCompletionRequest
from minisgl.server.responses_protocol import ResponsesRequest

MODEL = "tiny_chat_llama"
N_NEW = 24
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 6}}, "required": ["tz"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "name": "get_weather", "description": "The weather in a city", "parameters": WEATHER, "strict": True},
    {"type": "function", "name": "get_time", "parameters": TIME, "strict": True},
]
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS]
ASK = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def server(chat_server: ServerProcess) -> ServerProcess:
    return chat_server  # the session's (conftest): this module needs no flags of its own


def _chat(server: ServerProcess, messages: List[Dict[str, Any]], **kw: Any) -> Any:
    return server.openai().chat.completions.create(model=MODEL, messages=messages, temperature=0, **kw)


def _post(server: ServerProcess, body: Dict[str, Any]) -> httpx.Response:
    return httpx.post(server.base_url + "/v1/responses", json=body, headers=server.headers(), timeout=120)


def _assert_same_as_chat(resp: Any, chat: Any) -> None:
    """A response and the chat completion of the same conversation: the same text, token counts, ending."""
    choice = chat.choices[0]
    assert resp.output_text == choice.message.content
    assert resp.usage.input_tokens == chat.usage.prompt_tokens
    assert resp.usage.output_tokens == chat.usage.completion_tokens
    assert resp.usage.total_tokens == chat.usage.total_tokens
    if choice.finish_reason == "length":
        assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    else:
        assert choice.finish_reason == "stop" and resp.status == "completed" and resp.incomplete_details is None


def test_text_and_item_input_equal_the_chat_route(server: ServerProcess) -> None:
    client = server.openai()
    r = client.responses.create(model=MODEL, input="What is the capital of France?", max_output_tokens=N_NEW, temperature=0)
    assert r.object == "response" and r.id.startswith("resp_") and r.model
    assert [item.type for item in r.output] == ["message"] and r.output[0].role == "assistant"
    _assert_same_as_chat(r, _chat(server, [{"role": "user", "content": "What is the capital of France?"}], max_tokens=N_NEW))

    # items: instructions, a developer message, an earlier answer passed back as the SDK returns
    # it (id, status, annotations), text parts; the same conversation as chat messages
    earlier = client.responses.create(model=MODEL, input="Name three colours.", max_output_tokens=8, temperature=0)
    items: List[Any] = [
        {"role": "developer", "content": "Answer in English."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Name three colours."}]},
        earlier.output[0].model_dump(exclude_none=True),
        {"role": "user", "content": [{"type": "input_text", "text": "And three "}, {"type": "input_text", "text": "animals?"}]},
    ]
    r = client.responses.create(model=MODEL, instructions="Be brief.", input=items, max_output_tokens=N_NEW, temperature=0)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": "Answer in English."},
        {"role": "user", "content": "Name three colours."},
        {"role": "assistant", "content": earlier.output_text},
        {"role": "user", "content": "And three animals?"},
    ]
    _assert_same_as_chat(r, _chat(server, messages, max_tokens=N_NEW))
    assert r.instructions == "Be brief." and r.max_output_tokens == N_NEW and r.temperature == 0

    # cut off: incomplete, reason max_output_tokens, exactly that many tokens
    r = client.responses.create(model=MODEL, input="Tell me a story.", max_output_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens" and r.usage.output_tokens == 3
    assert r.output[0].status == "incomplete"
    server.wait_idle()


def test_function_tool_round_trip(server: ServerProcess) -> None:
    client = server.openai()
    ask = [{"role": "user", "content": ASK}]
    # required: the grammar makes even a random model call a tool with schema-valid arguments;
    # one call (a random model under forced parallel calls may repeat its call until the limit)
    r = client.responses.create(
        model=MODEL, input=ask, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_output_tokens=120, temperature=0
    )
    calls = [item for item in r.output if item.type == "function_call"]
    assert r.status == "completed" and len(calls) >= 1
    schemas = {t["name"]: t["parameters"] for t in TOOLS}
    for call in calls:
        assert call.name in schemas and call.call_id.startswith("call_") and call.id.startswith("fc_") and call.status == "completed"
        jsonschema.validate(json.loads(call.arguments), schemas[call.name])
    # the same call as the chat route makes
    chat = _chat(server, ask, tools=CHAT_TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=120)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        (c.function.name, json.loads(c.function.arguments)) for c in chat.choices[0].message.tool_calls
    ]
    named = client.responses.create(
        model=MODEL,
        input=ask,
        tools=TOOLS,
        tool_choice={"type": "function", "name": "get_time"},
        parallel_tool_calls=False,
        max_output_tokens=120,
        temperature=0,
    )
    assert [item.name for item in named.output if item.type == "function_call"] == ["get_time"]

    # the call and its result go back in as items: a message answer, the chat route's for the same history
    call = calls[0]
    follow_up = [
        *ask,
        call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "18 C, sunny"},
    ]
    r2 = client.responses.create(model=MODEL, input=follow_up, tools=TOOLS, tool_choice="none", max_output_tokens=N_NEW, temperature=0)
    assert [item.type for item in r2.output] == ["message"]
    history = [
        *ask,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": "18 C, sunny"},
    ]
    _assert_same_as_chat(r2, _chat(server, history, tools=CHAT_TOOLS, tool_choice="none", max_tokens=N_NEW))
    server.wait_idle()


def _without_ids(obj: Any) -> Any:
    """A response as JSON, without what differs between two runs of it (ids, timestamps, cache hits)
    and the fields the SDK's stream helper adds (`parsed`, `parsed_arguments`)."""
    if isinstance(obj, dict):
        skip = {"id", "call_id", "item_id", "created_at", "completed_at", "cached_tokens", "parsed", "parsed_arguments"}
        return {k: _without_ids(v) for k, v in obj.items() if k not in skip}
    if isinstance(obj, list):
        return [_without_ids(v) for v in obj]
    return obj


def test_stream_events_parse_and_end_as_the_non_streamed_response(server: ServerProcess) -> None:
    from openai.types.responses import ResponseCompletedEvent, ResponseTextDeltaEvent

    client = server.openai()
    for kw in (
        {"input": "Once upon a time", "max_output_tokens": N_NEW},  # cut off: ends with response.incomplete
        {"input": "Once upon a time", "max_output_tokens": N_NEW, "extra_body": {"stop": ["e"]}},  # stopped: response.completed
        {
            "input": [{"role": "user", "content": ASK}],
            "tools": TOOLS,
            "tool_choice": "required",
            "parallel_tool_calls": False,
            "max_output_tokens": 120,
        },
    ):
        plain = client.responses.create(model=MODEL, temperature=0, **kw)
        if "extra_body" in kw or "tools" in kw:  # ended by a stop string or by the call's grammar
            assert plain.status == "completed"
        events = list(client.responses.create(model=MODEL, temperature=0, stream=True, **kw))
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
        assert events[0].response.status == "in_progress" and events[0].response.output == []
        # every event is one of the SDK's typed events (an unknown type would be a plain BaseModel)
        assert all(type(e).__module__.startswith("openai.types.responses.") for e in events), {type(e) for e in events}
        deltas = [e.delta for e in events if isinstance(e, ResponseTextDeltaEvent)]
        assert "".join(deltas) == plain.output_text
        last = events[-1]
        # cut off at max_output_tokens, OpenAI's stream ends with response.incomplete instead
        assert last.type == f"response.{plain.status}" and isinstance(last, ResponseCompletedEvent) == (plain.status == "completed")
        assert last.response.id == events[0].response.id
        assert _without_ids(last.response.model_dump()) == _without_ids(plain.model_dump())
        if plain.status == "completed":  # the SDK's own accumulator (responses.stream) rebuilds the same response
            with client.responses.stream(model=MODEL, temperature=0, **kw) as accumulated:
                final = accumulated.get_final_response()
            assert _without_ids(final.model_dump(include={"output", "usage", "status"})) == _without_ids(
                plain.model_dump(include={"output", "usage", "status"})
            )
        # each output item opens and closes in order
        added = [e.output_index for e in events if e.type == "response.output_item.added"]
        done = [e.output_index for e in events if e.type == "response.output_item.done"]
        assert added == done == list(range(len(plain.output)))
        if "tools" in kw:
            args = [e for e in events if e.type == "response.function_call_arguments.done"]
            assert [a.arguments for a in args] == [item.arguments for item in plain.output if item.type == "function_call"]
            assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == "".join(
                a.arguments for a in args
            )
        else:
            text_done = [e for e in events if e.type == "response.output_text.done"]
            assert [e.text for e in text_done] == [plain.output_text]

    # on the wire: `event: <type>` then `data: <json>` of that type, and no [DONE]
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.base_url + "/v1/responses", json=body, headers=server.headers(), timeout=60) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        blocks = [b for b in resp.read().decode().split("\n\n") if b]
    for block in blocks:
        event_line, data_line = block.split("\n")
        assert event_line.startswith("event: ") and data_line.startswith("data: ")
        assert json.loads(data_line[6:])["type"] == event_line[7:]
    last = json.loads(blocks[-1].split("\n")[1][6:])
    assert last["type"] == f"response.{last['response']['status']}" and last["response"]["status"] in ("completed", "incomplete")
    server.wait_idle()


def test_text_format_json_schema_validates(server: ServerProcess) -> None:
    client = server.openai()
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 10}, "population": {"type": "integer"}},
        "required": ["city", "population"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "name": "city", "schema": schema, "strict": True}
    ask = [{"role": "user", "content": "Describe Paris as JSON."}]
    r = client.responses.create(model=MODEL, input=ask, text={"format": fmt}, max_output_tokens=80, temperature=0)
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"
    chat_format = {"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}}
    _assert_same_as_chat(r, _chat(server, ask, response_format=chat_format, max_tokens=80))
    r = client.responses.create(model=MODEL, input=ask, text={"format": {"type": "json_object"}}, max_output_tokens=80, temperature=0)
    assert r.status == "completed" and isinstance(json.loads(r.output_text), dict)
    server.wait_idle()


def test_refused_requests_name_the_field(server: ServerProcess) -> None:
    ok: Dict[str, Any] = {"model": MODEL, "input": "hi", "max_output_tokens": 4}
    cases = [
        ({"previous_response_id": "resp_123"}, "previous_response_id", "unsupported_parameter"),
        ({"background": True}, "background", "unsupported_parameter"),
        ({"tools": [{"type": "web_search"}]}, "tools", None),
        ({"tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}]}, "tools", None),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]}, "input", None),
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "file-1"}]}]}, "input", None),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input", None),
        ({"frobnicate": True}, "frobnicate", "unknown_parameter"),
        ({"n": 2}, "n", "unknown_parameter"),
        ({"reasoning": {"effort": "high"}}, "reasoning.effort", "unsupported_parameter"),  # the template takes none
        ({"reasoning": {"summary": "auto"}}, "reasoning", "unsupported_parameter"),
        ({"truncation": "auto"}, "truncation", None),
        ({"max_output_tokens": 0}, "max_output_tokens", None),
        ({"max_output_tokens": -5}, "max_output_tokens", None),
        ({"max_output_tokens": "16"}, "max_output_tokens", None),
        ({"max_output_tokens": MAX_SEQ_LEN + 10}, "max_output_tokens", "context_length_exceeded"),
        ({"max_output_tokens": MAX_SEQ_LEN - 2}, "max_output_tokens", "context_length_exceeded"),  # with the prompt: the worker's check
        ({"tool_choice": "required"}, "tool_choice", None),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text", None),
    ]
    for extra, param, code in cases:
        resp = _post(server, {**ok, **extra})
        assert_error_body(resp, 400, param=param, code=code)
    # harmless fields are accepted (and logged): store true stores nothing
    harmless = {"store": True, "metadata": {"run": "7"}, "user": "alice", "service_tier": "auto", "text": {"verbosity": "low"}}
    resp = _post(server, {**ok, **harmless})
    assert resp.status_code == 200, resp.text
    assert resp.json()["store"] is False and resp.json()["metadata"] == {"run": "7"}
    assert httpx.post(server.base_url + "/v1/responses", json=ok, timeout=30).status_code == 401  # the API key applies
    m = server.wait_idle()
    assert m["minisgl_kv_pages_free"] == m["minisgl_kv_pages_total"]


# ---------------------------------------------------------------------------------------------
# In-process: the translation to chat, reasoning items
# ---------------------------------------------------------------------------------------------


def test_items_become_the_chat_messages_they_mean() -> None:
    body = ResponsesRequest.model_validate(
        {
            "instructions": "Be brief.",
            "input": [
                {"role": "user", "content": ASK},
                {"type": "reasoning", "id": "rs_1", "summary": []},  # an earlier thought: not rendered
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
                {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'},
                {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": '{"tz": "CET"}'},
                {"type": "function_call_output", "call_id": "c1", "output": "18 C"},
                {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "12:00"}]},
            ],
            "tools": TOOLS,
            "tool_choice": {"type": "function", "name": "get_time"},
            "parallel_tool_calls": False,
            "text": {"format": {"type": "json_object"}},
            "max_output_tokens": 7,
            "temperature": 0.5,
            "seed": 3,
        }
    )
    calls = [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}},
        {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": '{"tz": "CET"}'}},
    ]
    expected = ChatCompletionRequest.model_validate(
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": ASK},
                {"role": "assistant", "content": "Checking.", "tool_calls": calls},
                {"role": "tool", "tool_call_id": "c1", "content": "18 C"},
                {"role": "tool", "tool_call_id": "c2", "content": "12:00"},
            ],
            "tools": CHAT_TOOLS,
            "tool_choice": {"type": "function", "function": {"name": "get_time"}},
            "parallel_tool_calls": False,
            "response_format": {"type": "json_object"},
            "max_completion_tokens": 7,
            "temperature": 0.5,
            "seed": 3,
        }
    )
    chat = body.to_chat_request()
    assert [m.to_template() for m in chat.messages] == [m.to_template() for m in expected.messages]
    assert chat.active_tools() == expected.active_tools() and chat.must_call() and chat.parallel_tool_calls is False
    assert chat.sampling_params(chat.effective_max_tokens(), None) == expected.sampling_params(7, None)


def test_reasoning_message_and_call_items_streamed_and_not() -> None:
    from server_helpers import canned_app

    text = '<think>Need the weather.</think>\nLet me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    client, frontend = canned_app(text, "--reasoning-parser", "think")
    body = {"input": [{"role": "user", "content": "weather?"}], "tools": [{"type": "function", "name": "get_weather"}]}
    plain = client.post("/v1/responses", json=body).json()
    assert [item["type"] for item in plain["output"]] == ["reasoning", "message", "function_call"]
    thought, message, call = plain["output"]
    assert thought["content"] == [{"type": "reasoning_text", "text": "Need the weather."}]
    assert message["content"][0]["text"] == "Let me look."
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Oslo"}
    # the template ignores tools: they reached the model as a system message, as on chat
    assert frontend.sent[0].messages[0]["role"] == "system" and "get_weather" in frontend.sent[0].messages[0]["content"]

    with client.stream("POST", "/v1/responses", json={**body, "stream": True}) as resp:
        events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: ")]
    kinds = [e["type"] for e in events]
    thinking = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert thinking == "Need the weather."
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "Let me look."
    # the thought closes before the answer opens; the call comes last
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    assert (
        kinds.index("response.output_text.done") < kinds.index("response.function_call_arguments.done") < kinds.index("response.completed")
    )
    assert _without_ids(events[-1]["response"]) == _without_ids(plain)

    # the output passed back as input (the SDK's multi-turn pattern): the text and the call are one
    # assistant message carrying the thought as reasoning_content, the result a tool message
    result = {"type": "function_call_output", "call_id": call["call_id"], "output": "-3 C"}
    again = client.post("/v1/responses", json={**body, "input": [*body["input"], *plain["output"], result]})
    assert again.status_code == 200, again.text
    rendered = frontend.sent[-1].messages[1:]  # after the tools' system message
    assert [m["role"] for m in rendered] == ["user", "assistant", "tool"]
    assert rendered[1]["content"] == "Let me look." and rendered[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert rendered[1]["reasoning_content"] == "Need the weather."
    assert rendered[1]["tool_calls"][0]["id"] == rendered[2]["tool_call_id"] == call["call_id"] and rendered[2]["content"] == "-3 C"


def test_an_error_after_the_stream_started_is_an_error_event() -> None:
    import asyncio

    from server_helpers import canned_app

    from minisgl.message import ErrorMsg, ReplyMsg
    from minisgl.server.frontend import RequestStream

    client, frontend = canned_app("unused")

    def failing_submit(msgs: List[Any], label: str = "", choices: int = 1) -> RequestStream:
        stream = RequestStream(frontend, [m.uid for m in msgs], label, choices)  # type: ignore[arg-type]
        uid, loop = stream.uids[0], asyncio.get_running_loop()
        loop.call_soon(stream._deliver, uid, ReplyMsg(uid, "Hel", 1, False, None, 5, 1, 0, None, None, [7]))
        loop.call_soon(stream._deliver, uid, ErrorMsg(uid, "the scheduler step failed", 500))
        return stream

    frontend.submit = failing_submit  # type: ignore[method-assign]
    with client.stream("POST", "/v1/responses", json={"input": "hi", "stream": True}) as resp:
        assert resp.status_code == 200
        events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: ")]
    assert [e["type"] for e in events][-2:] == ["response.output_text.delta", "error"]
    assert events[-1]["message"] == "the scheduler step failed" and events[-1]["sequence_number"] == len(events) - 1
