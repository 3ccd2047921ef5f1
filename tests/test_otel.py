"""--otlp-traces-endpoint: a real server on the tiny chat model sends its spans to an OTLP/HTTP
receiver run by the test (a thread that decodes POST /v1/traces with opentelemetry-proto), and
keeps serving once nothing listens there any more."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Dict, Iterator, List, Tuple

import httpx
import pytest
from server_helpers import MAX_SEQ_LEN, REPO, ServerProcess

SPAN_WAIT_S = 60.0  # the SDK sends every 100 ms here (OTEL_BSP_SCHEDULE_DELAY); bounded, generous


class Receiver:
    """An OTLP/HTTP trace receiver: every span of every POST /v1/traces, with its resource."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest, ExportTraceServiceResponse

        self.spans: List[Tuple[Dict[str, Any], Any]] = []  # (resource attributes, Span message)
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                with receiver.lock:
                    for rs in request.resource_spans:
                        resource = attributes(rs.resource.attributes)
                        for ss in rs.scope_spans:
                            receiver.spans.extend((resource, span) for span in ss.spans)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200 if self.path == "/v1/traces" else 404)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def wait_span(self, trace_id: str) -> Tuple[Dict[str, Any], Any]:
        """The one span of trace `trace_id` (hex), once it has arrived."""
        deadline = time.monotonic() + SPAN_WAIT_S
        while time.monotonic() < deadline:
            with self.lock:
                found = [(r, s) for r, s in self.spans if s.trace_id.hex() == trace_id]
            if found:
                assert len(found) == 1, f"{len(found)} spans in trace {trace_id}"
                return found[0]
            time.sleep(0.05)
        raise AssertionError(f"no span of trace {trace_id} after {SPAN_WAIT_S:.0f} s ({len(self.spans)} spans received)")

    def close(self) -> None:
        if self.thread.is_alive():
            self.server.shutdown()
            self.server.server_close()


def value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind is not None else None


def attributes(kvs: Any) -> Dict[str, Any]:
    return {kv.key: value(kv.value) for kv in kvs}


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    try:
        yield r
    finally:
        r.close()


@pytest.fixture(scope="module")
def server(tiny_chat_model: str, receiver: Receiver, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    flags = ("--dtype", "float32", "--max-seq-len", str(MAX_SEQ_LEN), "--num-pages", "2048", "--max-running-requests", "8")
    with pytest.MonkeyPatch.context() as mp:  # the server copies the environment when it starts
        mp.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
        mp.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "1")  # once the receiver is gone, the retries end soon
        mp.delenv("OTEL_SERVICE_NAME", raising=False)
        srv = ServerProcess(
            tiny_chat_model, *flags, "--otlp-traces-endpoint", receiver.url, log_path=tmp_path_factory.mktemp("otel") / "server.log"
        )
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


def traceparent(n: int) -> Tuple[str, str, str]:
    """(header, trace id, parent span id) of a caller's trace (a router's)."""
    trace_id, span_id = f"{0x4BF92F3577B34DA6A3CE929D0E0E4736 + n:032x}", f"{0x00F067AA0BA902B7 + n:016x}"
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def events(span: Any) -> List[str]:
    return [e.name for e in span.events]


def test_a_chat_is_one_server_span_in_the_callers_trace(server: ServerProcess, receiver: Receiver) -> None:
    from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

    srv = server
    header, trace_id, parent_id = traceparent(1)
    body = {
        "model": "tiny_chat_llama",
        "messages": [{"role": "user", "content": "Tell me about tracing."}],
        "max_tokens": 8,
        "temperature": 0.5,
        "top_p": 0.9,
        "seed": 7,
    }
    resp = httpx.post(
        srv.base_url + "/v1/chat/completions", json=body, headers={"traceparent": header, "X-Request-Id": "otel-chat-1"}, timeout=120
    )
    assert resp.status_code == 200, resp.text
    out = resp.json()
    resource, span = receiver.wait_span(trace_id)
    assert resource["service.name"] == "minisgl"
    assert span.name == "chat tiny_chat_llama" and span.kind == Span.SPAN_KIND_SERVER
    assert span.parent_span_id.hex() == parent_id
    a = attributes(span.attributes)
    usage = out["usage"]
    assert a["gen_ai.operation.name"] == "chat"
    assert a["gen_ai.request.model"] == "tiny_chat_llama" and a["gen_ai.response.model"] == "tiny_chat_llama"
    assert (a["gen_ai.request.max_tokens"], a["gen_ai.request.temperature"], a["gen_ai.request.top_p"]) == (8, 0.5, 0.9)
    assert a["gen_ai.request.seed"] == 7 and a["gen_ai.request.choice.count"] == 1 and a["gen_ai.request.stream"] is False
    assert a["gen_ai.usage.input_tokens"] == usage["prompt_tokens"] > 0
    assert a["gen_ai.usage.output_tokens"] == usage["completion_tokens"] > 0
    assert a["gen_ai.usage.cache_read.input_tokens"] == usage["prompt_tokens_details"]["cached_tokens"]
    assert a["gen_ai.response.finish_reasons"] == [out["choices"][0]["finish_reason"]]
    assert a["gen_ai.request.id"] == "otel-chat-1" == resp.headers["x-request-id"]
    assert a["http.response.status_code"] == 200 and a["http.route"] == "/v1/chat/completions"
    assert a["gen_ai.response.time_to_first_chunk"] > 0
    assert events(span) == ["submitted", "first_token", "finished"]
    assert span.status.code == Status.STATUS_CODE_UNSET
    assert span.end_time_unix_nano >= span.events[-1].time_unix_nano >= span.events[0].time_unix_nano >= span.start_time_unix_nano


