"""OpenTelemetry spans of the generation requests (`--otlp-traces-endpoint URL`, off by default).

One SERVER span per POST to a generation endpoint (chat, completions, responses, embeddings,
/generate), named `{gen_ai.operation.name} {gen_ai.request.model}` and carrying the GenAI semantic
conventions' attributes (docs/SERVER.md, "Tracing"). A W3C `traceparent` header on the request
makes the span a child of the caller's span (a router's), so one trace runs router -> engine.

Who records what: `TracingMiddleware` (pure ASGI, inside the X-Request-Id middleware) starts the
span, puts it in a context variable for the request's task, records the HTTP status and, for an
error response, the error's message and code, and ends the span when the response is sent. The
request's `RequestStream` (server/frontend.py) picks the span up when it is created, as it does
the request id, and reports what only it sees: the sampling parameters, the first token, the
token counts and finish reasons, an error from a worker, an abort.

Never in the way of serving: ending a span only appends it to the SDK's bounded queue
(`BatchSpanProcessor`), which a background thread sends in batches over OTLP/HTTP (protobuf). A
collector that is down or slow costs spans (dropped when the queue is full), never a blocked
event loop or a failed request; at shutdown the last batch gets a few seconds, no more.

opentelemetry is imported here only, and only when the flag is given: it is the optional
dependency `pip install 'minisgl[otel]'`.
"""

from __future__ import annotations

import argparse
import contextvars
import json
import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Dict, List, MutableMapping
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from minisgl.message import TokenizeMsg

INSTALL_HINT = "pip install 'minisgl[otel]'"
DEFAULT_SERVICE_NAME = "minisgl"  # OTEL_SERVICE_NAME overrides it, as in every OpenTelemetry SDK
SHUTDOWN_TIMEOUT_S = 3.0  # what the last batch gets at shutdown (a dead collector must not hold the exit)
MAX_ERROR_BODY = 64 << 10  # an error response's body is read for its message up to this size

# the traced routes and their gen_ai.operation.name (the GenAI conventions' well-known values)
OPERATIONS = {
    "/v1/chat/completions": "chat",
    "/v1/responses": "chat",
    "/v1/completions": "text_completion",
    "/generate": "text_completion",
    "/v1/embeddings": "embeddings",
}

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

current_span: contextvars.ContextVar["RequestSpan | None"] = contextvars.ContextVar("minisgl_request_span", default=None)


def otlp_endpoint(text: str) -> str:
    """--otlp-traces-endpoint: an OTLP/HTTP URL; a bare http://host:port gets the traces path."""
    url = text.strip()
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise argparse.ArgumentTypeError(
            f"an OTLP/HTTP URL such as http://collector:4318/v1/traces, got {text!r} (minisgl exports OTLP over HTTP, "
            "not gRPC: point it at the collector's HTTP receiver, port 4318 by default)"
        )
    if parts.path in ("", "/"):
        url = url.rstrip("/") + "/v1/traces"
    return url


def missing_packages() -> str | None:
    """Why --otlp-traces-endpoint cannot work here (the `otel` extra is not installed), or None."""
    try:
        import opentelemetry.exporter.otlp.proto.http.trace_exporter  # noqa: F401
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError as exc:
        return f"--otlp-traces-endpoint needs the OpenTelemetry SDK and its OTLP/HTTP exporter ({exc}): {INSTALL_HINT}"
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
    if protocol and protocol != "http/protobuf":
        return f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL={protocol}: minisgl exports OTLP over HTTP only (http/protobuf, port 4318)"
    return None


class _Throttle(logging.Filter):
    """One record per message (its format string) and `period_s`."""

    def __init__(self, period_s: float = 60.0) -> None:
        super().__init__()
        self.period_s = period_s
        self._last: Dict[str, float] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        now = time.monotonic()
        key = f"{record.name}:{record.msg}"
        if now - self._last.get(key, -self.period_s) < self.period_s:
            return False
        self._last[key] = now
        return True


