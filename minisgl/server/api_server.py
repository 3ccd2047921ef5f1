"""The OpenAI-compatible HTTP API (FastAPI), running in the server's main process.

Endpoints: /v1/models, /v1/completions, /v1/chat/completions (JSON or SSE streams), /generate
(SGLang's native API), /health, /metrics (Prometheus), /server_info, /flush_cache.

Request bodies are read here by hand, not by FastAPI: a body larger than `--max-request-bytes` is
refused with 413 (by its Content-Length, and while it streams in for chunked uploads) before any
parsing; malformed JSON and schema violations become OpenAI-style 400 errors
`{"error": {"message", "type", "param", "code"}}`. Errors found by the tokenizer worker or the
scheduler (prompt too long, max_tokens beyond the context, ...) come back as ErrorMsg and become
400s too. A client that disconnects, before or during its stream, has its request aborted.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any, AsyncIterator, Callable, Dict, List, Tuple

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from minisgl.message import ErrorMsg, ReplyMsg, TokenizeMsg
from minisgl.server.args import ServerArgs
from minisgl.server.frontend import Frontend, RequestStream
from minisgl.server.metrics import CONTENT_TYPE, ServerMetrics
from minisgl.server.protocol import ChatCompletionRequest, CompletionRequest, GenerateRequest
from minisgl.utils.logger import init_logger

logger = init_logger(__name__)


# ---- errors -----------------------------------------------------------------------------------


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None, type_: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_ or _error_type(status)


def _error_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 404:
        return "not_found_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


def error_body(status: int, message: str, param: str | None = None, code: str | None = None, type_: str | None = None) -> Dict[str, Any]:
    return {"error": {"message": message, "type": type_ or _error_type(status), "param": param, "code": code}}


def error_response(exc: APIError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
    return JSONResponse(error_body(exc.status, exc.message, exc.param, exc.code, exc.type), status_code=exc.status, headers=headers)


def _from_error_msg(msg: ErrorMsg) -> APIError:
    return APIError(msg.status, msg.message, msg.param, msg.code)


def _validation_error(exc: ValidationError | RequestValidationError) -> APIError:
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request")
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body",)]
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid value")
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    text = f"{param}: {msg}" if param else msg
    if len(errors) > 1:
        text += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    return APIError(400, text, param=param, code="invalid_value" if param else None)


# ---- the app ----------------------------------------------------------------------------------


class ServerState:
    def __init__(self, args: ServerArgs, info: Dict[str, Any], frontend: Frontend, metrics: ServerMetrics) -> None:
        self.args = args
        self.info = info  # what the scheduler reported at start-up
        self.frontend = frontend
        self.metrics = metrics
        self.model_name = args.model_name
        self.model_aliases = {self.model_name, args.model or "", args.model_path}
        self.created = int(time.time())
        self.healthy: Callable[[], bool] = lambda: frontend.failure is None


def create_app(args: ServerArgs, info: Dict[str, Any], frontend: Frontend, metrics: ServerMetrics, lifespan: Any = None) -> FastAPI:
    app = FastAPI(title="minisgl", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None)
    state = ServerState(args, info, frontend, metrics)
    app.state.minisgl = state

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(_validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return JSONResponse(error_body(exc.status_code, str(exc.detail), code=code), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        logger.error("unhandled error on %s: %r", request.url.path, exc, exc_info=exc)
        return JSONResponse(error_body(500, f"internal server error: {type(exc).__name__}"), status_code=500)

    # ---- plain endpoints -----------------------------------------------------------------------
    @app.get("/health")
    async def health() -> Response:
        if not state.healthy():
            return JSONResponse({"status": "unhealthy", "reason": frontend.failure}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def list_models(request: Request) -> Dict[str, Any]:
        _check_auth(request, args)
        return {
            "object": "list",
            "data": [
                {
                    "id": state.model_name,
                    "object": "model",
                    "created": state.created,
                    "owned_by": "minisgl",
                    "root": args.model_path,
                    "max_model_len": info.get("max_seq_len"),
                }
            ],
        }

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str, request: Request) -> Dict[str, Any]:
        _check_auth(request, args)
        _check_model(state, model_id)
        return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "minisgl"}

    @app.get("/server_info")
    async def server_info() -> Dict[str, Any]:
        stats = frontend.stats
        return {
            "model": state.model_name,
            "model_path": args.model_path,
            "scheduler": info,
            "stats": None if stats is None else {k: getattr(stats, k) for k in stats.__dataclass_fields__},
            "requests_in_flight": frontend.num_in_flight,
        }

    @app.post("/flush_cache")
    async def flush_cache(request: Request) -> Dict[str, Any]:
        _check_auth(request, args)
        frontend.flush_cache()
        return {"status": "ok"}

    # ---- generation ----------------------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        _check_auth(request, args)
        body = await _read_model(request, ChatCompletionRequest, args.max_request_bytes)
        _check_model(state, body.model)
        try:
            messages = [m.to_template() for m in body.messages]
        except ValueError as exc:
            raise APIError(400, str(exc), param="messages") from None
        k = body.logprobs_k()
        max_tokens = body.effective_max_tokens()
        stops = body.stop_list()
        msgs = [
            TokenizeMsg(
                uid=frontend.new_uid(),
                messages=messages,
                sampling=body.sampling_dict(max_tokens, k, i),
                max_tokens_explicit=max_tokens is not None,
                stop=stops,
                want_logprobs=k is not None,
                skip_special_tokens=body.skip_special_tokens,
                chat_template_kwargs=body.chat_template_kwargs,
            )
            for i in range(body.n)
        ]
        stream = _submit(frontend, msgs)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        if body.stream:
            first = await _first_event(request, stream)
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return _sse(_chat_stream(stream, first, rid, state.model_name, include_usage, k is not None))
        results = await _collect(request, stream)
        return JSONResponse(_chat_response(results, rid, state.model_name, k is not None))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        _check_auth(request, args)
        body = await _read_model(request, CompletionRequest, args.max_request_bytes)
        _check_model(state, body.model)
        try:
            prompts = body.prompts()
        except ValueError as exc:
            raise APIError(400, str(exc), param="prompt") from None
        if len(prompts) * body.n > 256:
            raise APIError(400, f"too many choices: {len(prompts)} prompts x n={body.n} > 256", param="n")
        max_tokens = body.max_tokens if body.max_tokens is not None else 16  # OpenAI's default
        k = body.logprobs
        stops = body.stop_list()
        msgs = []
        for prompt in prompts:
            if isinstance(prompt, str) and not prompt:
                raise APIError(400, "prompt is empty", param="prompt")
            for i in range(body.n):
                msgs.append(
                    TokenizeMsg(
                        uid=frontend.new_uid(),
                        text=prompt if isinstance(prompt, str) else None,
                        input_ids=prompt if not isinstance(prompt, str) else None,
                        sampling=body.sampling_dict(max_tokens, k, i),
                        max_tokens_explicit=body.max_tokens is not None,
                        stop=stops,
                        want_logprobs=k is not None,
                        skip_special_tokens=body.skip_special_tokens,
                    )
                )
        stream = _submit(frontend, msgs)
        rid = f"cmpl-{uuid.uuid4().hex}"
        if body.stream:
            first = await _first_event(request, stream)
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return _sse(_completion_stream(stream, first, rid, state.model_name, include_usage, body.n, k is not None))
        results = await _collect(request, stream)
        return JSONResponse(_completion_response(results, rid, state.model_name, body.n, k is not None))

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        _check_auth(request, args)
        body = await _read_model(request, GenerateRequest, args.max_request_bytes)
        sp = body.sampling_params
        if body.text is not None:
            prompts: List[Any] = [body.text] if isinstance(body.text, str) else list(body.text)
            batched = not isinstance(body.text, str)
        else:
            ids = body.input_ids or []
            batched = bool(ids) and isinstance(ids[0], list)
            prompts = list(ids) if batched else [ids]
        if not prompts:
            raise APIError(400, "no prompt given", param="text")
        stops = [sp.stop] if isinstance(sp.stop, str) else [s for s in (sp.stop or []) if s]
        k = body.top_logprobs_num if body.return_logprob else None
        msgs = []
        for prompt in prompts:
            for i in range(sp.n):
                sampling = {
                    "temperature": sp.temperature,
                    "top_p": sp.top_p,
                    "top_k": sp.top_k if sp.top_k != 0 else -1,
                    "min_p": sp.min_p,
                    "max_tokens": sp.max_new_tokens,
                    "ignore_eos": sp.ignore_eos,
                    "stop_token_ids": list(sp.stop_token_ids or []),
                    "seed": None if sp.seed is None else sp.seed + i,
                    "presence_penalty": sp.presence_penalty,
                    "frequency_penalty": sp.frequency_penalty,
                    "repetition_penalty": sp.repetition_penalty,
                    "logprobs": k,
                }
                msgs.append(
                    TokenizeMsg(
                        uid=frontend.new_uid(),
                        text=prompt if isinstance(prompt, str) else None,
                        input_ids=None if isinstance(prompt, str) else list(prompt),
                        sampling=sampling,
                        max_tokens_explicit=True,
                        stop=stops,
                        want_logprobs=k is not None,
                        skip_special_tokens=sp.skip_special_tokens,
                    )
                )
        stream = _submit(frontend, msgs)
        rid = uuid.uuid4().hex
        if body.stream:
            first = await _first_event(request, stream)
            return _sse(_generate_stream(stream, first, rid, k is not None))
        results = await _collect(request, stream)
        out = [_generate_item(r, f"{rid}-{i}", k is not None) for i, r in enumerate(results)]
        return JSONResponse(out if batched or len(out) > 1 else out[0])

    return app


# ---- request plumbing -------------------------------------------------------------------------


def _check_auth(request: Request, args: ServerArgs) -> None:
    if not args.api_key:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if not header:
        raise APIError(401, "missing API key: send the header 'Authorization: Bearer <key>'", code="invalid_api_key")
    if scheme.lower() != "bearer" or token.strip() != args.api_key:
        raise APIError(401, "incorrect API key provided", code="invalid_api_key")


def _check_model(state: ServerState, model: str | None) -> None:
    if model is None or model in state.model_aliases:
        return
    raise APIError(
        404,
        f"The model '{model}' does not exist. This server serves '{state.model_name}' (see /v1/models).",
        param="model",
        code="model_not_found",
    )


async def _read_model(request: Request, model: type[BaseModel], limit: int) -> Any:
    length = request.headers.get("content-length")
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
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise APIError(400, f"malformed JSON in the request body: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(data).__name__}", code="invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise _validation_error(exc) from None


def _submit(frontend: Frontend, msgs: List[TokenizeMsg]) -> RequestStream:
    try:
        return frontend.submit(msgs)
    except RuntimeError as exc:
        raise APIError(503, f"the server cannot take requests: {exc}", code="server_unavailable") from None


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


async def _first_event(request: Request, stream: RequestStream) -> Tuple[int, Any]:
    """For streams: wait for the first reply, so that a bad request still gets a plain 4xx."""
    index, msg = await _race_disconnect(request, stream, stream.next())
    if isinstance(msg, ErrorMsg):
        stream.abort()
        raise _from_error_msg(msg)
    return index, msg


class _Result:
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

    def add(self, reply: ReplyMsg) -> None:
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


async def _collect(request: Request, stream: RequestStream) -> List[_Result]:
    async def gather() -> List[_Result]:
        results = [_Result() for _ in stream.uids]
        remaining = len(stream.uids)
        while remaining:
            index, msg = await stream.next()
            if isinstance(msg, ErrorMsg):
                stream.abort()
                raise _from_error_msg(msg)
            results[index].add(msg)
            if msg.finished:
                remaining -= 1
        return results

    return await _race_disconnect(request, stream, gather())


def _usage(results: List[_Result], n: int) -> Dict[str, Any]:
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


def _sse(gen: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(gen, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _data(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _events(stream: RequestStream, first: Tuple[int, Any]) -> AsyncIterator[Tuple[int, Any]]:
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


def _chat_logprobs(entries: List[List[Any]]) -> Dict[str, Any]:
    return {
        "content": [
            {
                "token": tok,
                "logprob": lp,
                "bytes": list(tok.encode("utf-8")),
                "top_logprobs": [{"token": t, "logprob": l, "bytes": list(t.encode("utf-8"))} for t, l in tops],
            }
            for tok, lp, tops, _ in entries
        ]
    }


def _completion_logprobs(entries: List[List[Any]], start_offset: int = 0) -> Dict[str, Any]:
    offsets, pos = [], start_offset
    for tok, *_ in entries:
        offsets.append(pos)
        pos += len(tok)
    return {
        "tokens": [e[0] for e in entries],
        "token_logprobs": [e[1] for e in entries],
        "top_logprobs": [{t: l for t, l in e[2]} for e in entries],
        "text_offset": offsets,
    }


def _chat_response(results: List[_Result], rid: str, model: str, want_lp: bool) -> Dict[str, Any]:
    choices = []
    for i, r in enumerate(results):
        choices.append(
            {
                "index": i,
                "message": {"role": "assistant", "content": "".join(r.text)},
                "logprobs": _chat_logprobs(r.logprobs) if want_lp else None,
                "finish_reason": r.finish_reason,
                "stop_reason": r.matched_stop,
            }
        )
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": _usage(results, len(results)),
    }


def _completion_response(results: List[_Result], rid: str, model: str, n: int, want_lp: bool) -> Dict[str, Any]:
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": i,
                "text": "".join(r.text),
                "logprobs": _completion_logprobs(r.logprobs) if want_lp else None,
                "finish_reason": r.finish_reason,
                "stop_reason": r.matched_stop,
            }
            for i, r in enumerate(results)
        ],
        "usage": _usage(results, n),
    }


def _stream_error(msg: ErrorMsg) -> str:
    return _data(error_body(msg.status, msg.message, msg.param, msg.code))


async def _chat_stream(
    stream: RequestStream, first: Tuple[int, Any], rid: str, model: str, include_usage: bool, want_lp: bool
) -> AsyncIterator[str]:
    out = _ChunkWriter(rid, "chat.completion.chunk", model, include_usage)
    results = [_Result() for _ in stream.uids]
    started = [False] * len(results)

    def chunk(index: int, delta: Dict[str, Any], finish: str | None = None, logprobs: Any = None, **extra: Any) -> str:
        return out.choice({"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish, **extra})

    async for index, msg in _events(stream, first):
        if isinstance(msg, ErrorMsg):
            yield _stream_error(msg)
            stream.abort()
            break
        results[index].add(msg)
        if not started[index]:
            started[index] = True
            yield chunk(index, {"role": "assistant", "content": ""})
        if msg.text or (want_lp and msg.logprobs):
            yield chunk(index, {"content": msg.text}, logprobs=_chat_logprobs(msg.logprobs or []) if want_lp else None)
        if msg.finished:
            yield chunk(index, {}, msg.finish_reason, stop_reason=msg.matched_stop)
    else:
        if include_usage:
            yield out.usage(_usage(results, len(results)))
    yield "data: [DONE]\n\n"


class _ChunkWriter:
    """SSE `data:` lines of one streamed response: every chunk shares id, object, created, model."""

    def __init__(self, rid: str, obj: str, model: str, include_usage: bool) -> None:
        self.head = {"id": rid, "object": obj, "created": int(time.time()), "model": model}
        self.include_usage = include_usage

    def choice(self, choice: Dict[str, Any]) -> str:
        obj: Dict[str, Any] = {**self.head, "choices": [choice]}
        if self.include_usage:
            obj["usage"] = None  # OpenAI sends usage: null on every chunk but the last
        return _data(obj)

    def usage(self, usage: Dict[str, Any]) -> str:
        return _data({**self.head, "choices": [], "usage": usage})


async def _completion_stream(
    stream: RequestStream, first: Tuple[int, Any], rid: str, model: str, include_usage: bool, n: int, want_lp: bool
) -> AsyncIterator[str]:
    out = _ChunkWriter(rid, "text_completion", model, include_usage)
    results = [_Result() for _ in stream.uids]
    offsets = [0] * len(results)

    def chunk(index: int, text: str, finish: str | None = None, logprobs: Any = None, **extra: Any) -> str:
        return out.choice({"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish, **extra})

    async for index, msg in _events(stream, first):
        if isinstance(msg, ErrorMsg):
            yield _stream_error(msg)
            stream.abort()
            break
        results[index].add(msg)
        if msg.text or msg.finished or (want_lp and msg.logprobs):
            lp = _completion_logprobs(msg.logprobs or [], offsets[index]) if want_lp else None
            offsets[index] += len(msg.text)
            extra = {"stop_reason": msg.matched_stop} if msg.finished else {}
            yield chunk(index, msg.text, msg.finish_reason if msg.finished else None, lp, **extra)
    else:
        if include_usage:
            yield out.usage(_usage(results, n))
    yield "data: [DONE]\n\n"


def _finish_info(r: _Result) -> Dict[str, Any] | None:
    if r.finish_reason is None:
        return None
    if r.finish_reason == "length":
        return {"type": "length", "length": r.completion_tokens}
    if r.finish_reason == "stop":
        return {"type": "stop", "matched": r.matched_stop}
    return {"type": r.finish_reason}


def _generate_item(r: _Result, rid: str, want_lp: bool) -> Dict[str, Any]:
    meta: Dict[str, Any] = {
        "id": rid,
        "finish_reason": _finish_info(r),
        "prompt_tokens": r.prompt_tokens,
        "completion_tokens": r.completion_tokens,
        "cached_tokens": r.cached_tokens,
    }
    if want_lp:
        meta["output_token_logprobs"] = [[e[1], e[3], e[0]] for e in r.logprobs]
        meta["output_top_logprobs"] = [[[l, None, t] for t, l in e[2]] for e in r.logprobs]
    return {"text": "".join(r.text), "output_ids": list(r.token_ids), "meta_info": meta}


async def _generate_stream(stream: RequestStream, first: Tuple[int, Any], rid: str, want_lp: bool) -> AsyncIterator[str]:
    results = [_Result() for _ in stream.uids]
    async for index, msg in _events(stream, first):
        if isinstance(msg, ErrorMsg):
            yield _stream_error(msg)
            stream.abort()
            break
        results[index].add(msg)
        item = _generate_item(results[index], f"{rid}-{index}", want_lp)
        item["index"] = index
        yield _data(item)
    yield "data: [DONE]\n\n"
