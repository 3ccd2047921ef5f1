"""POST /generate: SGLang's native API, with the same limits and checks as /v1."""

from __future__ import annotations

import uuid
from typing import Any, AsyncIterator, Dict, List

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from minisgl.message import ErrorMsg
from minisgl.server.frontend import RequestStream
from minisgl.server.protocol import MAX_CHOICES, GenerateRequest
from minisgl.server.routes.common import (
    APIError,
    Event,
    GuardedRoute,
    Result,
    check_prompts,
    data_line,
    events,
    get_state,
    need_tokenizer,
    prompt_messages,
    read_body,
    require_api_key,
    require_generate_task,
    respond,
    stream_error,
    validated,
)

router = APIRouter(route_class=GuardedRoute, dependencies=[Depends(require_api_key)])

# SamplingParams fields under the names /generate's clients send
_RENAME = {
    "max_tokens": "sampling_params.max_new_tokens",
    "temperature": "sampling_params.temperature",
    "top_k": "sampling_params.top_k",
    "top_p": "sampling_params.top_p",
    "min_p": "sampling_params.min_p",
    "stop_token_ids": "sampling_params.stop_token_ids",
    "seed": "sampling_params.seed",
    "logprobs": "top_logprobs_num",
    "logit_bias": "sampling_params.logit_bias",
    "min_tokens": "sampling_params.min_new_tokens",
    "response_format": "sampling_params",
}


@router.post("/generate")
async def generate(request: Request) -> Response:
    state = get_state(request)
    require_generate_task(state)
    body: GenerateRequest = await read_body(request, GenerateRequest)
    param = "text" if body.text is not None else "input_ids"
    try:
        prompts = body.prompts()
    except ValueError as exc:
        raise APIError(400, "no prompt given", param=param) from exc
    sp = body.sampling_params
    if state.skip_tokenizer:  # refuse (never ignore) what needs text
        if body.text is not None:
            need_tokenizer(state, "text (send input_ids)", "text")
        if sp.stop_list():
            need_tokenizer(state, "sampling_params.stop (stop strings are matched on text; stop_token_ids works)", "sampling_params.stop")
        if body.return_logprob:
            need_tokenizer(state, "return_logprob (it returns token texts)", "return_logprob")
        grammar = sp.grammar()
        if grammar is not None:
            need_tokenizer(state, "a grammar (json_schema, regex, ebnf)", grammar.param)
    if len(prompts) * sp.n > MAX_CHOICES:
        raise APIError(400, f"too many choices: {len(prompts)} prompts x n={sp.n} > {MAX_CHOICES}", param="sampling_params.n")
    check_prompts(prompts, state.limits, param)
    k = body.top_logprobs_num if body.return_logprob else None
    params = sp.sampling_params(k)
    start = body.logprob_start_len if body.return_logprob else -1
    if start >= 0:
        params.prompt_logprobs = body.top_logprobs_num
    params = validated(params, state.limits, _RENAME)
    msgs = prompt_messages(
        state.frontend, prompts, sp.n, params, max_tokens_explicit=sp.max_new_tokens is not None,
        want_logprobs=k is not None, skip_special_tokens=sp.skip_special_tokens,
    )  # fmt: skip
    rid = uuid.uuid4().hex
    want_lp = k is not None
    batched = body.batched

    def render(results: List[Result]) -> Any:
        out = [_generate_item(r, f"{rid}-{i}", want_lp, start) for i, r in enumerate(results)]
        return out if batched or len(out) > 1 else out[0]

    return await respond(
        request, msgs, body.stream, lambda rs, first: _generate_stream(rs, first, rid, want_lp, start), render, choices=sp.n
    )


def _finish_info(r: Result) -> Dict[str, Any] | None:
    if r.finish_reason is None:
        return None
    if r.finish_reason == "length":
        return {"type": "length", "length": r.completion_tokens}
    if r.finish_reason == "stop":
        return {"type": "stop", "matched": r.matched_stop}
    return {"type": r.finish_reason}


def _generate_item(r: Result, rid: str, want_lp: bool, logprob_start: int = -1) -> Dict[str, Any]:
    meta: Dict[str, Any] = {
        "id": rid,
        "finish_reason": _finish_info(r),
        "prompt_tokens": r.prompt_tokens,
        "completion_tokens": r.completion_tokens,
        "cached_tokens": r.cached_tokens,
    }
    if want_lp:
        meta["output_token_logprobs"] = [[e[1], e[3], e[0]] for e in r.logprobs]
        meta["output_top_logprobs"] = [[[v, None, t] for t, v in e[2]] for e in r.logprobs]
    if want_lp and logprob_start >= 0 and r.prompt_logprobs is not None:
        entries = r.prompt_logprobs[logprob_start:]
        meta["input_token_logprobs"] = [[e[1], e[3], e[0]] for e in entries]
        meta["input_top_logprobs"] = [[[v, None, t] for t, v in e[2]] if e[1] is not None else None for e in entries]
    return {"text": "".join(r.text), "output_ids": list(r.token_ids), "meta_info": meta}


async def _generate_stream(stream: RequestStream, first: Event, rid: str, want_lp: bool, logprob_start: int = -1) -> AsyncIterator[str]:
    results = [Result() for _ in stream.uids]
    async for index, msg in events(stream, first):
        if isinstance(msg, ErrorMsg):
            yield stream_error(msg)
            stream.abort()
            break
        results[index].add(msg)
        item = _generate_item(results[index], f"{rid}-{index}", want_lp, logprob_start)
        item["index"] = index
        yield data_line(item)
    yield "data: [DONE]\n\n"