class Tracing:
    """The tracer provider with its batched OTLP/HTTP exporter, for one server process."""

    def __init__(self, endpoint: str, model_name: str, exporter: Any = None) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.endpoint = endpoint
        self.model_name = model_name
        service = os.environ.get("OTEL_SERVICE_NAME") or DEFAULT_SERVICE_NAME
        # Resource.create also reads OTEL_RESOURCE_ATTRIBUTES
        self.provider = TracerProvider(resource=Resource.create({"service.name": service}))
        # delays, batch and queue sizes: the SDK's OTEL_BSP_* variables (5 s, 512, 2048 by default)
        # (`exporter`: a test's in-memory one instead of OTLP/HTTP)
        self.provider.add_span_processor(BatchSpanProcessor(exporter or OTLPSpanExporter(endpoint=endpoint)))
        self.tracer = self.provider.get_tracer("minisgl")
        self.propagator = TraceContextTextMapPropagator()
        # the SDK's own warnings (a collector that refuses, a full queue) in our log format, each
        # message once a minute: a dead collector is reported, not repeated for every batch
        handler = logging.StreamHandler()
        handler.setFormatter(next((h.formatter for h in logging.getLogger("minisgl").handlers if h.formatter), None))
        handler.addFilter(_Throttle())
        sdk_logger = logging.getLogger("opentelemetry")
        sdk_logger.addHandler(handler)
        sdk_logger.propagate = False

    def start(self, scope: Scope, operation: str) -> "RequestSpan":
        from opentelemetry.trace import SpanKind

        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers", ())}
        parent = self.propagator.extract(headers)  # no (or a malformed) traceparent: a new trace
        attributes: Dict[str, Any] = {
            "gen_ai.operation.name": operation,
            "gen_ai.request.model": self.model_name,
            "gen_ai.response.model": self.model_name,
            "http.request.method": scope.get("method", ""),
            "http.route": scope.get("path", ""),
            "url.path": scope.get("path", ""),
        }
        request_id = scope.get("state", {}).get("request_id")
        if request_id:
            attributes["gen_ai.request.id"] = request_id
        span = self.tracer.start_span(f"{operation} {self.model_name}", context=parent, kind=SpanKind.SERVER, attributes=attributes)
        return RequestSpan(span, operation)

    def shutdown(self, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
        """Send what is queued, waiting `timeout_s` at most (the SDK's own shutdown may wait for
        an export's retries against a dead collector: it runs in a thread we stop waiting for)."""
        worker = threading.Thread(target=self.provider.shutdown, name="minisgl-otel-shutdown", daemon=True)
        worker.start()
        worker.join(timeout_s)


class RequestSpan:
    """The span of one HTTP request, and what the request's parts report to it."""

    def __init__(self, span: Any, operation: str) -> None:
        self.span = span
        self.operation = operation
        self.status = 0
        self.failed = False
        self._aborted = False
        self._error_body: bytearray | None = None

    # ---- from the route and the frontend (the event loop) ---------------------------------------
    def set_model(self, model: str) -> None:
        """The `model` the client asked for (an alias of the served model: check_model refuses others)."""
        self.span.set_attribute("gen_ai.request.model", model)
        self.span.update_name(f"{self.operation} {model}")

    def submitted(self, msgs: "List[TokenizeMsg]", choices: int) -> None:
        """The request went to the workers: its sampling parameters (every choice shares them)."""
        p = msgs[0].sampling
        attributes: Dict[str, Any] = {"gen_ai.request.choice.count": choices}
        if self.operation != "embeddings":
            attributes.update(
                {
                    "gen_ai.request.temperature": p.temperature,
                    "gen_ai.request.top_p": p.top_p,
                    "gen_ai.request.presence_penalty": p.presence_penalty,
                    "gen_ai.request.frequency_penalty": p.frequency_penalty,
                }
            )
            if p.max_tokens is not None:
                attributes["gen_ai.request.max_tokens"] = p.max_tokens
            if p.top_k > 0:
                attributes["gen_ai.request.top_k"] = p.top_k
            if p.seed is not None:
                attributes["gen_ai.request.seed"] = p.seed
            if p.stop:
                attributes["gen_ai.request.stop_sequences"] = list(p.stop)
        self.span.set_attributes(attributes)
        self.span.add_event("submitted", {"minisgl.scheduler_requests": len(msgs)})

    def first_token(self, ttft_s: float) -> None:
        self.span.set_attribute("gen_ai.response.time_to_first_chunk", ttft_s)
        self.span.add_event("first_token")

    def finished(self, input_tokens: int, cached_tokens: int, output_tokens: int, finish_reasons: List[str]) -> None:
        """Every choice ended: the counts the response's `usage` reports."""
        self.span.set_attributes(
            {
                "gen_ai.usage.input_tokens": input_tokens,
                "gen_ai.usage.output_tokens": output_tokens,
                "gen_ai.usage.cache_read.input_tokens": cached_tokens,
                "gen_ai.response.finish_reasons": finish_reasons,
            }
        )
        self.span.add_event("finished")

    def error(self, status: int, message: str, code: str | None = None) -> None:
        """The request failed (an HTTP error, or an error chunk that ended a stream)."""
        from opentelemetry.trace import Status, StatusCode

        if self.failed:
            return
        self.failed = True
        self.span.set_attribute("error.type", code or str(status))
        self.span.set_status(Status(StatusCode.ERROR, message))

    def aborted(self) -> None:
        """Choices were stopped before they finished: the client went away, or the request failed
        on its way in (then the error response says why)."""
        self._aborted = True
        self.span.add_event("aborted")

    # ---- from the middleware ----------------------------------------------------------------------
    def on_send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = int(message["status"])
            self.span.set_attribute("http.response.status_code", self.status)
            content_type = next((v for k, v in message.get("headers", ()) if k.lower() == b"content-type"), b"")
            if self.status < 400:
                self.span.set_attribute("gen_ai.request.stream", content_type.startswith(b"text/event-stream"))
            else:
                self._error_body = bytearray()
        elif message["type"] == "http.response.body" and self._error_body is not None:
            if len(self._error_body) < MAX_ERROR_BODY:
                self._error_body += message.get("body", b"")[: MAX_ERROR_BODY - len(self._error_body)]

    def end(self, exc: BaseException | None = None) -> None:
        if exc is not None:
            self.span.record_exception(exc)
            self.error(500, f"{type(exc).__name__}: {exc}", type(exc).__name__)
        elif self.status >= 400:
            message, code = f"HTTP {self.status}", None
            try:
                err = json.loads(bytes(self._error_body or b""))["error"]
                message, code = str(err["message"]), err.get("code")
            except (ValueError, KeyError, TypeError):
                pass
            self.error(self.status, message, code)
        elif self._aborted:
            self.error(499, "aborted before it finished (the client disconnected)", "aborted")
        self.span.end()


class TracingMiddleware:
    """A span around every POST to a traced route (OPERATIONS); everything else passes through."""

    def __init__(self, app: ASGIApp, tracing: Tracing) -> None:
        self.app = app
        self.tracing = tracing

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        operation = OPERATIONS.get(scope.get("path", "")) if scope["type"] == "http" and scope.get("method") == "POST" else None
        if operation is None:
            await self.app(scope, receive, send)
            return
        span = self.tracing.start(scope, operation)
        token = current_span.set(span)

        async def traced_send(message: Message) -> None:
            span.on_send(message)
            await send(message)

        try:
            await self.app(scope, receive, traced_send)
        except BaseException as exc:
            span.end(exc)
            raise
        else:
            span.end()
        finally:
            current_span.reset(token)
