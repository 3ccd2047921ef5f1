"""POST /v1/chat/completions: the tokenizer's chat template renders `messages`."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, AsyncIterator, Dict, List, Tuple

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from minisgl.message import ErrorMsg, TokenizeMsg
from minisgl.server import harmony
from minisgl.server.frontend import RequestStream
from minisgl.server.protocol import UNSUPPORTED_CHAT_FIELDS, ChatCompletionRequest
from minisgl.server.reasoning import ReasoningStream, split_reasoning
from minisgl.server.routes.common import (
    APIError,
    ChunkWriter,
    Event,
    GuardedRoute,
    Result,
    ServerState,
    check_model,
    events,
    get_state,
    log_ignored,
    need_tokenizer,
    read_body,
    require_api_key,
    require_generate_task,
    respond,
    stream_error,
    usage,
    validated,
)
from minisgl.server.tools import ToolCall, ToolParser, ToolStream, template_renders_tools, tool_turn_grammar, tools_system_message

router = APIRouter(route_class=GuardedRoute, dependencies=[Depends(require_api_key)])


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    state = get_state(request)
    require_generate_task(state)
    body: ChatCompletionRequest = await read_body(request, ChatCompletionRequest, UNSUPPORTED_CHAT_FIELDS)
    log_ignored(request, body)
    check_model(state, body.model)
    need_tokenizer(state, "/v1/chat/completions (the chat template renders text; use /v1/completions with token ids)", "messages")
    msgs, parser = chat_tokenize_msgs(state, body)
    return await _respond_chat(request, state, body, msgs, parser)


def chat_tokenize_msgs(state: ServerState, body: ChatCompletionRequest) -> Tuple[List[TokenizeMsg], ToolParser | None]:
    """A checked chat request as TokenizeMsgs (one per choice), and the tool parser its output goes
    through (None without active tools). /v1/responses comes through here too."""
    try:
        messages = [m.to_template() for m in body.messages]
    except ValueError as exc:
        raise APIError(400, str(exc), param="messages") from None
    if state.harmony:  # GPT-OSS's template reads `thinking` and one call per assistant message
        messages = harmony.template_messages(messages)
    tools = body.active_tools()
    parser = state.tool_parser if tools else None
    template_tools = None
    if parser is not None:
        if template_renders_tools(state.chat_template):
            template_tools = harmony.template_tools(tools) if state.harmony else tools
        else:  # the template would drop them: the model still has to see the definitions
            messages = [tools_system_message(tools, parser), *messages]
    state.limits.check_prompt_text(sum(len(json.dumps(m, ensure_ascii=False).encode("utf-8")) for m in messages), "messages")
    k = body.logprobs_k()
    max_tokens = body.effective_max_tokens()
    params = body.sampling_params(max_tokens, k)
    if parser is not None and (body.must_call() or params.grammar is not None) and not parser.forces_calls:
        param = "tool_choice" if body.must_call() else "response_format"
        raise APIError(
            400,
            f"{param} beside tools is not supported with the {parser.name} tool-call format: a grammar cannot force its calls "
            "(harmony's function name is in the message header); use tool_choice auto without an output format",
            param=param,
            code="unsupported_parameter",
        )
    if parser is not None and (body.must_call() or params.grammar is not None):
        # forced calls, or calls | the answer format (minisgl.server.tools.tool_turn_grammar)
        params.grammar = tool_turn_grammar(
            parser,
            tools,
            [t.function.name for t in body.tools or []],
            must_call=body.must_call(),
            parallel=body.parallel_tool_calls is not False,
            answer=params.grammar,
            after_tool_result=body.messages[-1].role == "tool",
        )
    params = validated(params, state.limits, {"max_tokens": body.max_tokens_param()})
    if state.harmony_stops and not params.ignore_eos:  # <|return|> and <|call|> end a harmony turn
        params.stop_token_ids = sorted({*params.stop_token_ids, *state.harmony_stops})
    template_kwargs = _template_kwargs(state, body)
    msgs = [
        TokenizeMsg(
            uid=state.frontend.new_uid(),
            messages=messages,
            sampling=params.for_choice(i),
            max_tokens_explicit=max_tokens is not None,
            want_logprobs=k is not None,
            # the harmony parser reads the channel markers, which are special tokens
            skip_special_tokens=body.skip_special_tokens and not state.harmony and (parser is None or parser.skip_special_tokens),
            chat_template_kwargs=template_kwargs,
            tools=template_tools,
        )
        for i in range(body.n)
    ]
    return msgs, parser


def _template_kwargs(state: ServerState, body: ChatCompletionRequest) -> Dict[str, Any] | None:
    """chat_template_kwargs, with reasoning_effort for a template that takes it (GPT-OSS's)."""
    kwargs = body.chat_template_kwargs
    effort = body.reasoning_effort
    if effort is None:
        return kwargs
    if "reasoning_effort" not in (state.chat_template or ""):
        raise APIError(
            400,
            "reasoning_effort: this model's chat template takes no reasoning effort",
            param="reasoning_effort",
            code="unsupported_parameter",
        )
    if kwargs and kwargs.get("reasoning_effort", effort) != effort:
        raise APIError(400, "reasoning_effort and chat_template_kwargs.reasoning_effort differ: give one of them", param="reasoning_effort")
    return {**(kwargs or {}), "reasoning_effort": effort}


async def _respond_chat(
    request: Request, state: ServerState, body: ChatCompletionRequest, msgs: List[TokenizeMsg], parser: ToolParser | None
) -> Response:
    k = body.logprobs_k()
    one_call = body.parallel_tool_calls is False  # at most one call per choice
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    continuous_usage = bool(body.stream_options and body.stream_options.continuous_usage_stats)
    want_lp = k is not None
    want_ids = body.return_token_ids
    return await respond(
        request,
        msgs,
        body.stream,
        lambda rs, first: _chat_stream(
            rs,
            first,
            rid,
            state.model_name,
            include_usage,
            want_lp,
            parser,
            state.reasoning,
            one_call,
            want_ids,
            continuous_usage,
            state.harmony,
        ),
        lambda results: _chat_response(results, rid, state.model_name, want_lp, parser, state.reasoning, one_call, want_ids, state.harmony),
        choices=len(msgs),  # n choices of one conversation
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


def _finish_reason(reason: str | None, calls: List[ToolCall]) -> str | None:
    return "tool_calls" if calls and reason == "stop" else reason


def _chat_response(
    results: List[Result],
    rid: str,
    model: str,
    want_lp: bool,
    parser: ToolParser | None,
    reasoning: bool,
    one_call: bool = False,
    want_ids: bool = False,
    harmony_format: bool = False,
) -> Dict[str, Any]:
    choices = []
    for i, r in enumerate(results):
        content: str | None = "".join(r.text)
        thought = None
        calls: List[ToolCall] = []
        if harmony_format:
            thought, content, calls = harmony.parse(content or "", parse_calls=parser is not None)
        if reasoning:
            thought, content = split_reasoning(content or "")
        if parser is not None and not harmony_format:
            content, calls = parser.parse(content or "")
        calls = calls[:1] if one_call else calls
        message: Dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None}
        if thought is not None:
            message["reasoning_content"] = message["reasoning"] = thought
        if calls:
            message["tool_calls"] = [c.to_openai() for c in calls]
        choice: Dict[str, Any] = {
            "index": i,
            "message": message,
            "logprobs": _chat_logprobs(r.logprobs) if want_lp else None,
            "finish_reason": _finish_reason(r.finish_reason, calls),
            "stop_reason": r.matched_stop,
        }
        if want_ids:
            choice["token_ids"] = list(r.token_ids)
        choices.append(choice)
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage(results, len(results)),
    }


