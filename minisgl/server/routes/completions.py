"""POST /v1/completions: `prompt` is a string, a list of strings, token ids, or a list of them."""

from __future__ import annotations

import time
import uuid
from typing import Any, AsyncIterator, Dict, List

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from minisgl.message import ErrorMsg
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
    log_ignored,
    need_tokenizer,
    prompt_messages,
    read_body,
    require_api_key,
    require_generate_task,
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
    require_generate_task(state)
    body: CompletionRequest = await read_body(request, CompletionRequest, UNSUPPORTED_COMPLETION_FIELDS)
    log_ignored(request, body)
    check_model(state, body.model)
    try:
        prompts = body.prompts()
    except ValueError as exc:
        raise APIError(400, str(exc), param="prompt") from None
    if len(prompts) * body.n > MAX_CHOICES:
        raise APIError(400, f"too many choices: {len(prompts)} prompts x n={body.n} > {MAX_CHOICES}", param="n")
    if state.skip_tokenizer:
        _check_token_only(state, body, prompts)
    check_prompts(prompts, state.limits, "prompt")
    max_tokens = body.max_tokens if body.max_tokens is not None else DEFAULT_MAX_TOKENS
    if max_tokens == 0 and not body.echo:
        raise APIError(400, "max_tokens must be at least 1 (0 only with echo)", param="max_tokens")
    # max_tokens=0 with echo scores the prompt: one token is generated and not returned
    score_only = max_tokens == 0
    k = body.logprobs
    params = body.sampling_params(max(max_tokens, 1), k)
    if body.echo and (k is not None or any(not isinstance(p, str) for p in prompts)):
        params.prompt_logprobs = k or 0  # the prompt's logprobs (and its token texts) come from prefill
    params = validated(params, state.limits)
    msgs = prompt_messages(
        state.frontend, prompts, body.n, params, max_tokens_explicit=body.max_tokens is not None,
        want_logprobs=k is not None, skip_special_tokens=body.skip_special_tokens,
    )  # fmt: skip
    rid = f"cmpl-{uuid.uuid4().hex}"
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    continuous_usage = bool(body.stream_options and body.stream_options.continuous_usage_stats)
    want_lp = k is not None
    echo = [p if isinstance(p, str) else None for p in prompts for _ in range(body.n)] if body.echo else None
    want_ids = body.return_token_ids or state.skip_tokenizer  # without a tokenizer, ids are the output
    return await respond(
        request,
        msgs,
        body.stream,
        lambda rs, first: _completion_stream(
            rs, first, rid, state.model_name, include_usage, body.n, want_lp, echo, score_only, want_ids, continuous_usage
        ),
        lambda results: _completion_response(results, rid, state.model_name, body.n, want_lp, echo, score_only, want_ids),
        choices=body.n,
    )


def _check_token_only(state: Any, body: CompletionRequest, prompts: List[Any]) -> None:
    """--skip-tokenizer-init: refuse (never ignore) what needs text."""
    if any(isinstance(p, str) for p in prompts):
        need_tokenizer(state, "a text prompt (send token ids: a list of ints or a list of lists)", "prompt")
    if body.stop_list():
        need_tokenizer(state, "stop (stop strings are matched on text; stop_token_ids works)", "stop")
    if body.logprobs is not None:
        need_tokenizer(state, "logprobs (they return token texts)", "logprobs")
    if body.echo:
        need_tokenizer(state, "echo", "echo")
    grammar = body.grammar()
    if grammar is not None:
        need_tokenizer(state, f"{grammar.param} (grammars are compiled against the vocabulary's texts)", grammar.param)


def _echo_prefix(r: Result, prompt: str | None, want_lp: bool) -> tuple[str, List[List[Any]]]:
    """The prompt as echo returns it: its text, and its tokens' logprobs (the first has none)."""
    entries = [[e[0], e[1], e[2] if e[1] is not None else [], e[3]] for e in (r.prompt_logprobs or [])]
    text = prompt if prompt is not None else "".join(e[0] for e in entries)
    return text, entries if want_lp else []