def test_a_streamed_completion_counts_tokens_as_its_usage_does(server: ServerProcess, receiver: Receiver) -> None:
    srv = server
    header, trace_id, _ = traceparent(2)
    body = {"prompt": "Once upon a time", "max_tokens": 6, "n": 2, "stream": True, "stream_options": {"include_usage": True}}
    usage, reasons = None, []
    with httpx.stream("POST", srv.base_url + "/v1/completions", json=body, headers={"traceparent": header}, timeout=120) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            usage = chunk.get("usage") or usage
            reasons += [c["finish_reason"] for c in chunk["choices"] if c.get("finish_reason")]
    assert usage is not None and len(reasons) == 2
    _, span = receiver.wait_span(trace_id)
    a = attributes(span.attributes)
    assert span.name == "text_completion tiny_chat_llama" and a["gen_ai.operation.name"] == "text_completion"
    assert a["gen_ai.request.stream"] is True and a["gen_ai.request.choice.count"] == 2
    # the prompt is counted once for its two choices, as `usage` counts it
    assert a["gen_ai.usage.input_tokens"] == usage["prompt_tokens"] > 0
    assert a["gen_ai.usage.output_tokens"] == usage["completion_tokens"] > 0
    assert sorted(a["gen_ai.response.finish_reasons"]) == sorted(reasons)
    assert a["gen_ai.request.max_tokens"] == 6
    assert events(span) == ["submitted", "first_token", "finished"]


def test_a_refused_request_is_an_error_span(server: ServerProcess, receiver: Receiver) -> None:
    from opentelemetry.proto.trace.v1.trace_pb2 import Status

    srv = server
    header, trace_id, _ = traceparent(3)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}
    resp = httpx.post(srv.base_url + "/v1/chat/completions", json=body, headers={"traceparent": header}, timeout=60)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    _, span = receiver.wait_span(trace_id)
    a = attributes(span.attributes)
    assert span.status.code == Status.STATUS_CODE_ERROR and span.status.message == err["message"]
    assert a["http.response.status_code"] == 400 and a["error.type"] == (err["code"] or "400")
    assert "submitted" not in events(span)  # refused before anything reached the workers


def test_the_collector_going_away_does_not_stop_serving(server: ServerProcess, receiver: Receiver) -> None:
    """Runs after the tests that read spans: it closes the receiver's port, so the server's next
    exports are refused while requests go on."""
    receiver.close()
    for i in range(3):
        resp = httpx.post(
            server.base_url + "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": f"hello {i}"}], "max_tokens": 4},
            headers={"traceparent": traceparent(10 + i)[0]},
            timeout=120,
        )
        assert resp.status_code == 200, resp.text
    body = {"prompt": "abc", "max_tokens": 4, "stream": True}
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200 and r.read().decode().rstrip().endswith("data: [DONE]")
    assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200


def _traced_canned_app(text: str) -> Tuple[Any, Any, Any]:
    """The canned frontend (server_helpers; no workers) behind a traced app, spans kept in memory."""
    from fastapi.testclient import TestClient
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from server_helpers import CannedFrontend

    from minisgl.server.api_server import create_app
    from minisgl.server.args import parse_args
    from minisgl.server.metrics import ServerMetrics
    from minisgl.server.tracing import Tracing

    args = parse_args([])
    args.model_path = "/models/x"
    exporter = InMemorySpanExporter()
    tracing = Tracing("http://unused:4318/v1/traces", args.model_name, exporter=exporter)
    frontend = CannedFrontend(text)
    info = {"max_seq_len": 512, "vocab_size": 100, "max_running_req": 4}
    app = create_app(args, info, frontend, ServerMetrics(), tokenizer_info={"chat_template": "{{ messages }}"}, tracing=tracing)  # type: ignore[arg-type]
    return TestClient(app), frontend, (tracing, exporter)


