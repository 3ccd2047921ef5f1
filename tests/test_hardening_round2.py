"""The second red-team barrage, fixed: JSON nested 100,000 deep in client strings (tool-call
arguments, guided_json, ...) was a 500; logit_bias read " 10", "+10", "1_0", "١٠" and "010" as token
ids; min_tokens beyond the context was accepted; a cross-site text/plain POST emptied the prefix
cache; a long /tokenize stalled everyone's streams.

The pure functions are checked in-process (json_depth against the parsed tree as its oracle); the
rest against one real `python -m minisgl` on the tiny chat model (tests/server_helpers.py).
"""

from __future__ import annotations

import json
import random
import statistics
import threading
import time
from typing import Any, Dict, Iterator, List

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from server_helpers import ServerProcess, assert_error_body, serving

from minisgl.sampling_params import InvalidRequest, SamplingParams, check_context
from minisgl.server.limits import MAX_JSON_DEPTH, MalformedJSON, json_depth, parse_json
from minisgl.server.protocol import ChatCompletionRequest, GenerateRequest
from minisgl.server.tools import PARSERS

MSGS = [{"role": "user", "content": "Say something."}]
CHAT = "/v1/chat/completions"
SEQ_LEN = 1024
GOOD_ORIGIN = "http://good.example"
DEEP = "[" * 100_000 + "]" * 100_000
GRAMMAR_DEEP = "[" * 30_000 + "]" * 30_000  # within the 64K characters a grammar may have

# ---------------------------------------------------------------------------------------------
# In-process: the depth-checked parser, logit_bias keys, min_tokens
# ---------------------------------------------------------------------------------------------


