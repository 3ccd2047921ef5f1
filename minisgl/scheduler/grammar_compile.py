"""Grammar compilation off the scheduler loop: a few daemon threads compile, the loop polls.

A deeply nested JSON schema or a large EBNF takes xgrammar seconds to compile; compiled inline
at admission it froze every other client's stream for that long. xgrammar's compiler is C++ and
releases the GIL while it works (measured on this project's CPU: a 2.5 s compile on a thread left
the main thread's longest pause at 24 ms), so threads are enough: no process, no serialized
grammar. A request whose grammar is compiling waits outside the queue, holding no row and no
pages; the loop picks up finished compiles at each step (`CompilePool.poll`).

Compiles are cached by (kind, text) as futures, so a grammar that many requests share compiles
once, and one that is compiling is not compiled again. A compile that runs past its timeout fails
its requests with a 400 ("grammar too complex"); xgrammar cannot be interrupted, so its thread
finishes in the background (a daemon: it never holds up shutdown). Until then the same grammar is
refused at once, so resending a pathological grammar cannot put a second thread on it.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from typing import Any, Callable, List, Tuple

from minisgl.sampling_params import GrammarSpec, InvalidRequest

COMPILE_THREADS = 2  # one slow grammar does not hold up every other grammar
COMPILE_TIMEOUT_S = 30.0  # a grammar that compiles longer is refused as too complex
CACHE_SIZE = 256  # finished compiles kept (the backend keeps its own cache of the same size)

Compile = Callable[[GrammarSpec], Any]  # GrammarBackend.compile: the compiled grammar or InvalidRequest


class CompileJob:
    """One compile: its future (the compiled grammar, or the InvalidRequest) and its deadline."""

    def __init__(self, spec: GrammarSpec, timeout_s: float) -> None:
        self.spec = spec
        self.timeout_s = timeout_s
        self.deadline = time.monotonic() + timeout_s
        self.future: "Future[Any]" = Future()
        self.started = self.finished = 0.0  # monotonic times, for the tests and the log

    @property
    def seconds(self) -> float:
        """How long the compile ran (so far, while it runs)."""
        if not self.started:
            return 0.0
        return (self.finished or time.monotonic()) - self.started

    def outcome(self, now: float) -> Tuple[bool, Any]:
        """(ready, compiled grammar or InvalidRequest); not ready while it compiles in time."""
        if self.future.done():
            exc = self.future.exception()
            if exc is None:
                return True, self.future.result()
            if isinstance(exc, InvalidRequest):
                return True, exc
            return True, InvalidRequest(f"grammar compilation failed: {type(exc).__name__}: {exc}", param=self.spec.param)
        if now >= self.deadline:
            return True, self.too_complex()
        return False, None

    def wait(self) -> Any:
        """Block until the compile is done or its deadline passed: the compiled grammar, or the
        InvalidRequest raised (the offline API's up-front check)."""
        wait_futures([self.future], timeout=max(0.0, self.deadline - time.monotonic()))
        ready, outcome = self.outcome(time.monotonic())
        if not ready:  # (the wait ended a hair before the deadline)
            outcome = self.too_complex()
        if isinstance(outcome, InvalidRequest):
            raise outcome
        return outcome

    def too_complex(self) -> InvalidRequest:
        return InvalidRequest(
            f"grammar too complex: the {self.spec.kind} grammar did not compile within {self.timeout_s:g} s", param=self.spec.param
        )


class CompilePool:
    """Daemon threads that compile grammars with `compile`, and the cache of their jobs."""

    def __init__(self, compile: Compile, threads: int = COMPILE_THREADS, timeout_s: float | None = None) -> None:
        self._compile = compile
        self._timeout_s = timeout_s
        self._jobs: "OrderedDict[tuple[str, str, str], CompileJob]" = OrderedDict()
        self._todo: "queue.SimpleQueue[CompileJob | None]" = queue.SimpleQueue()
        self._threads = threads
        for i in range(threads):
            threading.Thread(target=self._work, name=f"grammar-compile-{i}", daemon=True).start()

    def submit(self, spec: GrammarSpec) -> CompileJob:
        """The job compiling `spec` (a cached one if this grammar was compiled or is compiling).
        A grammar whose compile timed out is refused at once while that compile still runs (never
        two threads on one pathological grammar); if it completes, it serves later requests."""
        # the field is part of the key: a refusal names the field this request used (a valid
        # grammar sent under another field compiles once: GrammarBackend caches by kind and text)
        key = (spec.kind, spec.value, spec.param)
        job = self._jobs.get(key)
        if job is not None:
            self._jobs.move_to_end(key)
            return job
        timeout = COMPILE_TIMEOUT_S if self._timeout_s is None else self._timeout_s
        job = CompileJob(spec, timeout)
        self._jobs[key] = job
        if len(self._jobs) > CACHE_SIZE:
            self._jobs.popitem(last=False)
        self._todo.put(job)
        return job

    def wait_any(self, jobs: List[CompileJob], timeout_s: float) -> None:
        """Block until one of `jobs` is done or `timeout_s` passed (the loop has nothing else to do)."""
        if jobs:
            wait_futures([j.future for j in jobs], timeout=timeout_s, return_when="FIRST_COMPLETED")

    def close(self) -> None:
        """Let the threads end once the compiles queued before are done (they never block exit)."""
        for _ in range(self._threads):
            self._todo.put(None)

    def _work(self) -> None:
        while True:
            job = self._todo.get()
            if job is None:
                return
            if not job.future.set_running_or_notify_cancel():
                continue
            job.started = time.monotonic()
            try:
                result = self._compile(job.spec)
            except BaseException as exc:  # noqa: BLE001 - handed to the request, never kills the thread
                job.finished = time.monotonic()
                job.future.set_exception(exc)
            else:
                job.finished = time.monotonic()
                job.future.set_result(result)
