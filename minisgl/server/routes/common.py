"""What every endpoint shares: OpenAI-style errors, reading and checking a JSON body, the API-key
dependency, and the plumbing from a list of TokenizeMsg to a JSON or SSE response.

Every route is a `GuardedRoute`: whatever a handler raises becomes a complete JSON error response
(an `APIError` its own status, anything else a 500), so the connection stays usable for keep-alive
and no request registered with the frontend is left behind (`respond` aborts it).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from typing import Any, AsyncIterator, Callable, Coroutine, Dict, List, Sequence, Tuple

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from minisgl.message import ErrorMsg, ReplyMsg, TokenizeMsg
from minisgl.sampling_params import InvalidRequest, SamplingParams
from minisgl.server.args import ServerArgs
from minisgl.server.frontend import Frontend, Overloaded, RequestStream, Unavailable
from minisgl.server.limits import RequestLimits, parse_json
from minisgl.server.metrics import ServerMetrics
from minisgl.server.protocol import is_unset
from minisgl.server.tracing import current_span
from minisgl.utils.logger import init_logger

logger = init_logger("minisgl.server.api")

Event = Tuple[int, Any]  # (choice index, ReplyMsg | ErrorMsg)

# ---- errors -------------------------------------------------------------------------------------


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type_: str | None = None,
        headers: Dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_ or error_type(status)
        self.headers = headers

    @staticmethod
    def from_invalid(exc: InvalidRequest, rename: Dict[str, str] | None = None) -> "APIError":
        """An InvalidRequest, with its field named as this endpoint's client sent it."""
        param = exc.param
        if param is not None and rename:
            param = rename.get(param, param)
        message = exc.message
        if param is not None and exc.param is not None and param != exc.param and message.startswith(exc.param):
            message = param + message[len(exc.param) :]
        return APIError(exc.status, message, param, exc.code)

    @staticmethod
    def from_msg(msg: ErrorMsg) -> "APIError":
        return APIError(msg.status, msg.message, msg.param, msg.code)


def error_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 404:
        return "not_found_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


def error_body(status: int, message: str, param: str | None = None, code: str | None = None, type_: str | None = None) -> Dict[str, Any]:
    return {"error": {"message": message, "type": type_ or error_type(status), "param": param, "code": code}}


def error_response(exc: APIError) -> JSONResponse:
    headers = dict(exc.headers or {})
    if exc.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse(error_body(exc.status, exc.message, exc.param, exc.code, exc.type), status_code=exc.status, headers=headers or None)


def internal_error_response(request: Request, exc: BaseException) -> JSONResponse:
    logger.error("unhandled error on %s: %r", request.url.path, exc, exc_info=exc)
    return JSONResponse(error_body(500, f"internal server error: {type(exc).__name__}"), status_code=500)


def validation_error(exc: ValidationError | RequestValidationError) -> APIError:
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request")
    first = errors[0]
    loc = [p for p in first.get("loc", ()) if p != "body"]
    param = str(loc[0]) if loc else None
    if first.get("type") == "extra_forbidden":
        field = ".".join(str(p) for p in loc)
        return APIError(
            400,
            f"unknown field {field!r}: minisgl does not implement it (docs/SERVER.md lists the accepted fields)",
            param=param,
            code="unknown_parameter",
        )
    msg = first.get("msg", "invalid value")
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    where = ".".join(str(p) for p in loc if not (isinstance(p, str) and ("[" in p or p in _UNION_TAGS)))
    text = f"{where}: {msg}" if where else msg
    if len(errors) > 1:
        text += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    return APIError(400, text, param=param, code="invalid_value" if param else None)


_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "function-after"}