async def _chat_stream(
    stream: RequestStream,
    first: Event,
    rid: str,
    model: str,
    include_usage: bool,
    want_lp: bool,
    parser: ToolParser | None,
    reasoning: bool,
    one_call: bool = False,
    want_ids: bool = False,
    continuous_usage: bool = False,
    harmony_format: bool = False,
) -> AsyncIterator[str]:
    out = ChunkWriter(rid, "chat.completion.chunk", model, include_usage, continuous_usage)
    results = [Result() for _ in stream.uids]
    started = [False] * len(results)
    channels = [harmony.HarmonyStream(parser is not None) for _ in results] if harmony_format else None
    tool_streams = [ToolStream(parser) for _ in results] if parser is not None and channels is None else None
    thoughts = [ReasoningStream() for _ in results] if reasoning else None
    sent_calls: List[List[ToolCall]] = [[] for _ in results]  # harmony's, sent as each call's message ends

    def split(index: int, text: str, final: bool) -> tuple[str, str, List[ToolCall]]:
        """(reasoning delta, content delta, calls) of new text; at the end, whatever was held back."""
        if channels is not None:
            delta = channels[index].feed(text)
            if final:
                delta += channels[index].finish()
            room = 1 - len(sent_calls[index]) if one_call else len(delta.calls)
            return delta.reasoning, delta.content, delta.calls[: max(room, 0)]
        thought = ""
        if thoughts is not None:
            thought, text = thoughts[index].feed(text)
            if final:
                more_thought, more_text = thoughts[index].finish()
                thought, text = thought + more_thought, text + more_text
        if tool_streams is not None:
            text = tool_streams[index].feed(text)
        return thought, text, []

    pending_ids: List[int] = []  # return_token_ids: this reply's ids, sent with its first chunk

    def chunk(index: int, delta: Dict[str, Any], finish: str | None = None, logprobs: Any = None, **extra: Any) -> str:
        if want_ids:
            extra["token_ids"] = list(pending_ids)
            pending_ids.clear()
        return out.choice({"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish, **extra}, results[index])

    async for index, msg in events(stream, first):
        if isinstance(msg, ErrorMsg):
            yield stream_error(msg)
            stream.abort()
            break
        results[index].add(msg)
        if not started[index]:
            started[index] = True
            yield chunk(index, {"role": "assistant", "content": ""})
        pending_ids[:] = msg.token_ids or []
        thought, text, new_calls = split(index, msg.text, msg.finished)
        if thought:
            yield chunk(index, {"reasoning_content": thought, "reasoning": thought})
        if text or (want_lp and msg.logprobs):
            yield chunk(index, {"content": text}, logprobs=_chat_logprobs(msg.logprobs or []) if want_lp else None)
        elif pending_ids and not msg.finished and not new_calls:  # the text is held back: the ids still arrive now
            yield chunk(index, {})
        if new_calls:
            first_index = len(sent_calls[index])
            sent_calls[index] += new_calls
            yield chunk(index, {"tool_calls": [c.to_openai(first_index + j) for j, c in enumerate(new_calls)]})
        if msg.finished:
            calls: List[ToolCall] = sent_calls[index]
            if tool_streams is not None:
                rest, calls = tool_streams[index].finish()
                calls = calls[:1] if one_call else calls
                if rest:
                    yield chunk(index, {"content": rest})
                if calls:
                    yield chunk(index, {"tool_calls": [c.to_openai(j) for j, c in enumerate(calls)]})
            yield chunk(index, {}, _finish_reason(msg.finish_reason, calls), stop_reason=msg.matched_stop)
    else:
        if include_usage:
            yield out.usage(usage(results, len(results)))
    yield "data: [DONE]\n\n"
