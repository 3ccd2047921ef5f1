"""POST /v1/completions: `prompt` is a string, a list of strings, token ids, or a list of them."""

from __future__ import annotations

import time
import uuid
from typing import Any, AsyncIterator, Dict, List

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from minisgl.message import ErrorMsg, TokenizeMsg
from minisgl.server.frontend import RequestStream
from minisgl.server.protocol import MAX_CHOICES, UNSUPPORTED_COMPLETION_FIELDS, CompletionRequest
from minisgl.server.routes.common import (
    APIError,
    ChunkWriter,
    Event,
    GuardedRoute,
    Result,
    check_model,
    check_prompts,
    events,
    get_state,
    read_body,
    require_api_key,
    respond,
    stream_error,
    usage,
    validated,
)

router = APIRouter(route_class=GuardedRoute, dependencies=[Depends(require_api_key)])

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    state = get_state(request)
    body: CompletionRequest = await read_body(request, CompletionRequest, UNSUPPORTED_COMPLETION_FIELDS)
    check_model(state, body.model)
    try:
        prompts = body.prompts()
    except ValueError as exc:
        raise APIError(400, str(exc), param="prompt") from None
    if len(prompts) * body.n > MAX_CHOICES:
        raise APIError(400, f"too many choices: {len(prompts)} prompts x n={body.n} > {MAX_CHOICES}", param="n")
    check_prompts(prompts, state.limits, "prompt")
    max_tokens = body.max_tokens if body.max_tokens is not None else DEFAULT_MAX_TOKENS
    k = body.logprobs
    params = validated(body.sampling_params(max_tokens, k), state.limits)
    stops = body.stop_list()
    msgs = [
        TokenizeMsg(
            uid=state.frontend.new_uid(),
            text=prompt if isinstance(prompt, str) else None,
            input_ids=prompt if not isinstance(prompt, str) else None,
            sampling=params.for_choice(i),
            max_tokens_explicit=body.max_tokens is not None,
            stop=stops,
            include_stop_str=body.include_stop_str_in_output,
            want_logprobs=k is not None,
            skip_special_tokens=body.skip_special_tokens,
        )
        for prompt in prompts
        for i in range(body.n)
    ]
    rid = f"cmpl-{uuid.uuid4().hex}"
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    want_lp = k is not None
    return await respond(
        request,
        msgs,
        body.stream,
        lambda rs, first: _completion_stream(rs, first, rid, state.model_name, include_usage, body.n, want_lp),
        lambda results: _completion_response(results, rid, state.model_name, body.n, want_lp),
    )


def _completion_logprobs(entries: List[List[Any]], start_offset: int = 0) -> Dict[str, Any]:
    offsets, pos = [], start_offset
    for tok, *_ in entries:
        offsets.append(pos)
        pos += len(tok)
    return {
        "tokens": [e[0] for e in entries],
        "token_logprobs": [e[1] for e in entries],
        "top_logprobs": [{t: v for t, v in e[2]} for e in entries],
        "text_offset": offsets,
    }


def _completion_response(results: List[Result], rid: str, model: str, n: int, want_lp: bool) -> Dict[str, Any]:
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
        "usage": usage(results, n),
    }


async def _completion_stream(
    stream: RequestStream, first: Event, rid: str, model: str, include_usage: bool, n: int, want_lp: bool
) -> AsyncIterator[str]:
    out = ChunkWriter(rid, "text_completion", model, include_usage)
    results = [Result() for _ in stream.uids]
    offsets = [0] * len(results)

    def chunk(index: int, text: str, finish: str | None = None, logprobs: Any = None, **extra: Any) -> str:
        return out.choice({"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish, **extra})

    async for index, msg in events(stream, first):
        if isinstance(msg, ErrorMsg):
            yield stream_error(msg)
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
            yield out.usage(usage(results, n))
    yield "data: [DONE]\n\n"
