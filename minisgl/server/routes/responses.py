"""POST /v1/responses: OpenAI's Responses API on top of the chat path.

The request becomes the chat request it means (responses_protocol.to_chat_request) and goes
through `chat.chat_tokenize_msgs`: the same template, tools, grammars and checks as
/v1/chat/completions, errors renamed to this API's fields. The output is cut into typed items —
`reasoning` (with a reasoning parser), `message` with `output_text`, `function_call` — by one
`ResponseOutput`, fed token by token when streaming and all at once otherwise, so a streamed
response ends exactly as the non-streamed one would.
"""

from __future__ import annotations

import copy
import json
import time
import uuid
from typing import Any, AsyncIterator, Dict, List

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from pydantic import ValidationError

from minisgl.message import ErrorMsg
from minisgl.sampling_params import InvalidRequest
from minisgl.server import harmony
from minisgl.server.frontend import RequestStream
from minisgl.server.reasoning import ReasoningStream
from minisgl.server.responses_protocol import UNSUPPORTED_RESPONSES_FIELDS, ResponsesRequest
from minisgl.server.routes.chat import chat_tokenize_msgs
from minisgl.server.routes.common import (
    APIError,
    Event,
    GuardedRoute,
    Result,
    check_model,
    events,
    get_state,
    log_ignored,
    need_tokenizer,
    read_body,
    require_api_key,
    respond,
    usage,
    validation_error,
)
from minisgl.server.tools import ToolCall, ToolParser, ToolStream

router = APIRouter(route_class=GuardedRoute, dependencies=[Depends(require_api_key)])

# chat's field names, as a Responses client sent them
RENAMED = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "response_format": "text",
    "reasoning_effort": "reasoning.effort",
}


@router.post("/v1/responses")
async def create_response(request: Request) -> Response:
    state = get_state(request)
    body: ResponsesRequest = await read_body(request, ResponsesRequest, UNSUPPORTED_RESPONSES_FIELDS)
    log_ignored(request, body)
    body.check()
    check_model(state, body.model)
    need_tokenizer(state, "/v1/responses (the chat template renders text)", "input")
    try:
        msgs, parser = chat_tokenize_msgs(state, body.to_chat_request())
    except ValidationError as exc:
        raise _renamed(validation_error(exc)) from None
    except InvalidRequest as exc:
        raise APIError.from_invalid(exc, RENAMED) from None
    except APIError as exc:
        raise _renamed(exc) from None
    shell = ResponseShell(body, state.model_name)
    one_call = body.parallel_tool_calls is False

    def new_output() -> ResponseOutput:
        return ResponseOutput(state.reasoning, parser, one_call, state.harmony)

    try:
        return await respond(
            request,
            msgs,
            body.stream,
            lambda rs, first: _response_stream(rs, first, shell, new_output()),
            lambda results: _response(results[0], shell, new_output()),
        )
    except APIError as exc:  # from the tokenizer or the scheduler (e.g. the context check)
        raise _renamed(exc) from None


def _renamed(exc: APIError) -> APIError:
    if exc.param not in RENAMED:
        return exc
    new = RENAMED[exc.param]
    message = new + exc.message[len(exc.param) :] if exc.message.startswith(exc.param) else exc.message
    return APIError(exc.status, message, new, exc.code, exc.type, exc.headers)


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseShell:
    """The fields of the response object that echo the request (the same on every event)."""

    def __init__(self, body: ResponsesRequest, model: str) -> None:
        self.id = _new_id("resp")
        self.created_at = int(time.time())
        tool_choice: Any = body.tool_choice.model_dump() if body.tool_choice is not None and not isinstance(body.tool_choice, str) else None
        self.echo: Dict[str, Any] = {
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "model": model,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": None,
            "reasoning": {"effort": body.reasoning.effort if body.reasoning is not None else None, "summary": None},
            "store": False,  # nothing is stored, whatever the request said
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "text": {"format": body.text_format()},
            "tool_choice": tool_choice or body.tool_choice or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
            "top_p": 1.0 if body.top_p is None else body.top_p,
            "truncation": "disabled",
            "user": body.user,
            "metadata": dict(body.metadata or {}),
            "background": False,
            "error": None,
        }

    def render(self, status: str, output: List[Dict[str, Any]], counts: Dict[str, Any] | None) -> Dict[str, Any]:
        done = status != "in_progress"
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "completed_at": int(time.time()) if done else None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "output": output,
            "usage": _usage(counts) if counts is not None else None,
            **self.echo,
        }


