"""Health, metrics, models, server info and the cache flush.

`/health` and `/metrics` answer without the API key (load balancers and Prometheus probe them);
everything else here needs it when the server has one.
"""

from __future__ import annotations

import asyncio
from typing import Any, Dict

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from minisgl.server.frontend import Unavailable
from minisgl.server.metrics import CONTENT_TYPE
from minisgl.server.routes.common import APIError, GuardedRoute, check_model, get_state, require_api_key

open_router = APIRouter(route_class=GuardedRoute)
router = APIRouter(route_class=GuardedRoute, dependencies=[Depends(require_api_key)])


@open_router.api_route("/health", methods=["GET", "HEAD"])
async def health(request: Request) -> Response:
    state = get_state(request)
    if not state.healthy():
        return JSONResponse({"status": "unhealthy", "reason": state.frontend.failure}, status_code=503)
    return JSONResponse({"status": "ok"})


@open_router.get("/version")
async def version() -> Dict[str, Any]:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as package_version

    try:
        return {"version": package_version("minisgl")}
    except PackageNotFoundError:
        return {"version": "unknown"}


@open_router.get("/metrics")
async def prometheus_metrics(request: Request) -> Response:
    return Response(get_state(request).metrics.render(), media_type=CONTENT_TYPE)


@router.get("/v1/models")
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


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request) -> Dict[str, Any]:
    state = get_state(request)
    check_model(state, model_id)
    return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "minisgl"}


@router.get("/server_info")
async def server_info(request: Request) -> Dict[str, Any]:
    state = get_state(request)
    stats = state.frontend.stats
    return {
        "model": state.model_name,
        "model_path": state.args.model_path,
        "scheduler": state.info,
        "limits": state.limits.__dict__,
        "stats": None if stats is None else {k: getattr(stats, k) for k in stats.__dataclass_fields__},
        "requests_in_flight": state.frontend.num_in_flight,
    }


@router.post("/flush_cache")
async def flush_cache(request: Request) -> Dict[str, Any]:
    try:
        done = await get_state(request).frontend.flush_cache()
    except Unavailable as exc:
        raise APIError(503, f"the server cannot take requests: {exc}", code="server_unavailable") from None
    except asyncio.TimeoutError:
        raise APIError(504, "the scheduler did not answer the flush in time", code="timeout") from None
    if not done.flushed:
        raise APIError(409, "the prefix cache was not flushed: requests are running; retry when the server is idle", code="server_busy")
    return {"status": "ok", "freed_pages": done.freed_pages}
