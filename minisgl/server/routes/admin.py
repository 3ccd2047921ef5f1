"""Health, metrics, models, server and tokenizer info, and the cache flush.

`/health` and `/metrics` answer without the API key (load balancers and Prometheus probe them);
everything else here needs it when the server has one. Every GET route also answers HEAD (the
same status and headers, no body; the same auth). Every route that changes state depends on
`require_same_site` (no cross-site 'simple' POSTs).
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, Dict, List, Optional

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from minisgl.message import ErrorMsg
from minisgl.sampling_params import InvalidRequest, check_token_ids
from minisgl.server.frontend import Unavailable
from minisgl.server.metrics import CONTENT_TYPE
from minisgl.server.protocol import ChatMessage, TokenId
from minisgl.server.protocol import _Base as _Strict
from minisgl.server.routes.common import (
    APIError,
    GuardedRoute,
    check_model,
    get_state,
    has_body,
    need_tokenizer,
    read_body,
    require_api_key,
    require_same_site,
)

open_router = APIRouter(route_class=GuardedRoute)
router = APIRouter(route_class=GuardedRoute, dependencies=[Depends(require_api_key)])


@open_router.api_route("/health", methods=["GET", "HEAD"])
async def health(request: Request) -> Response:
    """Readiness: 200 while the server takes requests; 503 once a worker died, and while draining
    on SIGTERM (a router or Kubernetes then stops sending here while running requests finish)."""
    state = get_state(request)
    if not state.healthy():
        return JSONResponse({"status": "unhealthy", "reason": state.frontend.failure}, status_code=503)
    if state.frontend.draining:
        return JSONResponse({"status": "draining", "reason": "the server is shutting down"}, status_code=503)
    return JSONResponse({"status": "ok"})


@open_router.api_route("/version", methods=["GET", "HEAD"])
async def version() -> Dict[str, Any]:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as package_version

    try:
        return {"version": package_version("minisgl")}
    except PackageNotFoundError:
        return {"version": "unknown"}


@open_router.api_route("/metrics", methods=["GET", "HEAD"])
async def prometheus_metrics(request: Request) -> Response:
    return Response(get_state(request).metrics.render(), media_type=CONTENT_TYPE)


@router.api_route("/v1/models", methods=["GET", "HEAD"])
async def list_models(request: Request) -> Dict[str, Any]:
    state = get_state(request)
    return {
        "object": "list",
        "data": [
            {
                "id": state.model_name,
                "object": "model",
                "created": state.created,
                "owned_by": "minisgl",
                "root": state.args.model_path,
                "max_model_len": state.info.get("max_seq_len"),
            }
        ],
    }


@router.api_route("/v1/models/{model_id:path}", methods=["GET", "HEAD"])
async def get_model(model_id: str, request: Request) -> Dict[str, Any]:
    state = get_state(request)
    check_model(state, model_id)
    return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "minisgl"}


@router.api_route("/tokenizer_info", methods=["GET", "HEAD"])
async def tokenizer_info(request: Request) -> Dict[str, Any]:
    """The served tokenizer, as vLLM's /tokenizer_info: class, vocabulary size, special tokens,
    chat template (`minisgl.tokenizer.worker.describe_tokenizer`), and this server's context."""
    state = get_state(request)
    need_tokenizer(state, "/tokenizer_info")
    return {**(state.tokenizer_description or {}), "model": state.model_name, "max_model_len": state.info.get("max_seq_len")}


@router.api_route("/server_info", methods=["GET", "HEAD"])
async def server_info(request: Request) -> Dict[str, Any]:
    state = get_state(request)
    stats = state.frontend.stats
    stats_dict = (
        None if stats is None else {**dataclasses.asdict(stats), "kv_usage": stats.kv_usage, "cache_hit_rate": stats.cache_hit_rate}
    )
    return {
        "model": state.model_name,
        "model_path": state.args.model_path,
        "tokenizer_path": state.args.tokenizer_path,
        "skip_tokenizer_init": state.args.skip_tokenizer_init,
        "scheduler": state.info,
        "limits": state.limits.__dict__,
        "stats": stats_dict,
        "requests_in_flight": state.frontend.num_in_flight,
    }


class FlushCacheRequest(_Strict):
    """No fields: a body, when sent, is `{}` (anything else is refused, never ignored)."""


@router.post("/flush_cache", dependencies=[Depends(require_same_site)])
async def flush_cache(request: Request) -> Dict[str, Any]:
    if has_body(request):
        await read_body(request, FlushCacheRequest)
    try:
        done = await get_state(request).frontend.flush_cache()
    except Unavailable as exc:
        raise APIError(503, f"the server cannot take requests: {exc}", code="server_unavailable") from None
    except asyncio.TimeoutError:
        raise APIError(504, "the scheduler did not answer the flush in time", code="timeout") from None
    if not done.flushed:
        raise APIError(409, "the prefix cache was not flushed: requests are running; retry when the server is idle", code="server_busy")
    return {"status": "ok", "freed_pages": done.freed_pages}


class TokenizeRequest(_Strict):
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[List[ChatMessage]] = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Strict):
    model: Optional[str] = None
    tokens: List[TokenId]


@router.post("/tokenize")
async def tokenize(request: Request) -> Dict[str, Any]:
    """vLLM's /tokenize: a prompt, or chat messages through the chat template."""
    state = get_state(request)
    body: TokenizeRequest = await read_body(request, TokenizeRequest)
    check_model(state, body.model)
    need_tokenizer(state, "/tokenize")
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give exactly one of prompt or messages", param="prompt")
    try:
        messages = [m.to_template() for m in body.messages] if body.messages is not None else None
    except ValueError as exc:  # a content part that is not text
        raise APIError(400, str(exc), param="messages") from None
    size = len((body.prompt or "").encode("utf-8")) + sum(len(str(m["content"]).encode("utf-8")) for m in messages or [])
    state.limits.check_prompt_text(size, "prompt" if messages is None else "messages")
    reply = await _tool_call(state, text=body.prompt, messages=messages, add_special_tokens=body.add_special_tokens,
                             add_generation_prompt=body.add_generation_prompt)  # fmt: skip
    ids = reply.token_ids or []
    return {"count": len(ids), "max_model_len": state.info.get("max_seq_len"), "tokens": ids}


@router.post("/detokenize")
async def detokenize(request: Request) -> Dict[str, Any]:
    state = get_state(request)
    body: DetokenizeRequest = await read_body(request, DetokenizeRequest)
    check_model(state, body.model)
    need_tokenizer(state, "/detokenize")
    try:
        check_token_ids(body.tokens, state.limits.vocab_size, "tokens", allow_empty=True)
        state.limits.check_prompt_ids(body.tokens, "tokens")
    except InvalidRequest as exc:
        raise APIError.from_invalid(exc) from None
    reply = await _tool_call(state, token_ids=list(body.tokens))
    return {"prompt": reply.text or ""}


async def _tool_call(state: Any, **fields: Any) -> Any:
    try:
        reply = await state.frontend.tokenize(**fields)
    except Unavailable as exc:
        raise APIError(503, f"the server cannot take requests: {exc}", code="server_unavailable") from None
    except asyncio.TimeoutError:
        raise APIError(504, "the tokenizer worker did not answer in time", code="timeout") from None
    if isinstance(reply, ErrorMsg):
        raise APIError.from_msg(reply)
    return reply
