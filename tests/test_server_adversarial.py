"""Nothing a client sends can stop or stall the server.

One real `python -m minisgl` process tree (the tiny chat model of test_server.py, float32, an API
key, at most 4 running and 4 queued requests) takes, from a hostile client: bodies that are too
deep, too big, not JSON, not declared JSON; numbers beyond int64 or infinite; lone surrogates;
parameters at the very edge of their ranges, mixed in one batch; client-side chat templates; huge
prompts; more requests than it admits; and property-based fuzzing of every request schema. After
each, the invariant: no 5xx, an OpenAI error body naming the field, the keep-alive connection
still usable, the server healthy, and no request, stream or KV page left behind.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

import httpx
import pytest
from server_helpers import REPO, ServerProcess, assert_error_body, free_port

API_KEY = "adversary-key"
MAX_SEQ_LEN = 512
VOCAB = 49152
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MSGS = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tiny_chat_model: str, tmp_path_factory: pytest.TempPathFactory):  # noqa: F811
    srv = ServerProcess(
        tiny_chat_model,
        "--dtype", "float32", "--max-seq-len", str(MAX_SEQ_LEN), "--num-pages", "4096",
        "--max-running-requests", "4", "--max-queued-requests", "4", "--max-prompt-bytes", "4000000",
        log_path=tmp_path_factory.mktemp("adversarial") / "server.log",
        api_key=API_KEY,
    )  # fmt: skip
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


@pytest.fixture()
def client(server: ServerProcess):
    """One keep-alive connection for a whole test (at most one connection in the pool)."""
    with httpx.Client(
        base_url=server.base_url,
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=60,
        limits=httpx.Limits(max_connections=1, max_keepalive_connections=1),
    ) as c:
        yield c


def _local_port(resp: httpx.Response) -> Any:
    return resp.extensions["network_stream"].get_extra_info("client_addr")


def post_raw(client: httpx.Client, path: str, body: bytes | str, content_type: str | None = "application/json") -> httpx.Response:
    headers = {} if content_type is None else {"Content-Type": content_type}
    return client.post(path, content=body, headers=headers)


def post(client: httpx.Client, path: str, body: Any) -> httpx.Response:
    return post_raw(client, path, json.dumps(body))


def expect_error(resp: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> Dict[str, Any]:
    assert resp.status_code == status, (resp.status_code, resp.text[:500])
    assert resp.headers.get("connection", "").lower() != "close", "an error must not close the keep-alive connection"
    return assert_error_body(resp, status, param, code)


def assert_clean(server: ServerProcess) -> None:
    """Healthy, nothing running, queued, registered or holding KV pages."""
    assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200
    m = server.wait_idle()
    assert m["minisgl_kv_pages_free"] == m["minisgl_kv_pages_total"], m
    assert m["minisgl_http_requests_in_flight"] == 0


# ---------------------------------------------------------------------------------------------


def test_bodies_that_used_to_be_500s_are_400s(server: ServerProcess, client: httpx.Client) -> None:
    first = client.get("/v1/models")
    port = _local_port(first)
    deep = "[" * 10_000 + "]" * 10_000
    expect_error(post_raw(client, CHAT, '{"messages": ' + deep + "}"), 400, code="invalid_json")
    expect_error(post_raw(client, CHAT, '{"messages": [{"role": "user", "content": ' + "[" * 40 + "]" * 40 + "}]}"), 400)
    # lone surrogates in content, prompt and stop
    expect_error(
        post_raw(client, CHAT, '{"messages": [{"role": "user", "content": "a\\ud800b"}]}'), 400, param="messages", code="invalid_unicode"
    )
    expect_error(post_raw(client, COMPLETIONS, '{"prompt": "\\udfff", "max_tokens": 2}'), 400, param="prompt")
    expect_error(post_raw(client, COMPLETIONS, '{"prompt": "hi", "stop": ["\\ud800"], "max_tokens": 2}'), 400, param="stop")
    # integers beyond 64 bits anywhere
    big = 2**64
    for field, value in (("max_tokens", big), ("top_k", big), ("seed", big), ("stop_token_ids", [big]), ("seed", -(2**63) - 1)):
        expect_error(post(client, COMPLETIONS, {"prompt": "hi", field: value}), 400, param=field)
    expect_error(post(client, COMPLETIONS, {"prompt": [1, big]}), 400, param="prompt")
    expect_error(post(client, COMPLETIONS, {"prompt": "hi", "seed": big, "n": 2}), 400, param="seed")
    expect_error(post(client, "/generate", {"input_ids": [[1, 2], [big]]}), 400, param="input_ids")
    expect_error(post(client, "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": big}}), 400, param="sampling_params")
    # infinities and NaN (Python's json writes and reads them; so do some clients)
    for literal in ("Infinity", "-Infinity", "NaN", "1e309"):
        expect_error(
            post_raw(client, CHAT, '{"messages": [{"role": "user", "content": "hi"}], "temperature": ' + literal + "}"),
            400,
            param="temperature",
        )
    # top_k beyond the vocabulary: this request killed the scheduler once sampled with another
    expect_error(post(client, COMPLETIONS, {"prompt": "Hello", "max_tokens": 2, "top_k": 2147483648, "temperature": 1}), 400, param="top_k")
    # strict JSON types, as OpenAI
    expect_error(post(client, CHAT, {"messages": MSGS, "temperature": "0.5"}), 400, param="temperature")
    expect_error(post(client, CHAT, {"messages": MSGS, "max_tokens": True}), 400, param="max_tokens")
    expect_error(post(client, CHAT, {"messages": MSGS, "max_tokens": 5.0}), 400, param="max_tokens")
    expect_error(post(client, CHAT, {"messages": MSGS, "stream": 1}), 400, param="stream")
    # unknown and unimplemented fields are refused, never silently ignored
    err = expect_error(post(client, CHAT, {"messages": MSGS, "frobnicate": 1}), 400, param="frobnicate", code="unknown_parameter")
    assert "frobnicate" in err["message"]
    functions = [{"name": "f", "parameters": {"type": "object"}}]  # the deprecated form of tools
    expect_error(post(client, CHAT, {"messages": MSGS, "functions": functions}), 400, param="functions", code="unsupported_parameter")
    expect_error(post(client, CHAT, {"messages": MSGS, "response_format": {"type": "xml"}}), 400, param="response_format")
    expect_error(post(client, CHAT, {"messages": MSGS, "response_format": {"type": "json_schema"}}), 400, param="response_format")
    expect_error(post(client, CHAT, {"messages": MSGS, "logit_bias": {str(VOCAB): -100}}), 400, param="logit_bias")
    expect_error(post(client, CHAT, {"messages": MSGS, "logit_bias": {"five": -100}}), 400, param="logit_bias")
    expect_error(post(client, CHAT, {"messages": MSGS, "logit_bias": {"5": -101}}), 400, param="logit_bias")
    expect_error(post(client, CHAT, {"messages": MSGS, "max_tokens": 3, "min_tokens": 4}), 400, param="min_tokens")
    expect_error(post(client, "/generate", {"text": "hi", "sampling_params": {"frobnicate": "a+"}}), 400, param="sampling_params")
    expect_error(
        post(client, "/generate", {"text": "hi", "sampling_params": {"regex": "a+", "ebnf": 'root ::= "a"'}}), 400, param="sampling_params"
    )
    # neutral values of unimplemented fields mean nothing and are accepted
    ok = post(client, CHAT, {"messages": MSGS, "max_tokens": 2, "tools": None, "logit_bias": {}, "parallel_tool_calls": False})
    assert ok.status_code == 200, ok.text
    # caps, the same on /v1 and /generate
    expect_error(post(client, CHAT, {"messages": MSGS, "stop": ["s"] * 17}), 400, param="stop")
    expect_error(post(client, CHAT, {"messages": MSGS, "stop": "x" * 2000}), 400, param="stop")
    expect_error(post(client, "/generate", {"text": "hi", "sampling_params": {"stop": ["s"] * 200_000}}), 400, param="sampling_params")
    expect_error(post(client, "/generate", {"text": ["hi"] * 300}), 400)
    expect_error(post(client, COMPLETIONS, {"prompt": ["hi"] * 300}), 400, param="n")
    expect_error(post(client, CHAT, {"messages": MSGS, "n": 65}), 400, param="n")
    expect_error(post(client, COMPLETIONS, {"prompt": "hi", "logprobs": 21}), 400, param="logprobs")
    expect_error(post(client, "/generate", {"text": "hi", "return_logprob": True, "top_logprobs_num": 21}), 400, param="top_logprobs_num")
    expect_error(post(client, CHAT, {"messages": MSGS, "max_tokens": MAX_SEQ_LEN}), 400, param="max_tokens", code="context_length_exceeded")
    expect_error(post(client, CHAT, {"messages": MSGS, "max_completion_tokens": 10**6}), 400, param="max_completion_tokens")
    expect_error(
        post(client, "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 10**6}}), 400, param="sampling_params.max_new_tokens"
    )
    # client-side chat templates are never rendered
    hostile = "{% for a in range(100000) %}{% for b in range(100000) %}x{% endfor %}{% endfor %}"
    expect_error(
        post(client, CHAT, {"messages": MSGS, "chat_template_kwargs": {"chat_template": hostile}}), 400, param="chat_template_kwargs"
    )
    expect_error(post(client, CHAT, {"messages": MSGS, "chat_template_kwargs": {"x": {"nested": 1}}}), 400, param="chat_template_kwargs")
    # the whole barrage went over one keep-alive connection
    last = client.get("/v1/models")
    assert last.status_code == 200 and _local_port(last) == port
    assert_clean(server)


def test_cross_site_and_auth(server: ServerProcess, client: httpx.Client) -> None:
    body = json.dumps({"messages": MSGS, "max_tokens": 2})
    # a web page can send text/plain (or form) bodies without a preflight: refused
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
        expect_error(post_raw(client, CHAT, body, content_type), 415, code="unsupported_media_type")
    assert post_raw(client, CHAT, body, "application/json; charset=utf-8").status_code == 200
    # every route but /health and /metrics needs the key
    url = server.base_url
    for method, path in (("GET", "/server_info"), ("POST", "/flush_cache"), ("GET", "/v1/models"), ("POST", CHAT), ("POST", "/generate")):
        expect_error(httpx.request(method, url + path, timeout=10), 401, code="invalid_api_key")
        expect_error(httpx.request(method, url + path, headers={"Authorization": "Bearer " + API_KEY[:-1] + "X"}, timeout=10), 401)
    assert httpx.get(url + "/health", timeout=10).status_code == 200
    assert httpx.get(url + "/metrics", timeout=10).status_code == 200
    assert "model_path" in client.get("/server_info").json()
    assert_clean(server)


def test_flush_cache_says_when_it_did_nothing(server: ServerProcess, client: httpx.Client) -> None:
    server.wait_idle()
    assert client.post("/flush_cache").json()["status"] == "ok"

    async def main() -> List[int]:
        async with httpx.AsyncClient(base_url=server.base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as ac:
            long = asyncio.ensure_future(ac.post(COMPLETIONS, json={"prompt": "go", "max_tokens": 300, "ignore_eos": True}))
            statuses = []
            for _ in range(100):  # flush while the long request runs: refused with 409
                await asyncio.sleep(0.05)
                statuses.append((await ac.post("/flush_cache")).status_code)
                if 409 in statuses or long.done():
                    break
            statuses.append((await long).status_code)
            return statuses

    statuses = asyncio.run(main())
    assert 409 in statuses and statuses[-1] == 200, statuses
    assert_clean(server)


def test_extreme_parameters_share_a_batch(server: ServerProcess) -> None:
    """The regression of the scheduler kill: sampled and greedy requests with parameters at the
    edges of their ranges (and beyond, refused with 400), all at once so they share batches."""
    edge: List[Dict[str, Any]] = [
        {"top_k": VOCAB, "temperature": 1.0},
        {"top_k": VOCAB, "temperature": 0},
        {"top_k": 1, "temperature": 2.0},
        {"temperature": 100.0, "top_p": 1e-9},
        {"temperature": 1.0, "min_p": 1.0},
        {"temperature": 0.7, "repetition_penalty": 10.0, "presence_penalty": -2.0, "frequency_penalty": 2.0},
        {"temperature": 1.0, "seed": 2**63 - 1, "n": 2},
        {"temperature": 1.0, "seed": -(2**63)},
        {"temperature": 1.0, "stop_token_ids": [0, VOCAB - 1]},
        {"temperature": 1e-30},
    ]
    beyond: List[Dict[str, Any]] = [
        {"top_k": VOCAB + 1, "temperature": 1.0},
        {"top_k": 2147483648, "temperature": 0},
        {"temperature": 100.5},
        {"stop_token_ids": [VOCAB]},
        {"repetition_penalty": 0},
    ]

    async def wave(group: List[Dict[str, Any]]) -> List[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as ac:
            reqs = [ac.post(COMPLETIONS, json={"prompt": "Hello there", "max_tokens": 8, **p}) for p in group]
            return list(await asyncio.gather(*reqs))

    # waves of 4 (the server runs 4 at once), each with every out-of-range request alongside
    for start in range(0, len(edge), 4):
        group = edge[start : start + 4]
        responses = asyncio.run(wave(group + beyond))
        for params, resp in zip(group, responses):
            assert resp.status_code == 200, (params, resp.text)
            choices = resp.json()["choices"]
            assert len(choices) == params.get("n", 1) and all(c["finish_reason"] in ("stop", "length") for c in choices)
        for params, resp in zip(beyond, responses[len(group) :]):
            expect_error(resp, 400, param=next(iter(params)))
    assert_clean(server)


def test_huge_prompt_and_hostile_template_do_not_stall_others(server: ServerProcess) -> None:
    huge = json.dumps({"prompt": "lorem ipsum " * 1_250_000, "max_tokens": 4})  # 15 MB
    hostile = {
        "messages": MSGS,
        "chat_template_kwargs": {"chat_template": "{% for a in range(10**9) %}{{ a }}{% endfor %}"},
    }

    async def main() -> tuple[float, List[int]]:
        async with httpx.AsyncClient(base_url=server.base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as ac:
            bad = [
                asyncio.ensure_future(ac.post(COMPLETIONS, content=huge, headers={"Content-Type": "application/json"})),
                asyncio.ensure_future(ac.post(CHAT, json=hostile)),
            ]
            await asyncio.sleep(0.05)
            t0 = time.perf_counter()
            short = await ac.post(CHAT, json={"messages": MSGS, "max_tokens": 4, "temperature": 0})
            elapsed = time.perf_counter() - t0
            assert short.status_code == 200, short.text
            return elapsed, [(await b).status_code for b in bad]

    elapsed, statuses = asyncio.run(main())
    # A generous bound, not a timing: stalled behind the template's 10**9 iterations, the short
    # request would wait for hours; on a slow, busy machine it still answers in seconds.
    assert elapsed < 60, f"a short request took {elapsed:.2f} s next to a 15 MB prompt and a hostile template"
    assert statuses == [400, 400]
    assert_clean(server)


def test_large_prompt_is_encoded_off_the_streaming_loop(server: ServerProcess) -> None:
    """A 3 MB prompt (within this server's --max-prompt-bytes) takes the tokenizer a second or
    more; it is encoded in the pool, so a running stream keeps its pace meanwhile."""
    big = {"prompt": "word " * 600_000, "max_tokens": 4}

    async def main() -> tuple[float, httpx.Response, int]:
        async with httpx.AsyncClient(base_url=server.base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as ac:
            body = {"prompt": "Count:", "max_tokens": 450, "ignore_eos": True, "temperature": 0, "stream": True}
            async with ac.stream("POST", COMPLETIONS, json=body) as stream:
                lines = stream.aiter_lines()
                while not (await lines.__anext__()).startswith("data: "):
                    pass
                sent = time.perf_counter()
                pending = asyncio.ensure_future(ac.post(COMPLETIONS, json=big))
                last, gap, during, answered = sent, 0.0, 0, 0.0
                async for line in lines:
                    if not line.startswith("data: "):
                        continue
                    now = time.perf_counter()
                    if not pending.done():
                        gap, during = max(gap, now - last), during + 1
                    elif not answered:
                        answered = now
                    last = now
                resp = await pending
                return gap, resp, during, (answered or time.perf_counter()) - sent

    gap, resp, during, took = asyncio.run(main())
    expect_error(resp, 400, param="prompt", code="context_length_exceeded")  # encoded: 600k tokens
    assert during > 10, "the big prompt was not being encoded while the stream ran"
    # Encoded on the loop, the stream would stop for the whole encode; the bound is relative to
    # the big request's own time, so a loaded machine (every gap longer) does not fail it.
    assert gap < 0.5 * took, f"a stream stalled {gap:.2f} s while another request's prompt was encoded ({took:.2f} s)"
    assert_clean(server)


def test_queue_full_is_503_and_the_queued_requests_finish(server: ServerProcess) -> None:
    # 4 running + 4 queued are admitted; the rest are told to come back later
    body = {"prompt": "Once upon a time", "max_tokens": 240, "ignore_eos": True, "temperature": 0}

    async def main() -> List[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=300) as ac:
            return list(await asyncio.gather(*[ac.post(COMPLETIONS, json=body) for _ in range(14)]))

    responses = asyncio.run(main())
    ok = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code == 503]
    assert len(ok) + len(refused) == len(responses), [r.status_code for r in responses]
    assert 4 <= len(ok) <= 8 and refused, [r.status_code for r in responses]
    for r in refused:
        expect_error(r, 503, code="server_overloaded")
        assert int(r.headers["retry-after"]) >= 1
    texts = {r.json()["choices"][0]["text"] for r in ok}
    assert len(texts) == 1 and all(r.json()["usage"]["completion_tokens"] == 240 for r in ok)
    assert_clean(server)


def test_fuzzed_request_bodies_never_5xx(server: ServerProcess) -> None:
    """Property-based fuzzing of the three generation schemas with hostile values."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    hostile_scalars = st.one_of(
        st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70), st.sampled_from([0, 1, -1, 2**63, VOCAB]),
        st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20), st.sampled_from(["\ud800", "", "0.5", "none"]),
    )  # fmt: skip
    values = st.recursive(
        hostile_scalars, lambda c: st.one_of(st.lists(c, max_size=4), st.dictionaries(st.text(max_size=8), c, max_size=3)), max_leaves=8
    )
    common = ["temperature", "top_p", "top_k", "min_p", "max_tokens", "stop", "stop_token_ids", "seed", "n", "presence_penalty",
              "frequency_penalty", "repetition_penalty", "ignore_eos", "skip_special_tokens", "stream", "stream_options", "user",
              "logprobs", "tools", "response_format", "logit_bias", "unknown_field"]  # fmt: skip
    chat_fields = common + ["messages", "max_completion_tokens", "top_logprobs", "chat_template_kwargs"]
    completion_fields = common + ["prompt", "echo", "best_of", "suffix"]
    small_tokens = st.integers(min_value=1, max_value=6)
    messages = st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "system", "assistant", "bot"]), "content": st.one_of(st.text(max_size=30), values)}
        ),
        max_size=3,
    )

    def bodies(fields: List[str], base: Dict[str, Any]) -> Any:
        return st.fixed_dictionaries(
            {k: v for k, v in base.items()},
            optional={f: (small_tokens if f in ("max_tokens", "max_completion_tokens") else values) for f in fields if f not in base},
        )

    chat = bodies(chat_fields, {"messages": st.one_of(messages, values), "max_tokens": small_tokens})
    completion = bodies(
        completion_fields,
        {"prompt": st.one_of(st.text(max_size=30), st.lists(st.integers(-5, VOCAB + 5), max_size=5), values), "max_tokens": small_tokens},
    )
    generate = st.fixed_dictionaries(
        {"text": st.one_of(st.text(max_size=30), values)},
        optional={"sampling_params": st.one_of(values, st.fixed_dictionaries({"max_new_tokens": small_tokens}, optional={f: values for f in ["temperature", "top_k", "stop", "seed", "n"]})),
                  "stream": values, "return_logprob": values, "top_logprobs_num": values, "input_ids": values},
    )  # fmt: skip
    requests = st.one_of(
        st.tuples(st.just(CHAT), chat), st.tuples(st.just(COMPLETIONS), completion), st.tuples(st.just("/generate"), generate)
    )
    deadline = time.monotonic() + 45.0
    seen = {"2xx": 0, "4xx": 0}
    with httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as c:

        @settings(max_examples=400, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck), database=None)
        @given(requests)
        def check(req: Any) -> None:
            if time.monotonic() > deadline:
                return
            path, body = req
            resp = post_raw(c, path, json.dumps(body, allow_nan=True))
            assert resp.status_code < 500, (path, body, resp.status_code, resp.text[:300])
            seen["2xx" if resp.status_code < 300 else "4xx"] += 1
            if resp.status_code >= 400:
                expect_error(resp, resp.status_code)

        check()
    assert seen["2xx"] > 0 and seen["4xx"] > 0, seen
    assert_clean(server)


def test_port_in_use_fails_fast_with_status_2(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        t0 = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-m", "minisgl", "--model", "/nonexistent/model", "--port", str(port)],
            cwd=REPO, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "cannot listen" in proc.stderr + proc.stdout
    assert time.monotonic() - t0 < 30
    assert free_port() > 0


def test_a_taken_port_exits_2_before_the_model_loads(tiny_chat_model: str) -> None:  # noqa: F811
    """A port taken by another program: the server says so and exits with status 2 ("choose another
    --port") before it loads the model; the test harness (ServerProcess) restarts on a new port
    when it sees exactly this."""
    import subprocess
    import sys

    with socket.socket() as thief:
        thief.bind(("127.0.0.1", 0))
        thief.listen(1)
        taken = thief.getsockname()[1]
        cmd = [sys.executable, "-m", "minisgl", "--model", tiny_chat_model, "--port", str(taken), "--dtype", "float32"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-3000:]
    log = done.stdout + done.stderr
    assert "choose another --port" in log and str(taken) in log, log[-3000:]
    assert "Traceback" not in log and "loading" not in log.lower(), log[-3000:]
