"""`GET /loads` and `GET /v1/loads`: this worker's load as SGLang reports it, for routers.

SMG (the Shepherd Model Gateway, formerly sglang-router) polls these paths for its load-aware
policies (least_load, power_of_two, overload protection) and reads `loads[i]` per data-parallel
rank; minisgl has one rank. The fields are SGLang's; counts of tokens are KV pages times the page
size. Open like /metrics: a router probes it without the API key.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, Dict

from fastapi import APIRouter, Request

from minisgl.server.routes.common import GuardedRoute, get_state

router = APIRouter(route_class=GuardedRoute)


def worker_load(state: Any) -> Dict[str, Any]:
    """One rank's load; zeros until the scheduler's first stats arrive."""
    stats = state.frontend.stats
    page_size = int(state.info.get("page_size") or 1)
    total_pages = stats.total_pages if stats is not None else int(state.info.get("num_pages") or 0)
    max_running = int(state.info.get("max_running_req") or 0)
    running = stats.num_running if stats is not None else 0
    waiting = stats.num_waiting if stats is not None else 0
    used_pages = total_pages - stats.free_pages if stats is not None else 0
    return {
        "dp_rank": 0,
        "num_running_reqs": running,
        "num_waiting_reqs": waiting,
        "num_total_reqs": running + waiting,
        "num_used_tokens": used_pages * page_size,
        "max_total_num_tokens": total_pages * page_size,
        "token_usage": stats.kv_usage if stats is not None else 0.0,
        "gen_throughput": stats.gen_throughput if stats is not None else 0.0,
        "cache_hit_rate": stats.cache_hit_rate if stats is not None else 0.0,
        "utilization": running / max_running if max_running else 0.0,
        "max_running_requests": max_running,
    }


@router.api_route("/loads", methods=["GET", "HEAD"])
@router.api_route("/v1/loads", methods=["GET", "HEAD"])
async def loads(request: Request) -> Dict[str, Any]:
    state = get_state(request)
    return {
        "timestamp": datetime.now(timezone.utc).isoformat(),
        "model": state.model_name,
        "dp_rank_count": 1,
        "loads": [worker_load(state)],
    }
