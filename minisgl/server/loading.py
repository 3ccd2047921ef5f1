"""The HTTP port during start-up: every request gets 503 until the workers are ready.

The port is bound before the model loads (launch.bind_listener), but uvicorn serves only once
every worker reported ready; in between, connections used to wait unanswered in the listen
backlog for the whole load. `LoadingResponder` answers them instead, from a thread on the same
socket: `/health` gets `503 {"status": "loading"}` (a Kubernetes readiness probe or a router sees
"not ready", not a hang), anything else an OpenAI error body (code `server_loading`) with
`Retry-After`; each answer closes its connection. It stops, without taking more connections,
before uvicorn takes the socket over.
"""

from __future__ import annotations

import json
import select
import socket
import threading
import uuid

READ_TIMEOUT_S = 2.0  # a client gets this long to send its request head
MAX_HEAD_BYTES = 16 << 10
POLL_S = 0.1


def _head(conn: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data and len(data) < MAX_HEAD_BYTES:
        chunk = conn.recv(4096)
        if not chunk:
            break
        data += chunk
    return data


def _request_id(head: bytes) -> str:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        value = value.strip()
        if name.strip().lower() == b"x-request-id" and 0 < len(value) <= 128 and all(0x21 <= b <= 0x7E for b in value):
            return value.decode("ascii")
    return uuid.uuid4().hex


def loading_response(head: bytes) -> bytes:
    path = head.split(b" ", 2)[1] if head.count(b" ") >= 2 else b"/"
    if path.split(b"?")[0] == b"/health":
        body: dict = {"status": "loading", "reason": "the model is loading"}
    else:
        body = {"error": {"message": "the server is starting: the model is loading; retry shortly", "type": "server_error",
                          "param": None, "code": "server_loading"}}  # fmt: skip
    payload = json.dumps(body).encode()
    headers = (
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\nRetry-After: 5\r\nX-Request-Id: {_request_id(head)}\r\nConnection: close\r\n\r\n"
    )
    return headers.encode("ascii") + (b"" if head.startswith(b"HEAD ") else payload)


class LoadingResponder:
    def __init__(self, listener: socket.socket) -> None:
        self.listener = listener
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="minisgl-loading", daemon=True)

    def start(self) -> "LoadingResponder":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            ready, _, _ = select.select([self.listener], [], [], POLL_S)
            if not ready or self._stop.is_set():
                continue
            try:
                conn, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                return  # the listener was closed: start-up failed
            with conn:
                try:
                    conn.settimeout(READ_TIMEOUT_S)
                    conn.sendall(loading_response(_head(conn)))
                except OSError:
                    pass