def _tree_depth(value: Any) -> int:
    """The oracle: how deep the parsed value nests (each list or object one level)."""
    if isinstance(value, dict):
        return 1 + max((_tree_depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((_tree_depth(v) for v in value), default=0)
    return 0


# strings full of what could fool a bracket count: brackets, quotes, backslashes
_TRICKY = st.text(alphabet=st.sampled_from(list('[]{}"\\:,ab\n\u00e9\u4e2d')), max_size=12)
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | _TRICKY,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_TRICKY, inner, max_size=4),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(_JSON, st.booleans(), st.sampled_from([None, 1]))
def test_json_depth_is_the_parsed_depth(value: Any, ascii_only: bool, indent: int | None) -> None:
    text = json.dumps(value, ensure_ascii=ascii_only, indent=indent)
    assert json_depth(text) == _tree_depth(json.loads(text))
    assert json_depth(text.encode("utf-8")) == _tree_depth(value)


def test_json_depth_of_unterminated_and_hostile_strings() -> None:
    assert json_depth('["\\"[') == 1  # the string never ends: what follows its quote is inside it
    assert json_depth('[["ab\\') == 2  # a lone backslash last
    assert json_depth('"]"[' * 1000) == 1000  # the brackets in strings count for nothing
    # escaped quotes in a string that never ends: a search retried at each quote would be
    # quadratic (hours for this); the scan is linear
    assert json_depth("[" + '"' + '\\"' * 2_000_000 + "[[[") == 1
    assert json_depth('"a' * 2_000_000 + "[") == 1


def test_parse_json_refuses_before_parsing() -> None:
    with pytest.raises(InvalidRequest) as deep:
        parse_json(DEEP, "arguments", "the arguments")
    assert deep.value.param == "arguments" and str(MAX_JSON_DEPTH) in deep.value.message
    limit = "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH
    assert _tree_depth(parse_json(limit, "x", "x")) == MAX_JSON_DEPTH
    with pytest.raises(InvalidRequest):
        parse_json("[" + limit + "]", "x", "x")
    # a body names the top-level field its too deep value is in
    body = '{"model": "m", "messages": [{"role": "user", "content": ' + DEEP + "}]}"
    with pytest.raises(InvalidRequest) as named:
        parse_json(body.encode(), None, "the request body")
    assert named.value.param == "messages"
    with pytest.raises(InvalidRequest) as dup:  # json.loads keeps the last value silently
        parse_json('{"logit_bias": {"10": 1, "10": -100}}', None, "the request body")
    assert dup.value.param == "logit_bias" and "'10'" in dup.value.message
    with pytest.raises(MalformedJSON):
        parse_json("[1,", "x", "x")


NON_CANONICAL_KEYS = [" 10", "10 ", "1_0", "+10", "-1", "\u0661\u0660", "010", "00", "1e1", "0x1", "", "10\n", "\uff11"]


@pytest.mark.parametrize("key", NON_CANONICAL_KEYS)
def test_logit_bias_keys_must_be_canonical(key: str) -> None:
    chat = ChatCompletionRequest.model_validate({"messages": MSGS, "logit_bias": {key: 5}})
    with pytest.raises(InvalidRequest) as exc:
        chat.sampling_params(None, None)
    assert exc.value.param == "logit_bias"
    gen = GenerateRequest.model_validate({"text": "hi", "sampling_params": {"logit_bias": {key: 5}}})
    with pytest.raises(InvalidRequest) as exc:
        gen.sampling_params.sampling_params(None)
    assert exc.value.param == "sampling_params.logit_bias"


def test_canonical_logit_bias_keys_are_token_ids() -> None:
    keys = ["0", "7", "10", "49151"]
    chat = ChatCompletionRequest.model_validate({"messages": MSGS, "logit_bias": {k: float(i) for i, k in enumerate(keys)}})
    assert chat.sampling_params(None, None).logit_bias == {int(k): float(i) for i, k in enumerate(keys)}


def test_min_tokens_is_bounded_by_max_tokens_and_the_context() -> None:
    with pytest.raises(InvalidRequest) as exc:
        SamplingParams(max_tokens=None, min_tokens=1_000_000).validate(100, SEQ_LEN)
    assert exc.value.param == "min_tokens" and f"[0, {SEQ_LEN - 1}]" in exc.value.message
    with pytest.raises(InvalidRequest) as exc:
        SamplingParams(max_tokens=5, min_tokens=6).validate(100, SEQ_LEN)
    assert exc.value.param == "min_tokens" and "[0, 5]" in exc.value.message
    SamplingParams(max_tokens=None, min_tokens=SEQ_LEN - 1).validate(100, SEQ_LEN)
    # prompt + min_tokens must fit: the room is what the context leaves after the prompt
    assert check_context(24, None, SEQ_LEN, strict=False, min_tokens=SEQ_LEN - 24) == SEQ_LEN - 24
    with pytest.raises(InvalidRequest) as exc:
        check_context(24, None, SEQ_LEN, strict=False, min_tokens=SEQ_LEN - 23)
    assert exc.value.param == "min_tokens" and f"[0, {SEQ_LEN - 24}]" in exc.value.message


# POSTs that compute an answer and change nothing the next request sees (the generation routes
# are as cheap to abuse cross-site as to call: JSON-only already forces a preflight on them)
COMPUTE_ONLY_POSTS = {"/v1/completions", "/v1/chat/completions", "/generate", "/v1/responses", "/v1/embeddings", "/tokenize", "/detokenize"}


def test_every_state_changing_route_requires_same_site() -> None:
    import importlib
    import pkgutil

    from fastapi import APIRouter
    from fastapi.routing import APIRoute

    import minisgl.server.routes as package
    from minisgl.server.routes.common import require_same_site

    modules = [importlib.import_module(f"{package.__name__}.{m.name}") for m in pkgutil.iter_modules(package.__path__)]
    routers = [r for m in modules for r in vars(m).values() if isinstance(r, APIRouter)]
    routes = [r for router in routers for r in router.routes if isinstance(r, APIRoute)]
    changing = [r for r in routes if r.methods - {"GET", "HEAD"} and r.path not in COMPUTE_ONLY_POSTS]
    assert "/flush_cache" in {r.path for r in changing}
    unguarded = [r.path for r in changing if require_same_site not in {d.call for d in r.dependant.dependencies}]
    assert unguarded == [], f"state-changing routes without require_same_site: {unguarded}"


# ---------------------------------------------------------------------------------------------
# A real server
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tiny_chat_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with serving(
        tiny_chat_model, "--dtype", "float32", "--max-seq-len", str(SEQ_LEN), "--num-pages", "4096",
        "--max-prompt-bytes", str(8 << 20), "--max-request-bytes", str(16 << 20), "--num-tokenizer-workers", "1",
        "--allowed-origins", GOOD_ORIGIN, log_dir=tmp_path_factory.mktemp("hardening_round2"),
    ) as srv:  # fmt: skip
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerProcess):
    with httpx.Client(base_url=server.base_url, timeout=120) as c:
        yield c