def _usage(chat_usage: Dict[str, Any]) -> Dict[str, Any]:
    return {
        "input_tokens": chat_usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": chat_usage["prompt_tokens_details"]["cached_tokens"], "cache_write_tokens": 0},
        "output_tokens": chat_usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat_usage["total_tokens"],
    }


class ResponseOutput:
    """The output items of one response as its text arrives. `feed` and `finish` return the
    stream events (without sequence numbers) that each change means; a non-streamed response
    feeds its whole text once and drops them."""

    def __init__(self, reasoning: bool, parser: ToolParser | None, one_call: bool, harmony_format: bool = False) -> None:
        self.thoughts = ReasoningStream() if reasoning else None
        self.channels = harmony.HarmonyStream(parser is not None) if harmony_format else None
        self.tool_stream = ToolStream(parser) if parser is not None and self.channels is None else None
        self.calls: List[ToolCall] = []  # harmony's, as each call's message ends
        self.one_call = one_call
        self.items: List[Dict[str, Any]] = []
        self.status = "in_progress"
        self._open: Dict[str, Any] | None = None  # the reasoning or message item now receiving text

    def feed(self, text: str, final: bool) -> List[Dict[str, Any]]:
        thought = ""
        if self.channels is not None:
            delta = self.channels.feed(text)
            if final:
                delta += self.channels.finish()
            thought, text = delta.reasoning, delta.content
            self.calls += delta.calls
        if self.thoughts is not None:
            thought, text = self.thoughts.feed(text)
            if final:
                more_thought, more_text = self.thoughts.finish()
                thought, text = thought + more_thought, text + more_text
        if self.tool_stream is not None:
            text = self.tool_stream.feed(text)
        events = self._add_text("reasoning", thought) if thought else []
        return events + (self._add_text("message", text) if text else [])

    def finish(self, finish_reason: str | None) -> List[Dict[str, Any]]:
        # cut off by max_output_tokens or the context: incomplete; ended by the server (shutdown): cancelled
        self.status = {"length": "incomplete", "abort": "cancelled"}.get(finish_reason or "", "completed")
        events: List[Dict[str, Any]] = []
        calls: List[ToolCall] = self.calls
        if self.tool_stream is not None:
            rest, calls = self.tool_stream.finish()
            if rest:
                events += self._add_text("message", rest)
        calls = calls[:1] if self.one_call else calls
        if not self.items and not calls:  # an empty answer is still one (empty) message
            events += self._open_item("message")
        events += self._close_open()
        for call in calls:
            chat_call = call.to_openai()
            arguments = chat_call["function"]["arguments"]
            item = {"id": _new_id("fc"), "type": "function_call", "status": "in_progress", "arguments": "", "call_id": chat_call["id"]}
            item["name"] = call.name
            where = {"item_id": item["id"], "output_index": len(self.items)}
            events.append(self._item_event("response.output_item.added", item, len(self.items)))
            events.append({"type": "response.function_call_arguments.delta", **where, "delta": arguments})
            events.append({"type": "response.function_call_arguments.done", **where, "arguments": arguments})
            item.update(arguments=arguments, status="completed")
            self.items.append(item)
            events.append(self._item_event("response.output_item.done", item, len(self.items) - 1))
        return events

    # ---- the item receiving text ----

    @staticmethod
    def _item_event(kind: str, item: Dict[str, Any], index: int) -> Dict[str, Any]:
        return {"type": kind, "output_index": index, "item": copy.deepcopy(item)}  # a snapshot: the item grows

    def _part_event(self, kind: str) -> Dict[str, Any]:
        assert self._open is not None
        part = self._open["content"][0]
        return {"type": kind, "item_id": self._open["id"], "output_index": len(self.items) - 1, "content_index": 0, "part": dict(part)}

    def _open_item(self, kind: str) -> List[Dict[str, Any]]:
        if kind == "reasoning":
            item: Dict[str, Any] = {"id": _new_id("rs"), "type": "reasoning", "summary": [], "content": [], "status": "in_progress"}
            part: Dict[str, Any] = {"type": "reasoning_text", "text": ""}
        else:
            item = {"id": _new_id("msg"), "type": "message", "role": "assistant", "status": "in_progress", "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        events = [self._item_event("response.output_item.added", item, len(self.items))]
        self.items.append(item)
        self._open = item
        item["content"].append(part)
        return events + [self._part_event("response.content_part.added")]

    def _add_text(self, kind: str, text: str) -> List[Dict[str, Any]]:
        events: List[Dict[str, Any]] = []
        if self._open is None or self._open["type"] != kind:
            events += self._close_open() + self._open_item(kind)
        assert self._open is not None
        part = self._open["content"][0]
        part["text"] += text
        delta = {"type": _text_event(kind, "delta"), "item_id": self._open["id"], "output_index": len(self.items) - 1, "content_index": 0}
        delta["delta"] = text
        if kind == "message":
            delta["logprobs"] = []
        return events + [delta]

    def _close_open(self) -> List[Dict[str, Any]]:
        item = self._open
        if item is None:
            return []
        part = item["content"][0]
        done = {"type": _text_event(item["type"], "done"), "item_id": item["id"], "output_index": len(self.items) - 1, "content_index": 0}
        done["text"] = part["text"]
        if item["type"] == "message":
            done["logprobs"] = []
        events = [done, self._part_event("response.content_part.done")]
        # closed by text of the other kind (a thought before the answer): complete; else as the response
        item["status"] = "completed" if self.status in ("in_progress", "completed") else "incomplete"
        self._open = None
        return events + [self._item_event("response.output_item.done", item, len(self.items) - 1)]


def _text_event(kind: str, which: str) -> str:
    return f"response.reasoning_text.{which}" if kind == "reasoning" else f"response.output_text.{which}"


def _response(result: Result, shell: ResponseShell, out: ResponseOutput) -> Dict[str, Any]:
    out.feed("".join(result.text), True)
    out.finish(result.finish_reason)
    return shell.render(out.status, out.items, usage([result], 1))


class EventWriter:
    """SSE lines `event: <type>` + `data: <json>`, each event numbered in order."""

    def __init__(self) -> None:
        self.sequence_number = 0

    def __call__(self, event: Dict[str, Any]) -> str:
        event = {**event, "sequence_number": self.sequence_number}
        self.sequence_number += 1
        return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


async def _response_stream(stream: RequestStream, first: Event, shell: ResponseShell, out: ResponseOutput) -> AsyncIterator[str]:
    write = EventWriter()
    yield write({"type": "response.created", "response": shell.render("in_progress", [], None)})
    yield write({"type": "response.in_progress", "response": shell.render("in_progress", [], None)})
    result = Result()
    async for _, msg in events(stream, first):
        if isinstance(msg, ErrorMsg):
            yield write({"type": "error", "code": msg.code, "message": msg.message, "param": RENAMED.get(msg.param or "", msg.param)})
            stream.abort()
            return
        result.add(msg)
        for event in out.feed(msg.text, msg.finished):
            yield write(event)
        if msg.finished:
            for event in out.finish(msg.finish_reason):
                yield write(event)
    final = shell.render(out.status, out.items, usage([result], 1))
    final_event = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(out.status, "response.failed")
    yield write({"type": final_event, "response": final})
