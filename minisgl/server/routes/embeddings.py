"""POST /v1/embeddings: one pooled vector per input, on a server that runs the embed task.

Each input is one scheduler request that is prefilled and never decoded (its pooling happens on
the device, engine/pooling.py); the vectors come back with the requests' final replies."""

from __future__ import annotations

from typing import Any, Dict, List, Union

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from minisgl.message import TokenizeMsg
from minisgl.sampling_params import InvalidRequest, SamplingParams, check_token_ids
from minisgl.server.embeddings_protocol import EmbeddingRequest, encode_vector
from minisgl.server.routes.common import (
    APIError,
    GuardedRoute,
    ServerState,
    check_model,
    collect,
    get_state,
    need_tokenizer,
    read_body,
    require_api_key,
    submit,
)

router = APIRouter(route_class=GuardedRoute, dependencies=[Depends(require_api_key)])


@router.post("/v1/embeddings")
async def embeddings(request: Request) -> Response:
    state = get_state(request)
    if state.task != "embed":
        raise APIError(
            400,
            "this server runs the generate task: start it with --task embed (or serve an embedding checkpoint) to serve /v1/embeddings",
            code="wrong_task",
        )
    body: EmbeddingRequest = await read_body(request, EmbeddingRequest)
    check_model(state, body.model)
    try:
        inputs = body.inputs()
    except ValueError as exc:
        raise APIError(400, str(exc), param="input") from None
    _check_inputs(state, inputs)
    dimensions = _check_dimensions(state, body.dimensions)
    frontend = state.frontend
    msgs = [
        TokenizeMsg(
            uid=frontend.new_uid(),
            text=item if isinstance(item, str) else None,
            input_ids=None if isinstance(item, str) else list(item),
            sampling=SamplingParams(max_tokens=1),  # prefill only: the embed task never samples
        )
        for item in inputs
    ]
    stream = submit(frontend, msgs, f"{request.method} {request.url.path}")
    try:
        results = await collect(request, stream)
    except APIError as exc:
        stream.abort()
        if exc.param == "prompt":  # the tokenizer worker's and the scheduler's name for it
            exc.param = "input"
        raise
    except BaseException:
        stream.abort()
        raise
    data: List[Dict[str, Any]] = []
    for i, r in enumerate(results):
        if r.embedding is None:
            raise APIError(500, "the scheduler finished an embedding request without its vector")
        data.append({"object": "embedding", "index": i, "embedding": encode_vector(r.embedding, dimensions, body.encoding_format)})
    tokens = sum(r.prompt_tokens for r in results)
    return JSONResponse(
        {"object": "list", "data": data, "model": state.model_name, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
    )


def _check_inputs(state: ServerState, inputs: List[Union[str, List[int]]]) -> None:
    """Sizes and token ids before anything is tokenized: each input must fit the context."""
    for item in inputs:
        try:
            if isinstance(item, str):
                need_tokenizer(state, "a text input (send token ids: a list of ints or a list of lists)", "input")
                state.limits.check_prompt_text(len(item.encode("utf-8")), "input")
            else:
                check_token_ids(item, state.limits.vocab_size, "input")
                state.limits.check_prompt_ids(item, "input")
        except InvalidRequest as exc:
            raise APIError.from_invalid(exc) from None


def _check_dimensions(state: ServerState, dimensions: int | None) -> int | None:
    """`dimensions` truncates the vector only where the checkpoint declares Matryoshka training."""
    if dimensions is None:
        return None
    allowed = state.info.get("matryoshka_dimensions")
    size = int(state.info.get("hidden_size") or 0)
    if allowed is None:
        raise APIError(
            400,
            "this model does not support 'dimensions': its config declares no Matryoshka sizes "
            "(matryoshka_dimensions or is_matryoshka in config.json), so a truncated vector would mean nothing",
            param="dimensions",
            code="unsupported_parameter",
        )
    if (allowed and dimensions not in allowed) or not 1 <= dimensions <= size:
        sizes = ", ".join(map(str, allowed)) if allowed else f"1 to {size}"
        raise APIError(400, f"dimensions must be one of this model's Matryoshka sizes ({sizes}), got {dimensions}", param="dimensions")
    return dimensions