def _choice_text_and_logprobs(
    r: Result, index: int, want_lp: bool, echo: List[str | None] | None, score_only: bool
) -> tuple[str, List[List[Any]]]:
    text = "" if score_only else "".join(r.text)
    entries = [] if score_only or not want_lp else list(r.logprobs)
    if echo is not None:
        head, head_lp = _echo_prefix(r, echo[index], want_lp)
        text, entries = head + text, head_lp + entries
    return text, entries


def _completion_logprobs(entries: List[List[Any]], start_offset: int = 0) -> Dict[str, Any]:
    offsets, pos = [], start_offset
    for tok, *_ in entries:
        offsets.append(pos)
        pos += len(tok)
    return {
        "tokens": [e[0] for e in entries],
        "token_logprobs": [e[1] for e in entries],
        "top_logprobs": [{t: v for t, v in e[2]} if e[1] is not None else None for e in entries],
        "text_offset": offsets,
    }


def _completion_response(
    results: List[Result],
    rid: str,
    model: str,
    n: int,
    want_lp: bool,
    echo: List[str | None] | None,
    score_only: bool,
    want_ids: bool = False,
) -> Dict[str, Any]:
    choices = []
    for i, r in enumerate(results):
        text, entries = _choice_text_and_logprobs(r, i, want_lp, echo, score_only)
        choice: Dict[str, Any] = {
            "index": i,
            "text": text,
            "logprobs": _completion_logprobs(entries) if want_lp else None,
            "finish_reason": "length" if score_only else r.finish_reason,
            "stop_reason": None if score_only else r.matched_stop,
        }
        if want_ids:
            choice["token_ids"] = [] if score_only else list(r.token_ids)
        choices.append(choice)
    counts = usage(results, n)
    if score_only:  # the one token generated to finish the prefill is not returned, nor counted
        counts = {**counts, "completion_tokens": 0, "total_tokens": counts["prompt_tokens"]}
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model, "choices": choices, "usage": counts}


async def _completion_stream(
    stream: RequestStream,
    first: Event,
    rid: str,
    model: str,
    include_usage: bool,
    n: int,
    want_lp: bool,
    echo: List[str | None] | None = None,
    score_only: bool = False,
    want_ids: bool = False,
    continuous_usage: bool = False,
) -> AsyncIterator[str]:
    out = ChunkWriter(rid, "text_completion", model, include_usage, continuous_usage)
    results = [Result() for _ in stream.uids]
    offsets = [0] * len(results)
    echoed = [echo is None] * len(results)

    def chunk(index: int, text: str, finish: str | None = None, logprobs: Any = None, **extra: Any) -> str:
        return out.choice({"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish, **extra}, results[index])

    async for index, msg in events(stream, first):
        if isinstance(msg, ErrorMsg):
            yield stream_error(msg)
            stream.abort()
            break
        results[index].add(msg)
        if not echoed[index]:  # the prompt first, with its logprobs
            assert echo is not None
            echoed[index] = True
            head, head_lp = _echo_prefix(results[index], echo[index], want_lp)
            yield chunk(index, head, logprobs=_completion_logprobs(head_lp) if want_lp else None)
            offsets[index] = len(head)
        if score_only:
            if msg.finished:
                yield chunk(index, "", "length", _completion_logprobs([]) if want_lp else None)
            continue
        ids = msg.token_ids or []
        if msg.text or msg.finished or (want_lp and msg.logprobs) or (want_ids and ids):
            lp = _completion_logprobs(msg.logprobs or [], offsets[index]) if want_lp else None
            offsets[index] += len(msg.text)
            extra: Dict[str, Any] = {"stop_reason": msg.matched_stop} if msg.finished else {}
            if want_ids:
                extra["token_ids"] = ids
            yield chunk(index, msg.text, msg.finish_reason if msg.finished else None, lp, **extra)
    else:
        if include_usage:
            yield out.usage(usage(results, n))
    yield "data: [DONE]\n\n"