def post_raw(client: httpx.Client, path: str, body: str, headers: Dict[str, str] | None = None) -> httpx.Response:
    return client.post(path, content=body, headers={"Content-Type": "application/json", **(headers or {})})


def assert_clean(server: ServerProcess) -> None:
    """Healthy, nothing running or registered, every KV page free."""
    assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200
    m = server.wait_idle()
    assert m["minisgl_kv_pages_free"] == m["minisgl_kv_pages_total"], m


def _tool_call_messages(arguments: Any) -> List[Dict[str, Any]]:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return [*MSGS, {"role": "assistant", "content": None, "tool_calls": [call]}, {"role": "tool", "tool_call_id": "c1", "content": "ok"}]


def test_deep_json_in_client_strings_is_a_400(server: ServerProcess, client: httpx.Client) -> None:
    for arguments in (DEEP, '{"a": ' + DEEP + "}", '"\\ud800"', '{"k": 1, "k": 2}'):
        for path, extra in ((CHAT, {"max_tokens": 2}), ("/tokenize", {})):
            resp = client.post(path, json={"messages": _tool_call_messages(arguments), **extra})
            err = assert_error_body(resp, 400, param="messages")
            assert "arguments" in err["message"], err
    # an object nested deep as the arguments (sent as an object, refused before pydantic)
    deep_object = '{"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": ' + DEEP + "}}]}]}"
    for path in (CHAT, "/tokenize"):
        assert_error_body(post_raw(client, path, deep_object), 400, param="messages", code="invalid_json")
    # every string the server parses as JSON, with the field named
    for field, value in (("guided_json", GRAMMAR_DEEP), ("structured_outputs", {"json": GRAMMAR_DEEP})):
        assert_error_body(client.post(CHAT, json={"messages": MSGS, field: value, "max_tokens": 2}), 400, param=field)
    gen = {"text": "hi", "sampling_params": {"json_schema": GRAMMAR_DEEP, "max_new_tokens": 2}}
    assert_error_body(client.post("/generate", json=gen), 400, param="sampling_params.json_schema")
    # a content part that is not text, on /tokenize too
    parts = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    assert_error_body(client.post("/tokenize", json={"messages": parts}), 400, param="messages")
    # well-formed arguments still render
    ok = client.post(CHAT, json={"messages": _tool_call_messages('{"city": "Paris"}'), "max_tokens": 2})
    assert ok.status_code == 200, ok.text
    assert_clean(server)


