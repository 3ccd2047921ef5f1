"""`X-Request-Id`: taken from the request (or made here), echoed on every response, logged.

A pure ASGI middleware (not Starlette's BaseHTTPMiddleware, which buffers streams and hides client
disconnects): it wraps `send` so the header is on every response the app starts, errors and SSE
streams included. The id also goes into a context variable, which the request's stream reads
when it is created (same task), so the request's log line names it.
"""

from __future__ import annotations

import contextvars
import uuid
from typing import Any, Awaitable, Callable, MutableMapping

HEADER = b"x-request-id"
MAX_LEN = 128  # a longer (or non-printable) id from a client is replaced, never echoed

current_request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("minisgl_request_id", default=None)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Awaitable[None]]


def _acceptable(value: bytes) -> bool:
    # printable ASCII only: the id is written back into a header and into the log
    return 0 < len(value) <= MAX_LEN and all(0x21 <= b <= 0x7E for b in value)


def request_id_of(scope: Scope) -> str:
    for name, value in scope.get("headers", ()):
        if name == HEADER and _acceptable(value):
            return value.decode("ascii")
    return uuid.uuid4().hex


class RequestIdMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Callable[[], Awaitable[Message]], send: Callable[[Message], Awaitable[None]]) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = request_id_of(scope)
        scope.setdefault("state", {})["request_id"] = rid
        token = current_request_id.set(rid)

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", ()) if k.lower() != HEADER]
                message["headers"] = [*headers, (HEADER, rid.encode("ascii"))]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            current_request_id.reset(token)