def _finished_spans(traced: Any) -> List[Any]:
    tracing, exporter = traced
    tracing.provider.force_flush()
    return list(exporter.get_finished_spans())


def test_n_choices_count_their_prompt_once() -> None:
    client, _, traced = _traced_canned_app("Hello there")
    resp = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "n": 2, "max_tokens": 9})
    assert resp.status_code == 200, resp.text
    (span,) = _finished_spans(traced)
    a, usage = span.attributes, resp.json()["usage"]
    assert a["gen_ai.usage.input_tokens"] == usage["prompt_tokens"] and a["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
    assert tuple(a["gen_ai.response.finish_reasons"]) == ("stop", "stop")


def test_every_generation_route_is_traced_and_nothing_else() -> None:
    client, _, traced = _traced_canned_app("Hi!")
    calls = [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "chat"),
        ("/v1/responses", {"input": "hi"}, "chat"),
        ("/v1/completions", {"prompt": "hi"}, "text_completion"),
        ("/generate", {"text": "hi"}, "text_completion"),
    ]
    for path, body, _ in calls:
        assert client.post(path, json=body).status_code == 200, path
    assert client.get("/v1/models").status_code == 200 and client.post("/v1/nothing", json={}).status_code == 404
    spans = _finished_spans(traced)
    model = client.get("/v1/models").json()["data"][0]["id"]
    assert [(s.name, s.attributes["gen_ai.operation.name"], s.attributes["http.route"]) for s in spans] == [
        (f"{op} {model}", op, path) for path, _, op in calls
    ]


def test_an_error_chunk_after_the_stream_started_fails_the_span() -> None:
    import asyncio

    from opentelemetry.trace import StatusCode

    from minisgl.message import ErrorMsg, ReplyMsg
    from minisgl.server.frontend import RequestStream

    client, frontend, traced = _traced_canned_app("unused")

    def failing_submit(msgs: List[Any], label: str = "", choices: int = 1) -> RequestStream:
        stream = RequestStream(frontend, [m.uid for m in msgs], label, choices)
        uid, loop = stream.uids[0], asyncio.get_running_loop()
        loop.call_soon(stream._deliver, uid, ReplyMsg(uid, "Hel", 1, False, None, 5, 1, 0, None, None, [7]))
        loop.call_soon(stream._deliver, uid, ErrorMsg(uid, "the scheduler step failed", 500))
        return stream

    frontend.submit = failing_submit
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
    with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        assert "the scheduler step failed" in resp.read().decode()
    (span,) = _finished_spans(traced)
    assert span.attributes["http.response.status_code"] == 200 and span.attributes["error.type"] == "500"
    assert span.status.status_code == StatusCode.ERROR and span.status.description == "the scheduler step failed"
    assert [e.name for e in span.events] == ["first_token", "finished"]  # (the canned frontend sends no "submitted")


def test_the_endpoint_is_an_otlp_http_url() -> None:
    import argparse

    from minisgl.server.tracing import otlp_endpoint

    assert otlp_endpoint("http://collector:4318") == "http://collector:4318/v1/traces"
    assert otlp_endpoint("https://c.example/otlp/v1/traces") == "https://c.example/otlp/v1/traces"
    for bad in ("localhost:4317", "grpc://collector:4317", "collector"):
        with pytest.raises(argparse.ArgumentTypeError, match="OTLP/HTTP"):
            otlp_endpoint(bad)


def test_without_the_otel_extra_the_flag_is_refused_and_off_nothing_loads() -> None:
    """The SDK hidden (as if `minisgl[otel]` were not installed): the flag stops the start with the
    extra named, before anything starts; without the flag no OpenTelemetry SDK is imported."""
    code = (
        "import sys\n"
        "import minisgl\n"
        "assert not any(m.startswith('opentelemetry') for m in sys.modules), 'import minisgl loaded opentelemetry'\n"
        "from minisgl.server.args import parse_args\n"
        "import minisgl.server.api_server, minisgl.server.launch\n"
        "parse_args([])\n"
        "assert not any(m.startswith(('opentelemetry.sdk', 'opentelemetry.exporter')) for m in sys.modules), 'the SDK loaded'\n"
        "sys.modules['opentelemetry.sdk'] = None  # import opentelemetry.sdk... now raises ImportError\n"
        "from minisgl.server.launch import launch\n"
        "sys.exit(launch(parse_args(['--otlp-traces-endpoint', 'http://127.0.0.1:9/v1/traces', '--port', '0'])))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "pip install 'minisgl[otel]'" in proc.stdout + proc.stderr