def test_logit_bias_and_min_tokens_are_strict(server: ServerProcess, client: httpx.Client) -> None:
    for key in (" 10", "1_0", "+10", "\u0661\u0660", "010"):
        assert_error_body(client.post(CHAT, json={"messages": MSGS, "max_tokens": 2, "logit_bias": {key: 5}}), 400, param="logit_bias")
        gen = {"text": "hi", "sampling_params": {"max_new_tokens": 2, "logit_bias": {key: 5}}}
        assert_error_body(client.post("/generate", json=gen), 400, param="sampling_params.logit_bias")
    twice = '{"messages": ' + json.dumps(MSGS) + ', "max_tokens": 2, "logit_bias": {"10": 5, "10": -100}}'
    assert_error_body(post_raw(client, CHAT, twice), 400, param="logit_bias", code="invalid_json")
    assert client.post(CHAT, json={"messages": MSGS, "max_tokens": 2, "logit_bias": {"0": 1, "10": 5}}).status_code == 200
    # min_tokens: never more than max_tokens, nor than the context leaves after the prompt
    err = assert_error_body(client.post(CHAT, json={"messages": MSGS, "min_tokens": 1_000_000}), 400, param="min_tokens")
    assert f"[0, {SEQ_LEN - 1}]" in err["message"]
    err = assert_error_body(client.post(CHAT, json={"messages": MSGS, "max_tokens": 3, "min_tokens": 4}), 400, param="min_tokens")
    assert "[0, 3]" in err["message"]
    prompt_tokens = client.post("/tokenize", json={"messages": MSGS}).json()["count"]
    room = SEQ_LEN - prompt_tokens
    for stream in (False, True):
        resp = client.post(CHAT, json={"messages": MSGS, "min_tokens": room + 1, "stream": stream})
        err = assert_error_body(resp, 400, param="min_tokens")
        assert f"[0, {room}]" in err["message"], err
    assert_clean(server)


def test_state_changing_routes_refuse_cross_site_requests(server: ServerProcess, client: httpx.Client) -> None:
    own = server.base_url

    def flush(body: str | None, headers: Dict[str, str]) -> httpx.Response:
        return client.post("/flush_cache", content=body, headers=headers)

    def fill_cache() -> None:
        assert client.post("/v1/completions", json={"prompt": "cache me " * 20, "max_tokens": 2}).status_code == 200
        server.wait_idle()

    fill_cache()
    # what a web page can send without a preflight: refused, and the cache stays
    evil = {"Origin": "http://evil.example"}
    assert_error_body(flush("{}", {**evil, "Content-Type": "text/plain"}), 403, code="forbidden_origin")
    assert_error_body(flush(None, evil), 403, code="forbidden_origin")
    assert_error_body(flush("{}", {**evil, "Content-Type": "application/json"}), 403, code="forbidden_origin")
    assert_error_body(flush("{}", {"Origin": "null", "Content-Type": "text/plain"}), 403, code="forbidden_origin")
    # an allowed or this server's own origin must still declare JSON; so must any body
    for origin in (GOOD_ORIGIN, own):
        assert_error_body(flush("{}", {"Origin": origin, "Content-Type": "text/plain"}), 415, code="unsupported_media_type")
        assert_error_body(flush(None, {"Origin": origin}), 415, code="unsupported_media_type")
    assert_error_body(flush("{}", {"Content-Type": "text/plain"}), 415, code="unsupported_media_type")
    assert_error_body(flush('{"all": true}', {"Content-Type": "application/json"}), 400, param="all", code="unknown_parameter")
    # none of those flushed: the first flush that is let through frees the pages
    done = flush(None, {}).json()  # curl -X POST, the SDKs: no Origin, no body
    assert done["status"] == "ok" and done["freed_pages"] > 0, done
    fill_cache()
    done = flush("{}", {"Origin": GOOD_ORIGIN, "Content-Type": "application/json"}).json()
    assert done["freed_pages"] > 0, done
    fill_cache()
    done = flush("{}", {"Origin": own, "Content-Type": "application/json"}).json()
    assert done["freed_pages"] > 0, done
    assert_clean(server)


