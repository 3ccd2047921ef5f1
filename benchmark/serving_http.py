"""A minimal asyncio HTTP/1.1 client for benchmark/serving.py: POST a JSON body, read an SSE stream.

Why not httpx or aiohttp: the benchmark shares two CPU cores with the server it measures, and at
256 concurrent streams a general-purpose client's per-line cost shows up in the very latencies we
measure; this one reads each HTTP chunk with two `StreamReader` calls and timestamps it on
arrival. It also needs nothing beyond the standard library, so it runs on the device image as is.

Supports what a local OpenAI-style server sends: `Content-Length` or `Transfer-Encoding: chunked`
bodies, keep-alive off (one connection per request, as `vllm bench serve` opens per request).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Dict, List, Tuple
from urllib.parse import urlsplit


@dataclass
class Response:
    status: int
    headers: Dict[str, str]
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    _chunked: bool = field(default=False, init=False)
    _left: int | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self._chunked = "chunked" in self.headers.get("transfer-encoding", "").lower()
        length = self.headers.get("content-length")
        self._left = int(length) if length is not None else None

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as the server sent it: one item per HTTP chunk (or per socket read)."""
        if self._chunked:
            while True:
                size_line = await self.reader.readline()
                if not size_line:
                    return
                size = int(size_line.split(b";", 1)[0].strip() or b"0", 16)
                if size == 0:
                    await self.reader.readline()  # the empty trailer
                    return
                data = await self.reader.readexactly(size + 2)
                yield data[:-2]
        elif self._left is not None:
            while self._left > 0:
                data = await self.reader.read(min(self._left, 1 << 16))
                if not data:
                    return
                self._left -= len(data)
                yield data
        else:
            while data := await self.reader.read(1 << 16):
                yield data

    async def read(self) -> bytes:
        return b"".join([c async for c in self.chunks()])

    async def json(self) -> Any:
        return json.loads(await self.read())

    def close(self) -> None:
        self.writer.close()


async def request(url: str, body: Any | None = None, headers: Dict[str, str] | None = None, timeout: float = 30.0) -> Response:
    """GET (body None) or POST a JSON body; returns once the status line and headers are in."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    path = parts.path + (f"?{parts.query}" if parts.query else "")
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port, limit=1 << 22), timeout)
    payload = b"" if body is None else json.dumps(body).encode()
    lines = [f"{'GET' if body is None else 'POST'} {path or '/'} HTTP/1.1", f"Host: {host}:{port}", "Connection: close"]
    if body is not None:
        lines += ["Content-Type: application/json", f"Content-Length: {len(payload)}"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    writer.write(("\r\n".join(lines) + "\r\n\r\n").encode() + payload)
    await writer.drain()
    status_line = await asyncio.wait_for(reader.readline(), timeout)
    if not status_line:
        writer.close()
        raise ConnectionError("the server closed the connection before answering")
    status = int(status_line.split()[1])
    head: Dict[str, str] = {}
    while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
        key, _, value = line.decode("latin-1").partition(":")
        head[key.strip().lower()] = value.strip()
    return Response(status, head, reader, writer)


async def sse_events(resp: Response) -> AsyncIterator[Tuple[float, List[Any]]]:
    """(arrival time, the JSON events of one HTTP chunk) until `data: [DONE]`. Events that arrive
    in one chunk share its timestamp: that is what the burstiness numbers look for."""
    buf = b""
    async for chunk in resp.chunks():
        now = time.perf_counter()
        buf += chunk
        events: List[Any] = []
        while b"\n\n" in buf:
            frame, buf = buf.split(b"\n\n", 1)
            for line in frame.split(b"\n"):
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    if events:
                        yield now, events
                    return
                events.append(json.loads(data))
        if events:
            yield now, events
