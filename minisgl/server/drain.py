"""Graceful drain on SIGTERM/SIGINT: stop admitting, let requests in flight finish, then stop.

uvicorn on its own stops at the first signal: it closes the listener, gives open responses
`timeout_graceful_shutdown` seconds and cancels the rest, which cuts SSE streams with no final
event and logs CancelledError tracebacks. `DrainingServer` puts a drain in front of that:

1. the first signal marks the frontend draining: new generation requests get 503 (an OpenAI
   error body), `/health` answers 503 (routers and Kubernetes stop sending here), the listener
   stays open so those answers reach the clients;
2. requests in flight run to their end, for up to `--shutdown-timeout` seconds;
3. what is still running then is ended with an error (503, code `server_shutting_down`), which a
   stream sends as its final `data:` chunk, and the scheduler frees its pages;
4. only then uvicorn's own shutdown runs, with nothing left to cancel.

A second signal skips the wait (step 3 at once).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import uvicorn

from minisgl.server.frontend import Frontend
from minisgl.utils.logger import init_logger

logger = init_logger("minisgl.server")

POLL_S = 0.05  # how often the drain looks at the requests in flight
FLUSH_S = 2.0  # after the timeout: at most this long for the final error chunks to be written


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, frontend: Frontend, shutdown_timeout_s: float) -> None:
        super().__init__(config)
        self.frontend = frontend
        self.shutdown_timeout_s = shutdown_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Task | None = None
        self._hurry = False

    async def startup(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)

    def handle_exit(self, sig: int, frame: Any) -> None:
        # A signal handler: it only records the signal (uvicorn raises it again after the
        # shutdown, which launch reports) and hands the work to the event loop.
        self._captured_signals.append(sig)
        loop = self._loop
        if loop is None or not self.started or self.should_exit:
            self.should_exit = True  # before start-up finished, or already stopping: uvicorn's way
            return
        loop.call_soon_threadsafe(self._on_signal)

    def _on_signal(self) -> None:
        if self._drain is None:
            self._drain = asyncio.get_running_loop().create_task(self._run_drain(), name="minisgl-drain")
        else:
            self._hurry = True  # a second signal: stop waiting

    async def _run_drain(self) -> None:
        frontend = self.frontend
        frontend.draining = True
        start = time.monotonic()
        deadline = start + self.shutdown_timeout_s
        running = frontend.num_in_flight
        logger.info("draining: %d request(s) in flight get up to %.0f s to finish; new requests get 503", running, self.shutdown_timeout_s)
        while frontend.num_in_flight and time.monotonic() < deadline and not self._hurry:
            await asyncio.sleep(POLL_S)
        left = frontend.num_in_flight
        if left:
            logger.warning("drain: ending %d request(s) still running after %.1f s", left, time.monotonic() - start)
            frontend.end_all(
                "the server is shutting down: the request did not finish within --shutdown-timeout", code="server_shutting_down"
            )
            flush_deadline = time.monotonic() + FLUSH_S
            while self._open_responses() and time.monotonic() < flush_deadline:
                await asyncio.sleep(POLL_S)
        elif running:
            logger.info("drain: every request finished after %.1f s", time.monotonic() - start)
        self.should_exit = True

    def _open_responses(self) -> bool:
        # uvicorn's own bookkeeping: responses still being written (their tasks)
        return bool(self.server_state.tasks)