def test_long_tokenize_does_not_stall_streams(server: ServerProcess, client: httpx.Client, tiny_chat_model: str) -> None:
    from minisgl.utils.hf import load_tokenizer

    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "seven", "quick", "brown", "fox", "jumps"]
    text = " ".join(rng.choice(words) for _ in range(350_000))  # about 2 MB, 350,000 tokens: seconds to encode
    arrivals: List[float] = []
    started, stop = threading.Event(), threading.Event()
    prompt = "Tell me a long story."

    def stream() -> None:
        """Streams back to back until told to stop: one token series that outlasts /tokenize
        however slow the machine (the gap across two streams is one prefill, counted too)."""
        body = {"prompt": prompt, "max_tokens": SEQ_LEN - 16, "ignore_eos": True, "stream": True, "temperature": 0}
        with httpx.Client(base_url=server.base_url, timeout=120) as c:
            while not stop.is_set():
                with c.stream("POST", "/v1/completions", json=body) as resp:
                    for line in resp.iter_lines():
                        if line.startswith("data: {"):
                            arrivals.append(time.monotonic())
                            if len(arrivals) >= 10:
                                started.set()
                        if stop.is_set():
                            break  # closing the stream aborts the request
        started.set()

    thread = threading.Thread(target=stream)
    thread.start()
    try:
        assert started.wait(120)
        t0 = time.monotonic()
        resp = client.post("/tokenize", json={"prompt": text, "add_special_tokens": False})
        t1 = time.monotonic()
        deadline = t1 + 120  # until a token after the call's end: the series then covers all of it
        while thread.is_alive() and arrivals[-1] <= t1 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        stop.set()
        thread.join(120)
    assert resp.status_code == 200, resp.text[:500]
    assert resp.json()["tokens"] == load_tokenizer(tiny_chat_model)(text, add_special_tokens=False).input_ids
    assert arrivals and arrivals[-1] > t1, "no token after /tokenize returned: the stream cannot show the overlap"
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    during = [b - a for a, b in zip(arrivals, arrivals[1:]) if b > t0 and a < t1]
    # Encoded on the streaming loop, the stream would stop for (nearly) the whole call; a bound
    # relative to the call's own length holds on a loaded machine, where every gap stretches.
    bound = 0.5 * (t1 - t0)
    seen = (
        f"largest gap during /tokenize {max(during):.3f} s, bound {bound:.3f} s, median {statistics.median(gaps):.4f} s, {len(gaps)} gaps"
    )
    assert max(during) < bound, seen
    assert_clean(server)


@pytest.mark.parametrize("parser", sorted(PARSERS))
def test_model_output_nested_past_the_recursion_limit_is_content(parser: str) -> None:
    """A model can write JSON nested deeper than Python's recursion limit inside a call: the
    parser keeps it as content (a 500 otherwise, in the route that parses the finished output)."""
    deep = "[" * 5000 + "]" * 5000
    text = {
        "hermes": f'<tool_call>{{"name": "f", "arguments": {deep}}}</tool_call>',
        "llama3_json": f'{{"name": "f", "parameters": {deep}}}',
        "mistral": f'[TOOL_CALLS][{{"name": "f", "arguments": {deep}}}]',
        "harmony": f"<|channel|>commentary to=functions.f <|constrain|>json<|message|>{deep}<|call|>",
    }[parser]
    content, calls = PARSERS[parser]().parse(text)
    assert calls == [] and content == (deep if parser == "harmony" else text)  # harmony's markers are never content


def test_a_responses_function_call_nested_too_deep_names_its_item() -> None:
    from minisgl.server.responses_protocol import ResponsesRequest

    deep = "[" * 100_000 + "]" * 100_000
    body = ResponsesRequest.model_validate(
        {"input": [{"role": "user", "content": "hi"}, {"type": "function_call", "call_id": "c1", "name": "f", "arguments": deep}]}
    )
    with pytest.raises(InvalidRequest) as err:
        body.to_chat_request()
    assert err.value.status == 400 and err.value.param == "input[1].arguments"
    assert f"limit of {MAX_JSON_DEPTH}" in err.value.message
