"""The HTTP server end to end: a real `python -m minisgl` process tree on a free loopback port,
driven with the official `openai` client and with raw HTTP.

The model is a tiny random Llama (hidden 64, 2 layers) that shares the embedded SmolLM2's
tokenizer and chat template (vocab 49152), so prompts, chat templates and detokenization are real
while a forward pass costs a few milliseconds. Every greedy output is compared with
`minisgl.llm.LLM.generate` on the same checkpoint in float32.

The helpers (ServerProcess, the tiny chat model) are tests/server_helpers.py's.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Dict, List

import httpx
import pytest
from server_helpers import MAX_SEQ_LEN, ServerProcess
from server_helpers import assert_error_body as _assert_error

# ---------------------------------------------------------------------------------------------
# The tiny server and its reference outputs
# ---------------------------------------------------------------------------------------------

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three colours."}],
]
PROMPTS = ["The quick brown fox", "Once upon a time, in a land far away,", "1, 2, 3, 4,"]
CONCURRENT_PROMPTS = [
    f"Request number {i}: tell me about {w}" for i, w in enumerate(("cats dogs birds fish trees rocks rivers stars " * 4).split())
]
N_NEW = 24


@pytest.fixture(scope="module")
def server(chat_server_process: ServerProcess, reference: Dict[str, Any]) -> ServerProcess:
    """The session's chat server (conftest; the reference outputs are computed while it starts
    when this module is the first to use it)."""
    return chat_server_process.wait_ready()


@pytest.fixture(scope="module")
def reference(tiny_chat_model: str, chat_server_process: ServerProcess) -> Dict[str, Any]:
    """Greedy outputs of LLM.generate on the same checkpoint (built and shut down here), computed
    while the server process starts."""
    from minisgl.core import SamplingParams
    from minisgl.llm import LLM

    llm = LLM(tiny_chat_model, dtype="float32", max_seq_len_override=MAX_SEQ_LEN, num_page_override=16384, max_running_req=48)
    try:
        greedy = SamplingParams(temperature=0.0, max_tokens=N_NEW)
        with_lp = SamplingParams(temperature=0.0, max_tokens=N_NEW, logprobs=3)
        ref: Dict[str, Any] = {
            "chats": llm.generate(CHATS, with_lp),
            "prompts": llm.generate(PROMPTS, with_lp),
            "concurrent": llm.generate(CONCURRENT_PROMPTS, SamplingParams(temperature=0.0, max_tokens=32)),
            "long": llm.generate(["Write a long story."], SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)),
            "greedy": greedy,
        }
        ref["prompt_ids"] = [llm.encode(p) for p in PROMPTS]
    finally:
        llm.shutdown()
    return ref


def _post(server: ServerProcess, path: str, body: Any, **kw: Any) -> httpx.Response:
    headers = {**server.headers(), **kw.pop("headers", {})}
    return httpx.post(server.base_url + path, json=body, headers=headers, timeout=120, **kw)


def _sse_events(resp: httpx.Response) -> List[Any]:
    events = []
    for line in resp.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


# ---------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------


def test_models_health_and_auth(server: ServerProcess) -> None:
    assert httpx.get(server.base_url + "/health").json() == {"status": "ok"}
    models = server.openai().models.list()
    assert [m.id for m in models.data] == ["tiny_chat_llama"]
    # with an API key, every route but /health and /metrics needs it (/server_info shows the model path)
    assert httpx.get(server.base_url + "/server_info").status_code == 401
    info = httpx.get(server.base_url + "/server_info", headers=server.headers()).json()
    assert info["scheduler"]["max_seq_len"] == MAX_SEQ_LEN and info["scheduler"]["dtype"] == "float32"
    m = server.wait_metric("minisgl_kv_pages_total", 16384)  # (the scheduler's first stats arrive asynchronously)
    assert m["minisgl_kv_cache_usage"] == 0.0 and m["minisgl_kv_pages_total"] == 16384


def test_chat_greedy_matches_llm(server: ServerProcess, reference: Dict[str, Any]) -> None:
    client = server.openai()
    for chat, ref in zip(CHATS, reference["chats"]):
        resp = client.chat.completions.create(model="tiny_chat_llama", messages=chat, temperature=0, max_tokens=N_NEW)
        choice = resp.choices[0]
        assert choice.message.role == "assistant"
        assert choice.message.content == ref.text
        assert choice.finish_reason == ref.finish_reason
        assert resp.usage.prompt_tokens == ref.prompt_tokens
        assert resp.usage.completion_tokens == ref.completion_tokens


def test_chat_streaming_with_usage(server: ServerProcess, reference: Dict[str, Any]) -> None:
    client = server.openai()
    ref = reference["chats"][0]
    chunks = list(
        client.chat.completions.create(
            model="tiny_chat_llama",
            messages=CHATS[0],
            temperature=0,
            max_tokens=N_NEW,
            stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [ref.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == ref.completion_tokens
    assert chunks[-1].usage.prompt_tokens == ref.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])
    # without stream_options: no usage chunk
    chunks = list(client.chat.completions.create(model="tiny_chat_llama", messages=CHATS[0], temperature=0, max_tokens=4, stream=True))
    assert all(c.choices for c in chunks)


def test_completions_match_llm(server: ServerProcess, reference: Dict[str, Any]) -> None:
    client = server.openai()
    # a batch of prompts in one request
    resp = client.completions.create(model="tiny_chat_llama", prompt=PROMPTS, temperature=0, max_tokens=N_NEW)
    assert [c.text for c in sorted(resp.choices, key=lambda c: c.index)] == [r.text for r in reference["prompts"]]
    assert resp.usage.completion_tokens == sum(r.completion_tokens for r in reference["prompts"])
    # token-id prompt, streaming
    ids = reference["prompt_ids"][1]
    stream = client.completions.create(model="tiny_chat_llama", prompt=ids, temperature=0, max_tokens=N_NEW, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == reference["prompts"][1].text
    # the native API returns the token ids
    out = _post(server, "/generate", {"text": PROMPTS[2], "sampling_params": {"temperature": 0, "max_new_tokens": N_NEW}}).json()
    assert out["output_ids"] == reference["prompts"][2].token_ids
    assert out["text"] == reference["prompts"][2].text
    assert out["meta_info"]["finish_reason"]["type"] == reference["prompts"][2].finish_reason
    with httpx.stream(
        "POST", server.base_url + "/generate", headers=server.headers(), timeout=60,
        json={"text": PROMPTS[0], "sampling_params": {"temperature": 0, "max_new_tokens": N_NEW}, "stream": True},
    ) as resp:  # fmt: skip
        events = _sse_events(resp)
    assert events[-1] == "[DONE]" and events[-2]["text"] == reference["prompts"][0].text  # cumulative text


def test_n_and_seed(server: ServerProcess) -> None:
    client = server.openai()
    kw = dict(model="tiny_chat_llama", prompt="Pick a word:", max_tokens=8, temperature=1.0, n=4, seed=7)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert sorted(c.index for c in a.choices) == [0, 1, 2, 3]
    texts = [c.text for c in sorted(a.choices, key=lambda c: c.index)]
    assert texts == [c.text for c in sorted(b.choices, key=lambda c: c.index)]  # seeded: reproducible
    assert len(set(texts)) > 1  # choices are independent samples
    # the same choices streamed, interleaved by index
    streamed: Dict[int, str] = {}
    for chunk in client.completions.create(**kw, stream=True):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert [streamed[i] for i in range(4)] == texts
    chat = client.chat.completions.create(model="tiny_chat_llama", messages=CHATS[0], max_tokens=6, n=3, temperature=0)
    assert len(chat.choices) == 3 and len({c.message.content for c in chat.choices}) == 1  # greedy: all equal
    assert chat.usage.completion_tokens == 3 * 6


def test_stop_strings(server: ServerProcess, reference: Dict[str, Any]) -> None:
    client = server.openai()
    ref = reference["prompts"][0]
    full = ref.text
    stop = full[len(full) // 3 : len(full) // 3 + 4]
    expected = full[: full.find(stop)]
    before = server.metrics().get("minisgl_aborted_requests_total", 0.0)
    resp = client.completions.create(model="tiny_chat_llama", prompt=PROMPTS[0], temperature=0, max_tokens=N_NEW, stop=[stop, "@@@@"])
    assert resp.choices[0].text == expected
    assert resp.choices[0].finish_reason == "stop"
    stream = client.completions.create(model="tiny_chat_llama", prompt=PROMPTS[0], temperature=0, max_tokens=N_NEW, stop=stop, stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"
    # chat: the stop string is trimmed as well
    chat_ref = reference["chats"][0].text
    cstop = chat_ref[len(chat_ref) // 2 : len(chat_ref) // 2 + 3]
    resp = client.chat.completions.create(model="tiny_chat_llama", messages=CHATS[0], temperature=0, max_tokens=N_NEW, stop=cstop)
    assert resp.choices[0].message.content == chat_ref[: chat_ref.find(cstop)]
    # A request that stops early is aborted in the scheduler (its pages freed at once). The ones
    # above may reach max_tokens before their abort arrives (a race with the clock); this one
    # would run hundreds of steps past its stop string, so its abort always lands first.
    long = client.completions.create(
        model="tiny_chat_llama", prompt=PROMPTS[0], temperature=0, max_tokens=MAX_SEQ_LEN - 64, stop=[stop], extra_body={"ignore_eos": True}
    )
    assert long.choices[0].text == expected and long.choices[0].finish_reason == "stop"
    m = server.wait_idle()
    assert m["minisgl_aborted_requests_total"] >= before + 1
    assert m["minisgl_kv_cache_usage"] == 0.0


def test_logit_bias_min_tokens_and_included_stop(server: ServerProcess, reference: Dict[str, Any]) -> None:
    ids = reference["prompt_ids"][0]
    ref = reference["prompts"][0].token_ids
    base = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}}

    def gen(**sampling: Any) -> List[int]:
        resp = _post(server, "/generate", {**base, "sampling_params": {**base["sampling_params"], **sampling}})
        assert resp.status_code == 200, resp.text
        return resp.json()["output_ids"]

    assert gen() == ref[:6]
    assert gen(logit_bias={str(ref[0]): -100})[0] != ref[0]  # the greedy token is gone
    assert gen(logit_bias={"42": 100}) == [42] * 6  # and a forced one is all there is
    assert gen(stop_token_ids=[ref[1]]) == ref[:2]
    held = gen(stop_token_ids=[ref[1]], min_new_tokens=4)
    assert ref[1] not in held[:4] and held[0] == ref[0]
    # the OpenAI names, through the openai client
    client = server.openai()
    resp = client.completions.create(model="tiny_chat_llama", prompt=ids, temperature=0, max_tokens=6, logit_bias={"42": 100})
    assert resp.choices[0].text == server_decode(server, [42] * 6)
    full = reference["prompts"][0].text
    stop = full[len(full) // 3 : len(full) // 3 + 4]
    kept = client.completions.create(
        model="tiny_chat_llama", prompt=PROMPTS[0], temperature=0, max_tokens=N_NEW, stop=[stop],
        extra_body={"include_stop_str_in_output": True},
    )  # fmt: skip
    assert kept.choices[0].text == full[: full.find(stop) + len(stop)] and kept.choices[0].finish_reason == "stop"


def test_structured_output_through_the_openai_client(server: ServerProcess) -> None:
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(max_length=8)
        age: int = Field(ge=0, le=120)
        colour: str = Field(pattern="^(red|green|blue)$")

    client = server.openai()
    done = client.chat.completions.parse(model="tiny_chat_llama", messages=CHATS[0], response_format=Person, max_tokens=200, temperature=0)
    person = done.choices[0].message.parsed
    assert isinstance(person, Person) and done.choices[0].finish_reason == "stop"
    # json_object, and a schema through /generate and completions
    obj = client.chat.completions.create(
        model="tiny_chat_llama", messages=CHATS[0], response_format={"type": "json_object"}, max_tokens=120, temperature=1.0, seed=3
    )
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content or ""), dict)
    resp = _post(
        server, "/generate", {"text": "code:", "sampling_params": {"regex": "[0-9]{3}-[A-Z]{2}", "max_new_tokens": 20, "temperature": 0}}
    )
    assert resp.status_code == 200 and __import__("re").fullmatch("[0-9]{3}-[A-Z]{2}", resp.json()["text"]), resp.text
    comp = client.completions.create(
        model="tiny_chat_llama", prompt="x", max_tokens=50, temperature=0,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "e", "schema": {"enum": ["on", "off"]}}}},
    )  # fmt: skip
    assert json.loads(comp.choices[0].text) in ("on", "off")
    # a bad schema or regex is a 400 naming the field
    bad = _post(
        server,
        "/v1/chat/completions",
        {"messages": CHATS[0], "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}}},
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "response_format", bad.text
    bad = _post(server, "/generate", {"text": "x", "sampling_params": {"regex": "a(", "max_new_tokens": 3}})
    assert bad.status_code == 400, bad.text
    server.wait_idle()


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"type": "string", "maxLength": 6}}, "required": ["tz"], "additionalProperties": False}}},
]  # fmt: skip


def test_tool_calls(server: ServerProcess) -> None:
    import jsonschema

    client = server.openai()
    params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]

    def check_calls(calls: Any, names: set) -> None:
        assert calls
        for call in calls:
            assert call.function.name in names and call.id.startswith("call_") and call.type == "function"
            jsonschema.validate(json.loads(call.function.arguments), params[call.function.name])

    # required: a small random model still emits a valid call (the grammar enforces it)
    r = client.chat.completions.create(
        model="tiny_chat_llama", messages=ask, tools=TOOLS, tool_choice="required", max_tokens=120, temperature=0
    )
    assert r.choices[0].finish_reason == "tool_calls"
    check_calls(r.choices[0].message.tool_calls, set(params))
    named = {"type": "function", "function": {"name": "get_time"}}
    r = client.chat.completions.create(
        model="tiny_chat_llama", messages=ask, tools=TOOLS, tool_choice=named, max_tokens=120, temperature=0.8, seed=1
    )
    check_calls(r.choices[0].message.tool_calls, {"get_time"})
    # streamed: content deltas, then the calls as tool_calls deltas, then finish_reason tool_calls
    chunks = list(
        client.chat.completions.create(
            model="tiny_chat_llama", messages=ask, tools=TOOLS, tool_choice="required", max_tokens=120, temperature=0, stream=True
        )
    )
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    check_calls(deltas, set(params))
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # auto: the model decides (a random one writes prose); the answer is well-formed either way
    r = client.chat.completions.create(model="tiny_chat_llama", messages=ask, tools=TOOLS, max_tokens=16, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # a conversation with a call and its result goes through the chat template
    history = ask + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    ]
    r = client.chat.completions.create(model="tiny_chat_llama", messages=history, tools=TOOLS, max_tokens=8, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # bad tool requests are 400s naming the field
    bad = _post(
        server, "/v1/chat/completions", {"messages": ask, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tool_choice", bad.text
    bad = _post(server, "/v1/chat/completions", {"messages": ask, "tool_choice": "required"})
    assert bad.status_code == 400, bad.text
    bad = _post(server, "/v1/chat/completions", {"messages": ask, "tools": [{"type": "function", "function": {"name": "bad name!"}}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tools", bad.text
    server.wait_idle()


def test_tokenize_and_detokenize(server: ServerProcess, reference: Dict[str, Any]) -> None:
    ids = reference["prompt_ids"][0]
    resp = _post(server, "/tokenize", {"prompt": PROMPTS[0]})
    assert resp.status_code == 200 and resp.json() == {"count": len(ids), "max_model_len": MAX_SEQ_LEN, "tokens": ids}
    chat = _post(server, "/tokenize", {"messages": CHATS[0]}).json()
    assert chat["count"] == reference["chats"][0].prompt_tokens  # the same template as generation
    assert _post(server, "/detokenize", {"tokens": ids}).json()["prompt"].endswith(PROMPTS[0])
    assert _post(server, "/detokenize", {"tokens": [10**7]}).status_code == 400
    assert _post(server, "/tokenize", {"prompt": "x", "messages": CHATS[0]}).status_code == 400
    assert httpx.post(server.base_url + "/tokenize", json={"prompt": "x"}).status_code == 401


def test_echo_prompt_logprobs_for_lm_eval(server: ServerProcess, reference: Dict[str, Any], tiny_chat_model: str) -> None:
    """lm-eval's loglikelihood request: echo + logprobs, max_tokens 0 or 1; checked against HF's
    log-softmax over the same prompt (float32), cold and with the prompt already in the cache."""
    import torch
    from helpers import HFOracle

    ids = reference["prompt_ids"][1]
    expect = torch.log_softmax(HFOracle(tiny_chat_model).logits(ids), dim=-1)
    for max_tokens in (0, 1, 1):  # the third run finds the prompt in the prefix cache
        body = {"prompt": ids, "max_tokens": max_tokens, "logprobs": 1, "echo": True, "temperature": 0}
        choice = _post(server, "/v1/completions", body).json()["choices"][0]
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(ids) + max_tokens and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        for p in range(1, len(ids)):
            assert abs(lp["token_logprobs"][p] - expect[p - 1, ids[p]].item()) < 1e-4
            ((best_text, best),) = lp["top_logprobs"][p].items()
            assert abs(best - expect[p - 1].max().item()) < 1e-4
        assert choice["text"] == PROMPTS[1] if max_tokens == 0 else choice["text"].startswith(PROMPTS[1])
    # a string prompt echoes itself; /generate returns input_token_logprobs from logprob_start_len
    text = _post(server, "/v1/completions", {"prompt": PROMPTS[1], "max_tokens": 2, "echo": True, "temperature": 0}).json()["choices"][0][
        "text"
    ]
    assert text == PROMPTS[1] + reference["prompts"][1].text[: len(text) - len(PROMPTS[1])]
    meta = _post(
        server,
        "/generate",
        {"input_ids": ids, "return_logprob": True, "logprob_start_len": 2, "sampling_params": {"max_new_tokens": 1, "temperature": 0}},
    ).json()["meta_info"]
    assert len(meta["input_token_logprobs"]) == len(ids) - 2
    assert abs(meta["input_token_logprobs"][0][0] - expect[1, ids[2]].item()) < 1e-4 and meta["input_token_logprobs"][0][1] == ids[2]
    assert _post(server, "/v1/completions", {"prompt": "x", "max_tokens": 0}).status_code == 400  # 0 only with echo
    server.wait_idle()


def server_decode(server: ServerProcess, ids: List[int]) -> str:
    from minisgl.utils.hf import load_tokenizer

    return load_tokenizer(server_model_path(server)).decode(ids, skip_special_tokens=True)


def server_model_path(server: ServerProcess) -> str:
    return httpx.get(server.base_url + "/server_info", headers=server.headers()).json()["model_path"]


def test_logprobs(server: ServerProcess, reference: Dict[str, Any]) -> None:
    client = server.openai()
    ref = reference["chats"][1]
    resp = client.chat.completions.create(
        model="tiny_chat_llama", messages=CHATS[1], temperature=0, max_tokens=N_NEW, logprobs=True, top_logprobs=3
    )
    content = resp.choices[0].logprobs.content
    assert len(content) == ref.completion_tokens
    for item, lp, tops in zip(content, ref.logprobs, ref.top_logprobs):
        assert item.logprob == pytest.approx(lp, abs=1e-4)
        assert [t.logprob for t in item.top_logprobs] == pytest.approx([v for _, v in tops], abs=1e-4)
        assert item.top_logprobs[0].token == item.token  # greedy: the chosen token is the best one
    assert "".join(i.token for i in content) == resp.choices[0].message.content
    # completions: logprobs=int
    cref = reference["prompts"][1]
    resp = client.completions.create(model="tiny_chat_llama", prompt=PROMPTS[1], temperature=0, max_tokens=N_NEW, logprobs=3)
    lp = resp.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx(cref.logprobs, abs=1e-4)
    assert [len(t) for t in lp.top_logprobs] == [3] * len(cref.logprobs)
    assert "".join(lp.tokens) == resp.choices[0].text
    # streamed logprobs add up to the same
    stream = client.chat.completions.create(
        model="tiny_chat_llama", messages=CHATS[1], temperature=0, max_tokens=N_NEW, logprobs=True, stream=True
    )
    streamed = [i.logprob for c in stream if c.choices and c.choices[0].logprobs for i in c.choices[0].logprobs.content]
    assert streamed == pytest.approx(ref.logprobs, abs=1e-4)


def test_penalties_and_sampling_knobs_accepted(server: ServerProcess) -> None:
    client = server.openai()
    resp = client.chat.completions.create(
        model="tiny_chat_llama", messages=CHATS[0], max_tokens=8, temperature=0.7, top_p=0.9, seed=3,
        presence_penalty=0.5, frequency_penalty=0.5,
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.2, "ignore_eos": True, "stop_token_ids": [2]},
    )  # fmt: skip
    assert resp.choices[0].finish_reason == "length" and resp.usage.completion_tokens == 8


def test_concurrent_streaming_clients(server: ServerProcess, reference: Dict[str, Any]) -> None:
    idle_usage = server.metrics()["minisgl_kv_cache_usage"]
    client = server.async_openai()

    async def one(prompt: str) -> tuple[str, str | None]:
        stream = await client.completions.create(model="tiny_chat_llama", prompt=prompt, temperature=0, max_tokens=32, stream=True)
        parts, finish = [], None
        async for chunk in stream:
            parts.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
        return "".join(parts), finish

    async def main() -> List[tuple[str, str | None]]:
        try:
            return await asyncio.gather(*(one(p) for p in CONCURRENT_PROMPTS))
        finally:
            await client.close()

    assert len(CONCURRENT_PROMPTS) == 32
    results = asyncio.run(main())
    assert [r[0] for r in results] == [r.text for r in reference["concurrent"]]
    assert [r[1] for r in results] == [r.finish_reason for r in reference["concurrent"]]
    m = server.wait_idle()
    assert m["minisgl_kv_cache_usage"] == idle_usage
    assert m["minisgl_kv_pages_free"] == m["minisgl_kv_pages_total"]
    assert m["minisgl_time_to_first_token_seconds_count"] >= 32
    assert m["minisgl_inter_token_latency_seconds_count"] > 0


def test_client_disconnect_aborts_request(server: ServerProcess) -> None:
    server.wait_idle()
    before = server.metrics()["minisgl_aborted_requests_total"]
    body = {
        "model": "tiny_chat_llama",
        "prompt": "Tell me everything.",
        "max_tokens": MAX_SEQ_LEN - 16,  # as long as it can be: it must outlast three events and a hang-up
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, headers=server.headers(), timeout=60) as resp:
        assert resp.status_code == 200
        seen = 0
        for line in resp.iter_lines():
            if line.startswith("data: "):
                seen += 1
                if seen == 3:
                    break  # leave mid-stream: closing the response closes the connection
    server.wait_metric("minisgl_aborted_requests_total", before + 1)
    m = server.wait_idle()
    assert m["minisgl_aborted_requests_total"] == before + 1
    assert m["minisgl_kv_cache_usage"] == 0.0
    assert m["minisgl_kv_pages_free"] == m["minisgl_kv_pages_total"]

    # the non-streaming half (a client that hangs up before its answer) is
    # test_server_units.py's test_a_non_streaming_client_that_hangs_up_aborts_its_request: here the
    # request could finish before the hang-up arrives, a race only a clock would decide


def test_bad_inputs_get_openai_errors(server: ServerProcess) -> None:
    url = server.base_url
    h = {**server.headers(), "Content-Type": "application/json"}
    chat = "/v1/chat/completions"
    msgs = [{"role": "user", "content": "hi"}]

    def post(path: str, body: Any, headers: Dict[str, str] | None = None) -> httpx.Response:
        content = body if isinstance(body, (bytes, str)) else json.dumps(body)
        return httpx.post(url + path, content=content, headers=h if headers is None else headers, timeout=60)

    _assert_error(post(chat, b'{"messages": [{"role": "user", "content": "hi"'), 400, code="invalid_json")
    _assert_error(post(chat, b""), 400)
    _assert_error(post(chat, b"[1, 2]"), 400)
    _assert_error(post(chat, {"model": "tiny_chat_llama"}), 400, param="messages")
    _assert_error(post(chat, {"messages": []}), 400, param="messages")
    _assert_error(post(chat, {"messages": "hello"}), 400, param="messages")
    _assert_error(post(chat, {"messages": [{"content": "no role"}]}), 400)
    _assert_error(
        post(chat, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}), 400, param="messages"
    )
    err = _assert_error(post(chat, {"model": "gpt-17", "messages": msgs}), 404, param="model", code="model_not_found")
    assert "gpt-17" in err["message"]
    _assert_error(post(chat, {"messages": msgs, "temperature": -0.5}), 400, param="temperature")
    _assert_error(post(chat, {"messages": msgs, "temperature": "hot"}), 400, param="temperature")
    _assert_error(post(chat, {"messages": msgs, "top_p": 1.5}), 400, param="top_p")
    _assert_error(post(chat, {"messages": msgs, "max_tokens": 0}), 400, param="max_tokens")
    _assert_error(post(chat, {"messages": msgs, "max_tokens": -3}), 400, param="max_tokens")
    _assert_error(post(chat, {"messages": msgs, "max_tokens": "ten"}), 400, param="max_tokens")
    _assert_error(post(chat, {"messages": msgs, "max_completion_tokens": 0}), 400, param="max_completion_tokens")
    _assert_error(post(chat, {"messages": msgs, "n": 1.5}), 400, param="n")
    _assert_error(post(chat, {"messages": msgs, "stream": "yes please"}), 400, param="stream")
    _assert_error(post(chat, {"messages": msgs, "top_logprobs": 50, "logprobs": True}), 400, param="top_logprobs")
    _assert_error(post(chat, {"messages": msgs, "presence_penalty": 3}), 400, param="presence_penalty")
    # beyond the context: found by the scheduler, still a 400 (also for a stream, before it starts)
    err = _assert_error(post(chat, {"messages": msgs, "max_tokens": MAX_SEQ_LEN * 4}), 400, param="max_tokens")
    assert str(MAX_SEQ_LEN) in err["message"]
    _assert_error(post(chat, {"messages": msgs, "max_tokens": MAX_SEQ_LEN * 4, "stream": True}), 400, param="max_tokens")
    long_text = "word " * (MAX_SEQ_LEN + 50)
    _assert_error(post(chat, {"messages": [{"role": "user", "content": long_text}], "max_tokens": 4}), 400)
    _assert_error(post("/v1/completions", {"prompt": long_text}), 400)
    _assert_error(post("/v1/completions", {"prompt": [7] * (MAX_SEQ_LEN + 1), "max_tokens": 1}), 400)
    _assert_error(post("/v1/completions", {"prompt": [10**7], "max_tokens": 1}), 400, param="prompt")
    _assert_error(post("/v1/completions", {"prompt": ""}), 400, param="prompt")
    _assert_error(post("/v1/completions", {"prompt": "hi", "logprobs": 99}), 400, param="logprobs")
    _assert_error(post("/v1/completions", {"prompt": "hi", "suffix": "there"}), 400)
    _assert_error(post("/generate", {"sampling_params": {"max_new_tokens": 2}}), 400)
    # 40 MB: refused by Content-Length before reading, and while streaming a chunked body
    big = b'{"messages": [{"role": "user", "content": "' + b"x" * (40 << 20) + b'"}]}'
    _assert_error(post(chat, big), 413, code="request_too_large")

    def chunks():
        for i in range(0, len(big), 1 << 20):
            yield big[i : i + (1 << 20)]

    _assert_error(httpx.post(url + chat, content=chunks(), headers=h, timeout=60), 413, code="request_too_large")
    # authentication
    _assert_error(post(chat, {"messages": msgs}, headers={"Content-Type": "application/json"}), 401, code="invalid_api_key")
    _assert_error(post(chat, {"messages": msgs}, headers={"Authorization": "Bearer wrong"}), 401, code="invalid_api_key")
    _assert_error(httpx.get(url + "/v1/models"), 401)
    import openai

    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.BadRequestError):
        server.openai().chat.completions.create(model="tiny_chat_llama", messages=msgs, temperature=-1)
    with pytest.raises(openai.NotFoundError):
        server.openai().chat.completions.create(model="nope", messages=msgs)
    # unknown routes and methods are JSON errors too
    _assert_error(httpx.get(url + "/v1/nothing-here"), 404)
    _assert_error(httpx.get(url + chat, headers=h), 405)
    # after the barrage the server still answers, and nothing leaked
    resp = server.openai().chat.completions.create(model="tiny_chat_llama", messages=msgs, max_tokens=3, temperature=0)
    assert resp.choices[0].finish_reason == "length"
    assert httpx.get(url + "/health").status_code == 200
    m = server.wait_idle()
    assert m["minisgl_kv_cache_usage"] == 0.0
