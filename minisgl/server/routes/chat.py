"""POST /v1/chat/completions: the tokenizer's chat template renders `messages`."""

from __future__ import annotations

import time
import uuid
from typing import Any, AsyncIterator, Dict, List

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from minisgl.message import ErrorMsg, TokenizeMsg
from minisgl.server.frontend import RequestStream
from minisgl.server.protocol import UNSUPPORTED_CHAT_FIELDS, ChatCompletionRequest
from minisgl.server.routes.common import (
    APIError,
    ChunkWriter,
    Event,
    GuardedRoute,
    Result,
    check_model,
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


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    state = get_state(request)
    body: ChatCompletionRequest = await read_body(request, ChatCompletionRequest, UNSUPPORTED_CHAT_FIELDS)
    check_model(state, body.model)
    try:
        messages = [m.to_template() for m in body.messages]
    except ValueError as exc:
        raise APIError(400, str(exc), param="messages") from None
    state.limits.check_prompt_text(sum(len(m["content"].encode("utf-8")) for m in messages), "messages")
    k = body.logprobs_k()
    max_tokens = body.effective_max_tokens()
    params = validated(body.sampling_params(max_tokens, k), state.limits, {"max_tokens": body.max_tokens_param()})
    stops = body.stop_list()
    msgs = [
        TokenizeMsg(
            uid=state.frontend.new_uid(),
            messages=messages,
            sampling=params.for_choice(i),
            max_tokens_explicit=max_tokens is not None,
            stop=stops,
            include_stop_str=body.include_stop_str_in_output,
            want_logprobs=k is not None,
            skip_special_tokens=body.skip_special_tokens,
            chat_template_kwargs=body.chat_template_kwargs,
        )
        for i in range(body.n)
    ]
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    want_lp = k is not None
    return await respond(
        request,
        msgs,
        body.stream,
        lambda rs, first: _chat_stream(rs, first, rid, state.model_name, include_usage, want_lp),
        lambda results: _chat_response(results, rid, state.model_name, want_lp),
    )


def _chat_logprobs(entries: List[List[Any]]) -> Dict[str, Any]:
    return {
        "content": [
            {
                "token": tok,
                "logprob": lp,
                "bytes": list(tok.encode("utf-8")),
                "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode("utf-8"))} for t, v in tops],
            }
            for tok, lp, tops, _ in entries
        ]
    }


def _chat_response(results: List[Result], rid: str, model: str, want_lp: bool) -> Dict[str, Any]:
    choices = [
        {
            "index": i,
            "message": {"role": "assistant", "content": "".join(r.text)},
            "logprobs": _chat_logprobs(r.logprobs) if want_lp else None,
            "finish_reason": r.finish_reason,
            "stop_reason": r.matched_stop,
        }
        for i, r in enumerate(results)
    ]
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage(results, len(results)),
    }


async def _chat_stream(
    stream: RequestStream, first: Event, rid: str, model: str, include_usage: bool, want_lp: bool
) -> AsyncIterator[str]:
    out = ChunkWriter(rid, "chat.completion.chunk", model, include_usage)
    results = [Result() for _ in stream.uids]
    started = [False] * len(results)

    def chunk(index: int, delta: Dict[str, Any], finish: str | None = None, logprobs: Any = None, **extra: Any) -> str:
        return out.choice({"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish, **extra})

    async for index, msg in events(stream, first):
        if isinstance(msg, ErrorMsg):
            yield stream_error(msg)
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
            yield out.usage(usage(results, len(results)))
    yield "data: [DONE]\n\n"