class GuardedRoute(APIRoute):
    """A route whose every failure is answered with a complete JSON error response."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def guarded(request: Request) -> Response:
            try:
                return await handler(request)
            except APIError as exc:
                return error_response(exc)
            except InvalidRequest as exc:
                return error_response(APIError.from_invalid(exc))
            except (StarletteHTTPException, RequestValidationError):
                raise
            except Exception as exc:
                return internal_error_response(request, exc)

        return guarded


# ---- state and auth -----------------------------------------------------------------------------


class ServerState:
    def __init__(
        self, args: ServerArgs, info: Dict[str, Any], frontend: Frontend, metrics: ServerMetrics, tokenizer_info: Dict[str, Any]
    ) -> None:
        from minisgl.server import harmony
        from minisgl.server.reasoning import wants_reasoning
        from minisgl.server.tools import HarmonyParser, ToolParser, pick_parser

        self.args = args
        self.info = info  # what the scheduler reported at start-up
        self.chat_template: str | None = tokenizer_info.get("chat_template")
        self.tokenizer_description: Dict[str, Any] | None = tokenizer_info.get("info")  # GET /tokenizer_info
        # harmony (GPT-OSS): one parser reads the channels, reasoning and tool calls together
        self.harmony = harmony.enabled(args.reasoning_parser, args.tool_call_parser, self.chat_template)
        self.tool_parser: ToolParser = HarmonyParser() if self.harmony else pick_parser(args.tool_call_parser, self.chat_template)
        self.reasoning = not self.harmony and wants_reasoning(args.reasoning_parser, self.chat_template)
        self.harmony_stops = harmony.stop_token_ids(self.tokenizer_description) if self.harmony else []
        if (why := harmony.disabled_warning(args.reasoning_parser, args.tool_call_parser, self.chat_template)) is not None:
            logger.warning(why)
        self.frontend = frontend
        self.metrics = metrics
        self.limits = RequestLimits.for_server(args.max_request_bytes, args.max_prompt_bytes, info)
        self.model_name = args.model_name
        self.skip_tokenizer = args.skip_tokenizer_init  # token ids in, token ids out
        self.task: str = info.get("task", "generate")  # "generate" or "embed" (--task)
        self.model_aliases = {self.model_name, args.model or "", args.model_path}
        self.created = int(time.time())
        self._api_key = args.api_key.encode() if args.api_key else None

    def healthy(self) -> bool:
        return self.frontend.failure is None

    def key_matches(self, token: str) -> bool:
        assert self._api_key is not None
        return hmac.compare_digest(token.encode("utf-8", "surrogateescape"), self._api_key)


def get_state(request: Request) -> ServerState:
    return request.app.state.minisgl


def require_api_key(request: Request) -> None:
    """Router dependency: with --api-key, 'Authorization: Bearer <key>' (constant-time compare)."""
    state = get_state(request)
    if state.args.api_key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if not header:
        raise APIError(401, "missing API key: send the header 'Authorization: Bearer <key>'", code="invalid_api_key")
    if scheme.lower() != "bearer" or not state.key_matches(token.strip()):
        raise APIError(401, "incorrect API key provided", code="invalid_api_key")


def _origin_key(origin: str) -> str:
    """An origin compared as browsers mean it: lower case, no default port."""
    origin = origin.strip().lower().rstrip("/")
    for scheme, port in (("http://", ":80"), ("https://", ":443")):
        if origin.startswith(scheme) and origin.endswith(port):
            return origin[: -len(port)]
    return origin


def has_body(request: Request) -> bool:
    """Whether the request declares a body (a chunked one, or a Content-Length above 0)."""
    if "transfer-encoding" in request.headers:
        return True
    return request.headers.get("content-length", "0").strip() not in ("", "0")


def require_same_site(request: Request) -> None:
    """Route dependency of every state-changing route (POST /flush_cache, ...). CORS does not stop
    a cross-site 'simple' request (text/plain, a form, no body): the browser sends it without a
    preflight and only hides the answer, after the cache is gone. So: a request whose `Origin` is
    neither this server's own nor in --allowed-origins gets 403, and one with a body, or sent from
    a page at all (it has an Origin), must declare it JSON (415), which a page cannot do without a
    preflight. curl and the SDKs send no Origin: their bodyless POSTs keep working."""
    state = get_state(request)
    origin = request.headers.get("origin")
    if origin is not None:
        own = _origin_key(f"{request.url.scheme}://{request.headers.get('host', '')}")
        allowed = {_origin_key(o) for o in state.args.allowed_origins or []}
        if _origin_key(origin) != own and "*" not in allowed and _origin_key(origin) not in allowed:
            raise APIError(
                403,
                f"cross-origin request refused: the origin {origin!r} may not change this server's state "
                "(it is not this server's origin nor in --allowed-origins)",
                code="forbidden_origin",
            )
    if (origin is not None or has_body(request)) and not _is_json_media_type(request.headers.get("content-type", "")):
        content_type = request.headers.get("content-type", "")
        raise APIError(
            415,
            f"Content-Type must be application/json, got {content_type or 'none'!r}",
            code="unsupported_media_type",
        )


def need_tokenizer(state: ServerState, what: str, param: str | None = None) -> None:
    """Refuse `what` on a server without a tokenizer (--skip-tokenizer-init): never ignore it."""
    if state.skip_tokenizer:
        raise APIError(
            400,
            f"{what} needs a tokenizer, and this server runs with --skip-tokenizer-init (token ids in, token ids out)",
            param=param,
            code="tokenizer_required",
        )


def require_generate_task(state: ServerState) -> None:
    """An embed server (--task embed, or a bare decoder checkpoint) generates nothing."""
    if state.task != "generate":
        raise APIError(
            400,
            "this server runs the embed task (--task embed, or an embedding checkpoint): it serves /v1/embeddings, "
            "not text generation; start a server with --task generate for that",
            code="wrong_task",
        )


def check_model(state: ServerState, model: str | None) -> None:
    if model is None or model in state.model_aliases:
        return
    raise APIError(
        404,
        f"The model '{model}' does not exist. This server serves '{state.model_name}' (see /v1/models).",
        param="model",
        code="model_not_found",
    )


# ---- reading a body -----------------------------------------------------------------------------


def _is_json_media_type(content_type: str) -> bool:
    mime = content_type.split(";", 1)[0].strip().lower()
    return mime == "application/json" or (mime.startswith("application/") and mime.endswith("+json"))


async def read_body(request: Request, model: type[BaseModel], unsupported: Sequence[str] = ()) -> Any:
    """The request's JSON body as `model`, or an APIError: 415 unless the body is declared JSON
    (so that a web page cannot POST here with a 'simple' cross-site request, which a browser sends
    without asking first), 413 beyond the size limit, 400 for malformed, too deep or invalid JSON
    (`limits.parse_json`: the depth is checked before anything parses it)."""
    limits = get_state(request).limits
    content_type = request.headers.get("content-type", "")
    if not _is_json_media_type(content_type):
        raise APIError(
            415,
            f"Content-Type must be application/json, got {content_type or 'none'!r}",
            code="unsupported_media_type",
        )
    length = request.headers.get("content-length")
    limit = limits.max_request_bytes
    if length is not None:
        try:
            declared = int(length)
        except ValueError:
            raise APIError(400, f"bad Content-Length header: {length!r}") from None
        if declared > limit:
            raise APIError(413, f"request body is {declared} bytes, more than the limit of {limit} bytes", code="request_too_large")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise APIError(413, f"request body is larger than the limit of {limit} bytes", code="request_too_large")
    if not body:
        raise APIError(400, "the request body is empty: send a JSON object")
    try:
        data = parse_json(body, None, "the request body", limits.max_json_depth)
    except InvalidRequest as exc:
        raise APIError.from_invalid(exc) from None
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(data).__name__}", code="invalid_json")
    span = current_span.get()
    if span is not None and isinstance(data.get("model"), str):
        span.set_model(data["model"])
    for name in unsupported:
        if name in data:
            if not is_unset(data[name]):
                raise APIError(400, f"{name} is not supported by minisgl yet", param=name, code="unsupported_parameter")
            del data[name]
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from None


def log_ignored(request: Request, body: Any) -> None:
    """One warning per request naming the accepted fields that change nothing (IGNORED_FIELDS)."""
    names = body.ignored_fields()
    if names:
        logger.warning("%s: ignoring %s (accepted, no effect in minisgl)", request.url.path, ", ".join(names))


def validated(params: SamplingParams, limits: RequestLimits, rename: Dict[str, str] | None = None) -> SamplingParams:
    """`params` checked against the model (vocabulary, context), errors named as the client sent them."""
    try:
        params.validate(limits.vocab_size, limits.max_seq_len)
    except InvalidRequest as exc:
        raise APIError.from_invalid(exc, rename) from None
    return params


def check_prompts(prompts: List[Any], limits: RequestLimits, param: str) -> None:
    """Sizes and token ids of completion-style prompts, before anything is tokenized."""
    from minisgl.sampling_params import check_token_ids

    for prompt in prompts:
        try:
            if isinstance(prompt, str):
                if not prompt:
                    raise InvalidRequest("prompt is empty", param=param)
                limits.check_prompt_text(len(prompt.encode("utf-8")), param)
            else:
                check_token_ids(prompt, limits.vocab_size, param)
                limits.check_prompt_ids(prompt, param)
        except InvalidRequest as exc:
            raise APIError.from_invalid(exc) from None


def prompt_messages(
    frontend: Frontend, prompts: List[Any], n: int, params: SamplingParams, *, max_tokens_explicit: bool, **fields: Any
) -> List[TokenizeMsg]:
    """One TokenizeMsg per (prompt, choice) of a completion-style request: a text prompt or token ids."""
    return [
        TokenizeMsg(
            uid=frontend.new_uid(),
            text=prompt if isinstance(prompt, str) else None,
            input_ids=None if isinstance(prompt, str) else list(prompt),
            sampling=params.for_choice(i),
            max_tokens_explicit=max_tokens_explicit,
            **fields,
        )
        for prompt in prompts
        for i in range(n)
    ]


# ---- from messages to a response ----------------------------------------------------------------


def submit(frontend: Frontend, msgs: List[TokenizeMsg], label: str = "", choices: int = 1) -> RequestStream:
    try:
        return frontend.submit(msgs, label, choices)
    except Overloaded as exc:
        raise APIError(503, str(exc), code="server_overloaded", headers={"Retry-After": str(exc.retry_after_s)}) from None
    except Unavailable as exc:
        raise APIError(503, f"the server cannot take requests: {exc}", code="server_unavailable") from None


async def respond(
    request: Request,
    msgs: List[TokenizeMsg],
    stream: bool,
    sse_body: Callable[[RequestStream, Event], AsyncIterator[str]],
    render: Callable[[List["Result"]], Any],
    choices: int = 1,
) -> Response:
    """Submit `msgs` (one per choice, `choices` per prompt) and answer with an SSE stream or one
    JSON body. Whatever happens before the response is handed over, nothing stays registered or
    running."""
    rs = submit(get_state(request).frontend, msgs, f"{request.method} {request.url.path}", choices)
    try:
        if stream:
            first = await first_event(request, rs)
            return sse(coalesce(sse_body(rs, first), rs))
        return JSONResponse(render(await collect(request, rs)))
    except BaseException:
        rs.abort()
        raise


async def _until_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _race_disconnect(request: Request, stream: RequestStream, coro: Any) -> Any:
    """Await `coro`; if the client disconnects first, abort the request (freeing its pages)."""
    work = asyncio.ensure_future(coro)
    watch = asyncio.ensure_future(_until_disconnect(request))
    try:
        done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        work.cancel()
        watch.cancel()
        stream.abort()
        raise
    if work in done:
        watch.cancel()
        return work.result()
    work.cancel()
    stream.abort()
    logger.info("client disconnected: request %s aborted", stream.uids)
    raise APIError(499, "client disconnected")


async def first_event(request: Request, stream: RequestStream) -> Event:
    """For streams: wait for the first reply, so that a bad request still gets a plain 4xx."""
    index, msg = await _race_disconnect(request, stream, stream.next())
    if isinstance(msg, ErrorMsg):
        stream.abort()
        raise APIError.from_msg(msg)
    return index, msg


class Result:
    """Everything one choice produced."""

    def __init__(self) -> None:
        self.text: List[str] = []
        self.token_ids: List[int] = []
        self.logprobs: List[List[Any]] = []
        self.finish_reason: str | None = None
        self.matched_stop: Any = None
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.prompt_logprobs: List[List[Any]] | None = None
        self.embedding: bytes | None = None  # the embed task's vector (float32 little-endian)

    def add(self, reply: ReplyMsg) -> None:
        if reply.prompt_logprobs is not None:
            self.prompt_logprobs = reply.prompt_logprobs
        self.text.append(reply.text)
        self.token_ids += reply.token_ids or []
        if reply.logprobs:
            self.logprobs += reply.logprobs
        self.prompt_tokens = reply.prompt_tokens
        self.completion_tokens = reply.completion_tokens
        self.cached_tokens = reply.cached_tokens
        if reply.finished:
            self.finish_reason = reply.finish_reason
            self.matched_stop = reply.matched_stop
            self.embedding = reply.embedding


async def collect(request: Request, stream: RequestStream) -> List[Result]:
    async def gather() -> List[Result]:
        results = [Result() for _ in stream.uids]
        remaining = len(stream.uids)
        while remaining:
            index, msg = await stream.next()
            if isinstance(msg, ErrorMsg):
                stream.abort()
                raise APIError.from_msg(msg)
            results[index].add(msg)
            if msg.finished:
                remaining -= 1
        return results

    return await _race_disconnect(request, stream, gather())


def usage(results: List[Result], n: int) -> Dict[str, Any]:
    # the prompt is counted once per prompt, not once per choice
    prompt = sum(r.prompt_tokens for r in results[::n])
    cached = sum(r.cached_tokens for r in results[::n])
    completion = sum(r.completion_tokens for r in results)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def sse(gen: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(gen, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def coalesce(body: AsyncIterator[str], stream: RequestStream) -> AsyncIterator[str]:
    """Hand the HTTP layer one string per batch of ready events, not one per SSE chunk: when this
    stream's queue already holds the next events (the server is behind, or the request ended),
    their chunks go out in the same write. Each write costs a trip through Starlette, uvicorn and
    a send() syscall, which at hundreds of streams is what makes the API path fall behind."""
    pending: List[str] = []
    try:
        async for piece in body:
            pending.append(piece)
            if stream.queue.empty() and not stream.done:  # the next event is not there yet: send now
                yield "".join(pending)
                pending.clear()
        if pending:
            yield "".join(pending)
    finally:
        close = getattr(body, "aclose", None)
        if close is not None:
            await close()  # now, not at garbage collection: its exit aborts an unfinished request


def data_line(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def stream_error(msg: ErrorMsg) -> str:
    return data_line(error_body(msg.status, msg.message, msg.param, msg.code))


async def events(stream: RequestStream, first: Event) -> AsyncIterator[Event]:
    """Every event of a stream, starting with `first`; aborts what is unfinished on exit (the
    client disconnected, or the server is shutting down)."""
    try:
        yield first
        while not (stream.done and stream.queue.empty()):
            yield await stream.next()
    finally:
        if not stream.done:
            stream.abort()
            logger.info("stream closed early: request %s aborted", stream.uids)


class ChunkWriter:
    """SSE `data:` lines of one streamed response: every chunk shares id, object, created, model."""

    def __init__(self, rid: str, obj: str, model: str, include_usage: bool, continuous_usage: bool = False) -> None:
        self.head = {"id": rid, "object": obj, "created": int(time.time()), "model": model}
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage
        # the shared fields are encoded once: only the choice is encoded per chunk
        self._open = "data: " + json.dumps(self.head, ensure_ascii=False)[:-1] + ', "choices": ['
        self._close = ('], "usage": null}' if include_usage else "]}") + "\n\n"  # OpenAI: usage null but on the last

    def choice(self, choice: Dict[str, Any], so_far: "Result | None" = None) -> str:
        if self.continuous_usage and so_far is not None:  # vLLM's continuous_usage_stats: this choice's counts
            prompt, done = so_far.prompt_tokens, so_far.completion_tokens
            counts = {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}
            return self._open + json.dumps(choice, ensure_ascii=False) + f'], "usage": {json.dumps(counts)}}}\n\n'
        return self._open + json.dumps(choice, ensure_ascii=False) + self._close

    def usage(self, usage: Dict[str, Any]) -> str:
        return data_line({**self.head, "choices": [], "usage": usage})
