"""Server building blocks without a server: messages, detokenization, stop strings, request
models, CLI arguments, and the scheduler loop's handling of bad requests."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from typing import Any, Dict, List

import pytest
import zmq
from server_helpers import canned_app, sse_data

from minisgl.message import (
    AbortMsg,
    AbortReq,
    ErrorMsg,
    ExitMsg,
    FlushCacheDone,
    FlushCacheMsg,
    ReplyBatchMsg,
    ReplyMsg,
    SchedulerStats,
    TokenBatchMsg,
    TokenizeMsg,
    TokenOutput,
    UserMsg,
    decode_msg,
    encode_msg,
)
from minisgl.sampling_params import SamplingParams
from minisgl.tokenizer import IncrementalDetokenizer, StopMatcher

MULTILINGUAL = [
    "你好，世界！今天天气很好。",
    "Emoji: 😀👍🏽👨‍👩‍👧‍👦🇫🇷 done",
    "naïve café — Ünïcödé ß ø",
    "こんにちは、元気ですか？ 안녕하세요",
    "mixed 中文 and English 🎉 together",
]


@pytest.fixture(scope="module")
def tokenizer(embedded_model_dir: str) -> Any:
    from minisgl.utils.hf import load_tokenizer

    return load_tokenizer(embedded_model_dir)


def test_messages_round_trip() -> None:
    msgs = [
        TokenizeMsg(
            1, text="你好", sampling=SamplingParams(temperature=0.5, max_tokens=None, seed=-(2**63), stop=["\n"]), want_logprobs=True
        ),
        TokenizeMsg(2, messages=[{"role": "user", "content": "hi"}], chat_template_kwargs={"x": 1}),
        TokenizeMsg(3, input_ids=[1, 2, 3]),
        AbortReq(4),
        UserMsg(5, [1, 2], SamplingParams(top_k=3, stop_token_ids=[7, 8]), True),
        AbortMsg(6),
        FlushCacheMsg(3),
        FlushCacheDone(3, False, 0),
        ExitMsg(),
        TokenBatchMsg([TokenOutput(7, 11, True, "stop", -0.25, [[11, -0.25], [12, -2.0]], 3, 1), TokenOutput(8, None, True, "abort")]),
        SchedulerStats(
            1, 2, 100, 90, 5, 10, 4, 7, retractions=2, new_token_ratio=0.3, num_active=3, aborted_requests=1, gen_throughput=12.5
        ),
        ErrorMsg(9, "bad", 400, "temperature", "invalid_value"),
        ReplyBatchMsg([ReplyMsg(10, "😀", 1, True, "stop", 3, 4, 0, [["a", -0.1, [["a", -0.1]], 5]], "\n", [5])]),
    ]
    for msg in msgs:
        assert decode_msg(encode_msg(msg)) == msg
    assert isinstance(decode_msg(encode_msg(msgs[0])).sampling, SamplingParams)
    stats = decode_msg(encode_msg(msgs[10]))
    assert (stats.kv_usage, stats.cache_hit_rate) == pytest.approx((0.1, 0.4))


def test_scheduler_outputs_cross_as_themselves() -> None:
    """What `Scheduler.step()` and `.stats()` return is what the tokenizer worker receives: the
    records are the messages (tuples arrive as lists), and a batch of outputs is one message."""
    from minisgl.scheduler import SchedulerStats as SchedStats
    from minisgl.scheduler import TokenOutput as SchedOutput

    assert (SchedOutput, SchedStats) == (TokenOutput, SchedulerStats)
    out = TokenOutput(1, 5, logprob=-0.5, top_logprobs=[(5, -0.5), (6, -1.0)], prompt_logprobs=[[3, -1.5, [(3, -1.5)]]])
    back = decode_msg(encode_msg(TokenBatchMsg([out, out]))).outputs
    assert len(back) == 2 and isinstance(back[0], TokenOutput)
    assert back[0].top_logprobs == [[5, -0.5], [6, -1.0]] and back[0].prompt_logprobs == [[3, -1.5, [[3, -1.5]]]]


def test_unknown_messages_are_refused() -> None:
    import msgpack

    with pytest.raises(TypeError):
        encode_msg(object())
    with pytest.raises(ValueError, match="unknown message type"):
        decode_msg(msgpack.packb({"__m": "Nope", "f": []}))


@pytest.mark.parametrize("text", MULTILINGUAL)
def test_incremental_detokenization_is_utf8_safe(tokenizer: Any, text: str) -> None:
    ids = tokenizer(text).input_ids
    assert len(ids) > 3
    # one token at a time
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.add([t]) for t in ids] + [detok.flush()]
    assert all("\ufffd" not in d for d in deltas), deltas
    assert "".join(deltas) == tokenizer.decode(ids) == text
    # random chunk sizes
    rng = random.Random(0)
    for _ in range(5):
        detok = IncrementalDetokenizer(tokenizer)
        out, i = [], 0
        while i < len(ids):
            k = rng.randint(1, 3)
            out.append(detok.add(ids[i : i + k]))
            i += k
        out.append(detok.flush())
        assert "".join(out) == text and all("\ufffd" not in d for d in out)


def test_detokenizer_special_tokens_and_truncated_characters(tokenizer: Any) -> None:
    ids = tokenizer("Hi").input_ids + [tokenizer.eos_token_id] + tokenizer(" there").input_ids
    detok = IncrementalDetokenizer(tokenizer)
    text = "".join(detok.add([t]) for t in ids) + detok.flush()
    assert text == tokenizer.decode(ids, skip_special_tokens=True) == "Hi there"
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    assert "".join(detok.add([t]) for t in ids) + detok.flush() == tokenizer.decode(ids)
    # a character cut off by the end of the generation is flushed as decoded (with U+FFFD)
    emoji_ids = tokenizer("😀").input_ids
    assert len(emoji_ids) > 1
    detok = IncrementalDetokenizer(tokenizer)
    held = [detok.add([t]) for t in emoji_ids[:-1]]
    assert held == [""] * len(held)
    assert detok.flush() == tokenizer.decode(emoji_ids[:-1])


def _run_stops(stops: List[str], deltas: List[str]) -> tuple[List[str], str | None]:
    m = StopMatcher(stops)
    out = []
    for i, d in enumerate(deltas):
        text, matched = m.feed(d, final=i == len(deltas) - 1)
        out.append(text)
        if matched is not None:
            return out, matched
    return out, None


def test_stop_strings() -> None:
    # a stop string split over deltas: nothing of it is ever released
    out, matched = _run_stops(["STOP"], ["Hello S", "TO", "P and more"])
    assert "".join(out) == "Hello " and matched == "STOP"
    assert out == ["Hello ", "", ""]
    # a held partial match is released once it cannot complete
    out, matched = _run_stops(["STOP"], ["Hello ST", "ILL going", "!"])
    assert out == ["Hello ", "STILL going", "!"] and matched is None
    # the earliest match wins among several stop strings
    out, matched = _run_stops(["world", "lo"], ["Hello world"])
    assert "".join(out) == "Hel" and matched == "lo"
    # at the end everything left is released
    out, matched = _run_stops(["STOP"], ["abc ST"])
    assert out == ["abc ST"] and matched is None
    # no stops: text passes through
    assert _run_stops([], ["a", "b"]) == (["a", "b"], None)


def test_request_models() -> None:
    from pydantic import ValidationError

    from minisgl.sampling_params import SamplingParams
    from minisgl.server.protocol import ChatCompletionRequest, CompletionRequest

    req = ChatCompletionRequest.model_validate(
        {
            "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
            "seed": 5,
            "n": 2,
            "top_k": 0,
        }
    )
    assert req.messages[0].to_template() == {"role": "user", "content": "ab"}
    params = req.sampling_params(None, None)
    s0, s1 = params.for_choice(0), params.for_choice(1)
    assert (s0.seed, s1.seed) == (5, 6) and s0.top_k == -1 and s0.temperature == 1.0 and s0.max_tokens is None
    # the seed of choice i wraps within int64
    assert SamplingParams(seed=2**63 - 1).for_choice(1).seed == -(2**63)
    assert CompletionRequest.model_validate({"prompt": [[1, 2], [3]]}).prompts() == [[1, 2], [3]]
    assert CompletionRequest.model_validate({"prompt": [1, 2]}).prompts() == [[1, 2]]
    for bad in ({"messages": []}, {"messages": [{"role": "user", "content": "x"}], "top_p": 0}, {"messages": "x"}):
        with pytest.raises(ValidationError):
            ChatCompletionRequest.model_validate(bad)
    s0.validate(vocab_size=100, max_seq_len=64)


def test_cli_arguments(tiny_chat_model: str) -> None:
    import torch

    from minisgl.server.args import parse_args

    args = parse_args([])
    assert (args.host, args.port, args.model, args.tp, args.engine["cache_type"]) == ("127.0.0.1", 1919, None, 1, "radix")
    assert args.model_name == "SmolLM2-135M-Instruct"
    args = parse_args(
        ["--model", tiny_chat_model, "--dtype", "float32", "--cache", "naive", "--max-prefill-length", "128",
         "--num-pages", "64", "--max-seq-len", "100", "--page-size", "4", "--max-running-requests", "3", "--memory-ratio", "0.5"]
    )  # fmt: skip
    args.model_path = tiny_chat_model
    cfg = args.scheduler_config()
    assert cfg.dtype == torch.float32 and cfg.cache_type == "naive" and cfg.max_extend_tokens == 128
    assert (cfg.num_page_override, cfg.max_seq_len_override, cfg.page_size, cfg.max_running_req) == (64, 100, 4, 3)
    assert cfg.memory_ratio == 0.5 and cfg.tp_info.size == 1
    for bad in (["--port", "x"], ["--memory-ratio", "2"], ["--page-size", "0"], ["--cache", "lru"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_scheduler_loop_answers_bad_requests(tiny_chat_model: str) -> None:
    """Bad requests get an ErrorMsg each; the loop keeps serving the good ones."""
    import torch

    from minisgl.distributed import DistributedInfo
    from minisgl.scheduler import Scheduler, SchedulerConfig
    from minisgl.scheduler.process import SchedulerLoop

    sched = Scheduler(
        SchedulerConfig(
            model_path=tiny_chat_model, tp_info=DistributedInfo(0, 1), dtype=torch.float32,
            max_seq_len_override=64, num_page_override=256, max_running_req=8,
        )
    )  # fmt: skip
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    a.bind("inproc://sched-test")
    b.connect("inproc://sched-test")
    try:
        loop = SchedulerLoop(sched, recv_sock=a, send_sock=b)
        good = SamplingParams(temperature=0.0, max_tokens=5)
        msgs = [
            UserMsg(1, [1, 2, 3], replace(good, temperature=-1.0)),
            UserMsg(2, [1, 2, 3], replace(good, top_k=10**12)),  # beyond the vocabulary
            UserMsg(3, [], good),
            UserMsg(4, [10**9], good),
            UserMsg(5, list(range(100)), good),  # longer than the context
            UserMsg(6, [1, 2, 3], replace(good, max_tokens=100), max_tokens_explicit=True),
            UserMsg(7, [1, 2, 3], good),
            UserMsg(7, [1, 2, 3], good),  # duplicate uid
            UserMsg(8, [4, 5, 6], replace(good, max_tokens=None)),  # None: up to the context
            UserMsg(9, [4, 5, 6], replace(good, max_tokens=50)),
            AbortMsg(9),
            AbortMsg(12345),  # unknown: ignored
        ]
        for msg in msgs:
            loop.handle(msg)
        while sched.has_work():
            loop.step()
        sched.check_invariants()
        received = []
        while a.poll(0):
            received.append(decode_msg(a.recv()))
        errors = {m.uid: m for m in received if isinstance(m, ErrorMsg)}
        assert sorted(errors) == [1, 2, 3, 4, 5, 6, 7]
        assert errors[1].param == "temperature" and errors[1].status == 400
        assert errors[2].param == "top_k" and errors[3].param == errors[4].param == "input_ids"
        assert errors[5].code == errors[6].code == "context_length_exceeded"
        assert errors[6].param == "max_tokens"
        assert "already in use" in errors[7].message
        tokens = [o for m in received if isinstance(m, TokenBatchMsg) for o in m.outputs]
        finals = {o.uid: o for o in tokens if o.finished}
        assert finals[7].finish_reason == "length" and sum(o.uid == 7 for o in tokens) == 5
        assert finals[8].finish_reason in ("length", "stop")
        assert sum(o.uid == 8 for o in tokens if o.token_id is not None) <= 64 - 3
        assert finals[9].finish_reason == "abort" and loop.aborted == 1
    finally:
        a.close(0)
        b.close(0)
        ctx.term()
        sched.shutdown()


def test_env_is_read_in_one_typed_place(monkeypatch: pytest.MonkeyPatch) -> None:
    from minisgl.utils.env import read_env

    monkeypatch.setenv("MINISGL_DISABLE_OVERLAP_SCHEDULING", "yes")
    monkeypatch.setenv("MINISGL_CACHE_DIR", "/tmp/x")
    monkeypatch.delenv("MINISGL_API_KEY", raising=False)
    env = read_env()
    assert env.disable_overlap_scheduling and str(env.cache_dir) == "/tmp/x" and env.api_key is None
    monkeypatch.setenv("MINISGL_DISABLE_OVERLAP_SCHEDULING", "maybe")
    with pytest.raises(ValueError, match="MINISGL_DISABLE_OVERLAP_SCHEDULING"):
        read_env()


def test_request_limits_and_sampling_bounds() -> None:
    from minisgl.sampling_params import InvalidRequest, check_context
    from minisgl.server.limits import MIN_PROMPT_BYTES, PROMPT_BYTES_PER_TOKEN, RequestLimits, check_json_tree

    limits = RequestLimits.for_server(1 << 20, None, {"max_seq_len": 8192, "vocab_size": 100})
    assert limits.max_prompt_bytes == PROMPT_BYTES_PER_TOKEN * 8192 and limits.vocab_size == 100
    assert RequestLimits.for_server(1 << 20, None, {"max_seq_len": 16}).max_prompt_bytes == MIN_PROMPT_BYTES
    with pytest.raises(InvalidRequest) as info:
        limits.check_prompt_text(limits.max_prompt_bytes + 1, "prompt")
    assert info.value.code == "context_length_exceeded"
    check_json_tree({"a": [[1]]}, max_depth=3)
    for bad in ({"a": [[[1]]]}, {"a": "\udc80"}, {"\ud800": 1}):
        with pytest.raises(InvalidRequest) as info:
            check_json_tree(bad, max_depth=3)
        assert info.value.param in ("a", "\ud800")
    # each field's bounds, named in the error
    cases = {
        "temperature": [float("inf"), float("nan"), -0.1, 100.5, "1", True],
        "top_k": [0, -2, 101, 2**63, 1.0, True],
        "top_p": [0.0, 1.5],
        "min_p": [-0.1, 1.1],
        "max_tokens": [0, 64, True, 2**64],
        "seed": [2**63, -(2**63) - 1, 1.5],
        "presence_penalty": [2.5],
        "repetition_penalty": [0.0, 11.0],
        "logprobs": [21, -1],
        "stop_token_ids": [[100], [-1], [1.0], list(range(300))],
        "ignore_eos": [1],
    }
    for name, values in cases.items():
        for value in values:
            with pytest.raises(InvalidRequest) as info:
                SamplingParams(**{"max_tokens": 8, name: value}).validate(vocab_size=100, max_seq_len=64)
            assert info.value.param == name, (name, value)
    SamplingParams(temperature=100.0, top_k=100, seed=-(2**63), stop_token_ids=[99], max_tokens=63).validate(100, 64)
    assert SamplingParams(temperature=1e-30).is_greedy
    assert check_context(10, None, 64, strict=True) == 54
    assert check_context(10, 1000, 64, strict=False) == 54
    for args in ((64, 1, 64, False), (10, 55, 64, True)):
        with pytest.raises(InvalidRequest) as info:
            check_context(args[0], args[1], args[2], strict=args[3])
        assert info.value.code == "context_length_exceeded"


class _FailingScheduler:
    """Stands in for a Scheduler whose every step fails."""

    def __init__(self) -> None:
        self.active: Dict[int, Any] = {7: object()}
        self.waiting: List[Any] = []
        self.compiling: Dict[int, Any] = {}  # requests whose grammar compiles
        self.max_seq_len = 64

    def step(self) -> Any:
        from minisgl.scheduler import StepFailed

        raise StepFailed([7], [], ValueError("boom"))

    def take_rejected(self) -> List[Any]:
        return []

    def load(self) -> Any:
        return len(self.active), len(self.waiting)

    def stats(self) -> Any:
        from minisgl.message import SchedulerStats

        return SchedulerStats(num_running=len(self.active), num_waiting=0, total_pages=8, free_pages=8, cached_pages=0,
                              prompt_tokens=0, cache_hit_tokens=0, generated_tokens=0)  # fmt: skip


class _Sock:
    def __init__(self) -> None:
        self.sent: List[bytes] = []

    def send(self, data: Any, copy: bool = True) -> None:
        self.sent.append(bytes(data))


def test_scheduler_loop_survives_failed_steps_until_they_repeat() -> None:
    from minisgl.message import SchedulerStats
    from minisgl.scheduler.process import MAX_CONSECUTIVE_FAILED_STEPS, SchedulerLoop

    sock = _Sock()
    loop = SchedulerLoop(_FailingScheduler(), recv_sock=None, send_sock=sock)  # type: ignore[arg-type]
    for _ in range(MAX_CONSECUTIVE_FAILED_STEPS - 1):
        loop.step()  # answered with a 500 for request 7, and the loop goes on
    sent = [decode_msg(d) for d in sock.sent]
    errors = [m for m in sent if isinstance(m, ErrorMsg)]  # (beside them: the stats of the changed load)
    assert all(isinstance(m, (ErrorMsg, SchedulerStats)) for m in sent)
    assert all(e.uid == 7 and e.status == 500 for e in errors)
    assert len(errors) == MAX_CONSECUTIVE_FAILED_STEPS - 1
    from minisgl.scheduler import StepFailed

    with pytest.raises(StepFailed):  # the engine looks broken: stop
        loop.step()


class _StubFrontend:
    failure: str | None = None
    draining = False
    stats = None
    num_in_flight = 0


def _app(**overrides: Any) -> Any:
    from fastapi.testclient import TestClient

    from minisgl.server.api_server import create_app
    from minisgl.server.args import parse_args
    from minisgl.server.metrics import ServerMetrics

    args = parse_args([f"--{k.replace('_', '-')}={v}" for k, v in overrides.items()])
    args.model_path = "/models/x"
    info = {"max_seq_len": 64, "vocab_size": 100, "max_running_req": 4}
    return TestClient(create_app(args, info, _StubFrontend(), ServerMetrics()))  # type: ignore[arg-type]


def test_health_head_version_and_cors() -> None:
    client = _app(api_key="k")
    assert client.head("/health").status_code == 200 and client.get("/version").json()["version"]
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"}
    assert "access-control-allow-origin" not in client.options("/v1/chat/completions", headers=preflight).headers
    client = _app(allowed_origins="https://app.example")
    resp = client.options("/v1/chat/completions", headers=preflight)
    assert resp.status_code == 200 and resp.headers["access-control-allow-origin"] == "https://app.example"
    resp = client.options("/v1/chat/completions", headers={**preflight, "Origin": "https://evil.example"})
    assert resp.headers.get("access-control-allow-origin") != "https://evil.example"
    from minisgl.server.args import parse_args

    for bad in ("ftp://x", ","):
        with pytest.raises(SystemExit):
            parse_args(["--allowed-origins", bad])


def test_tool_call_parsers_on_canned_outputs() -> None:
    from minisgl.server.tools import HermesParser, Llama3JsonParser, MistralParser, ToolStream, pick_parser

    hermes = HermesParser()
    text = 'Let me check.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>{"name": "time", "arguments": {}}</tool_call>'
    content, calls = hermes.parse(text)
    assert content == "Let me check." and [(c.name, c.arguments) for c in calls] == [("weather", {"city": "Paris"}), ("time", {})]
    assert hermes.parse("no calls here") == ("no calls here", [])
    assert hermes.parse("<tool_call>{broken</tool_call>")[1] == []  # malformed: stays content
    # an unterminated last block (EOS before </tool_call>) still parses
    assert hermes.parse('<tool_call>{"name": "f", "arguments": {"x": 1}}')[1][0].arguments == {"x": 1}
    llama = Llama3JsonParser()
    content, calls = llama.parse('<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}')
    assert content == "" and [c.name for c in calls] == ["f", "g"] and calls[0].arguments == {"a": 1}
    assert llama.parse("Hello {not json")[1] == []
    mistral = MistralParser()
    content, calls = mistral.parse('Sure [TOOL_CALLS][{"name": "f", "arguments": "{\\"q\\": 2}"}]')
    assert content == "Sure" and calls[0].arguments == {"q": 2}
    assert isinstance(pick_parser("auto", "{{ '[TOOL_CALLS]' }}"), MistralParser)
    assert isinstance(pick_parser("auto", "<|python_tag|> ipython"), Llama3JsonParser)
    assert isinstance(pick_parser("auto", None), HermesParser)
    with pytest.raises(ValueError):
        pick_parser("nope", None)
    # streaming: content flows, the call is held back and parsed at the end, split anywhere
    for step in (1, 3, 7):
        ts = ToolStream(hermes)
        sent = "".join(ts.feed(text[i : i + step]) for i in range(0, len(text), step))
        rest, calls = ts.finish()
        assert (sent + rest).strip() == "Let me check." and len(calls) == 2
    ts = ToolStream(hermes)
    assert "".join(ts.feed(c) for c in "plain <tool text") + ts.finish()[0] == "plain <tool text"
    # the required-call grammar wraps each call in the format's markers (tests/test_tools_round2.py drives it)
    from minisgl.server.tools import tool_turn_grammar

    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}}]
    spec = tool_turn_grammar(hermes, tools, ["f"], must_call=True, parallel=True, answer=None, after_tool_result=False)
    assert spec is not None and spec.kind == "tool_call" and '"begin": "<tool_call>\\n"' in spec.value


def test_reasoning_split_and_stream() -> None:
    from minisgl.server.reasoning import ReasoningStream, split_reasoning, wants_reasoning

    text = "<think>\nFirst, greet.\n</think>\n\nHello!"
    assert split_reasoning(text) == ("First, greet.", "Hello!")
    assert split_reasoning("Hello!") == (None, "Hello!")
    assert split_reasoning("<think>still going") == ("still going", "")
    assert split_reasoning("thought</think>answer") == ("thought", "answer")  # opened in the prompt
    for step in (1, 2, 4, 9):
        rs = ReasoningStream()
        parts = [rs.feed(text[i : i + step]) for i in range(0, len(text), step)] + [rs.finish()]
        assert "".join(p[0] for p in parts).strip() == "First, greet." and "".join(p[1] for p in parts) == "Hello!"
    assert wants_reasoning("auto", "{% if x %}<think>{% endif %}</think>") and not wants_reasoning("auto", "plain")
    assert not wants_reasoning("none", "</think>") and wants_reasoning("think", None)


def test_chat_route_returns_reasoning_and_tool_calls() -> None:
    text = '<think>Need the weather.</think>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    client, frontend = canned_app(text, "--reasoning-parser", "think")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    body = {"messages": [{"role": "user", "content": "weather?"}], "tools": tools, "max_tokens": 50}
    msg = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert msg["finish_reason"] == "tool_calls" and msg["message"]["reasoning_content"] == "Need the weather."
    call = msg["message"]["tool_calls"][0]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Oslo"}
    assert msg["message"]["content"] is None
    # the template ignores tools ({{ messages }} never mentions them): they went in as a system message
    assert frontend.sent[0].messages[0]["role"] == "system" and "get_weather" in frontend.sent[0].messages[0]["content"]
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as resp:
        chunks = sse_data(resp)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Need the weather."
    assert "".join(d.get("content") or "" for d in deltas).strip() == ""
    assert [tc["function"]["name"] for d in deltas for tc in d.get("tool_calls", [])] == ["get_weather"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    # without tools the same text is reasoning + content
    plain = client.post("/v1/chat/completions", json={"messages": body["messages"], "max_tokens": 50}).json()["choices"][0]
    assert plain["finish_reason"] == "stop" and plain["message"]["content"].startswith("<tool_call>")


def test_a_non_streaming_client_that_hangs_up_aborts_its_request() -> None:
    """The route's half of a non-streaming disconnect, without a clock: the hang-up arrives only
    after the request has produced output (delivered by the test), so the request is certainly
    still running when the server notices; every unfinished choice must be aborted."""
    import asyncio

    from minisgl.server.frontend import RequestStream
    from minisgl.server.routes.common import APIError, collect

    class Sent:
        metrics = None

        def __init__(self) -> None:
            self.msgs: List[Any] = []
            self.forgotten = 0

        def _send(self, msg: Any) -> None:
            self.msgs.append(msg)

        def _forget(self, stream: Any) -> None:
            self.forgotten += 1

    class HangingUpClient:
        def __init__(self) -> None:
            self.hang_up = asyncio.Event()

        async def receive(self) -> Dict[str, Any]:
            await self.hang_up.wait()
            return {"type": "http.disconnect"}

    async def scenario() -> None:
        frontend, client = Sent(), HangingUpClient()
        stream = RequestStream(frontend, [7, 8])  # type: ignore[arg-type]  # n=2: two choices
        task = asyncio.ensure_future(collect(client, stream))  # type: ignore[arg-type]
        stream._deliver(7, ReplyMsg(uid=7, text="a", num_tokens=1, completion_tokens=1))
        stream._deliver(8, ReplyMsg(uid=8, text="b", num_tokens=1, finished=True, finish_reason="length"))
        await asyncio.sleep(0)  # (a yield, not a wait: the route starts; choice 7 never finishes)
        assert not task.done()
        client.hang_up.set()
        with pytest.raises(APIError) as err:
            await task
        assert err.value.status == 499
        # only the unfinished choice is aborted; the stream is unregistered
        assert frontend.msgs == [AbortReq(7)]
        assert stream.done and frontend.forgotten >= 1

    asyncio.run(scenario())
