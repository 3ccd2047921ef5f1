"""The OpenAI-compatible HTTP API (FastAPI), running in the server's main process.

Endpoints live in `minisgl.server.routes` by family (chat, completions, native /generate, admin);
this module puts them together with the error handlers. Request bodies are read by hand, not by
FastAPI (`routes.common.read_body`): 415 unless declared JSON, 413 beyond `--max-request-bytes`
(by Content-Length, and while a chunked body streams in) before any parsing, 400 for malformed,
too deep or invalid JSON and for schema violations, each an OpenAI-style error
`{"error": {"message", "type", "param", "code"}}`. Errors found by the tokenizer worker or the
scheduler come back as ErrorMsg and become the same errors. A client that disconnects, before or
during its stream, has its request aborted.
"""

from __future__ import annotations

from typing import Any, Dict

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from minisgl.server.args import ServerArgs
from minisgl.server.frontend import Frontend
from minisgl.server.metrics import ServerMetrics
from minisgl.server.request_id import RequestIdMiddleware
from minisgl.server.routes import admin, chat, completions, embeddings, loads, native, responses
from minisgl.server.routes.common import (
    APIError,
    ServerState,
    error_body,
    error_response,
    internal_error_response,
    validation_error,
)
from minisgl.server.tracing import Tracing, TracingMiddleware

# re-exported for callers that build error bodies (the shell, tests)
__all__ = ["APIError", "ServerState", "create_app", "error_body"]


def create_app(
    args: ServerArgs,
    info: Dict[str, Any],
    frontend: Frontend,
    metrics: ServerMetrics,
    lifespan: Any = None,
    tokenizer_info: Dict[str, Any] | None = None,
    tracing: Tracing | None = None,
) -> FastAPI:
    app = FastAPI(title="minisgl", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.minisgl = ServerState(args, info, frontend, metrics, tokenizer_info or {})

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return JSONResponse(error_body(exc.status_code, str(exc.detail), code=code), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        return internal_error_response(request, exc)

    if args.allowed_origins:
        # Off by default: a browser page may then call this server only from these origins
        # (preflighted requests; the JSON-only rule still stops 'simple' cross-site POSTs).
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(
            CORSMiddleware,
            allow_origins=args.allowed_origins,
            allow_methods=["GET", "POST", "HEAD", "OPTIONS"],
            allow_headers=["Authorization", "Content-Type"],
            max_age=600,
        )
    if tracing is not None:  # --otlp-traces-endpoint: inside the id's middleware, so the span names the id
        app.add_middleware(TracingMiddleware, tracing=tracing)
    # outermost (added last): the id is on every response, CORS preflights and 500s included
    app.add_middleware(RequestIdMiddleware)
    for module in (admin, chat, completions, native, responses, embeddings):
        app.include_router(module.router)
    app.include_router(admin.open_router)
    app.include_router(loads.router)
    return app
