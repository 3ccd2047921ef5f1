"""The worker processes of one node: spawn them, wait until each is ready, watch them, stop them.

Children are started with the multiprocessing *spawn* context (fork after torch is unsafe) and
report readiness (or the error that stopped them) through a pipe. `launch` starts them and then
serves HTTP or runs `shell`; both watch them with ChildWatchdog, which lives here so that the
shell needs nothing from launch (no import cycle).
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import multiprocessing.connection
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List

from minisgl.server.args import ServerArgs
from minisgl.server.process_utils import describe_exit
from minisgl.utils.logger import init_logger

logger = init_logger("minisgl.server")

TERMINATE_GRACE_S = 5.0
PROGRESS_EVERY_S = 5.0  # a "still loading" line at least this often while the workers start


class StartupError(RuntimeError):
    pass


@dataclass
class Child:
    name: str
    process: Any  # multiprocessing.Process
    conn: Any  # the read end of its ready pipe


def _scheduler_main(args: ServerArgs, ready_conn: Any, rank: int = 0) -> None:
    # imported in the child only: `minisgl.scheduler` pulls in torch, which this process never needs
    from minisgl.scheduler.process import run_scheduler_process

    run_scheduler_process(args, ready_conn, rank)


def _child_targets(args: ServerArgs) -> List[tuple[str, Callable[..., None], tuple]]:
    """(name, target, extra args): this node's scheduler ranks, and on node 0 the tokenizer."""
    targets: List[tuple[str, Callable[..., None], tuple]] = [
        ("scheduler" if rank == 0 else f"scheduler rank {rank}", _scheduler_main, (rank,)) for rank in args.local_ranks
    ]
    if args.node_rank == 0:
        targets.append(("tokenizer", _tokenizer_main, ()))
    return targets


def _tokenizer_main(args: ServerArgs, ready_conn: Any) -> None:
    from minisgl.tokenizer.worker import run_tokenizer_worker

    run_tokenizer_worker(args, ready_conn)


def start_children(args: ServerArgs, children: List[Child]) -> Dict[str, Any]:
    """Spawn the workers (appending each to `children` at once, so that the caller can stop them
    whatever happens next) and wait until each is ready. Returns what each reported."""
    ctx = mp.get_context("spawn")
    for name, target, extra in _child_targets(args):
        recv, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=target, args=(args, send, *extra), name=f"minisgl-{name.replace(' ', '-')}", daemon=False)
        proc.start()
        send.close()  # only the child holds the write end: EOF means it died
        children.append(Child(name, proc, recv))
        logger.info("started the %s process (pid %d)", name, proc.pid)

    info: Dict[str, Any] = {}
    waiting = {c.conn: c for c in children}
    sentinels = {c.process.sentinel: c for c in children}
    start = last_progress = time.monotonic()
    while waiting:
        for obj in mp.connection.wait(list(waiting) + list(sentinels), timeout=PROGRESS_EVERY_S):
            child = waiting.pop(obj, None)
            if child is not None:
                try:
                    kind, payload = child.conn.recv()
                except (EOFError, OSError):
                    child.process.join(1.0)
                    raise StartupError(
                        f"the {child.name} process (pid {child.process.pid}) {describe_exit(child.process.exitcode)} "
                        "during start-up (see its log above)"
                    ) from None
                if kind != "ready":
                    raise StartupError(f"the {child.name} process failed to start: {payload}")
                info[child.name] = payload
                logger.info("%s ready after %.1f s", child.name, time.monotonic() - start)
            else:
                dead = sentinels[obj]
                if dead.conn in waiting:
                    continue  # its pipe reports EOF (or the error) next
                dead.process.join(1.0)
                raise StartupError(
                    f"the {dead.name} process (pid {dead.process.pid}) {describe_exit(dead.process.exitcode)} during start-up"
                )
        if waiting and time.monotonic() - last_progress >= PROGRESS_EVERY_S:
            # a long load (a big checkpoint, a GGUF conversion) shows it is alive
            logger.info("still loading after %.0f s: %s", time.monotonic() - start, ", ".join(c.name for c in waiting.values()))
            last_progress = time.monotonic()
    return info


def stop_children(children: List[Child]) -> None:
    alive = [c for c in children if c.process.is_alive()]
    for c in alive:
        try:
            c.process.terminate()
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + TERMINATE_GRACE_S
    for c in alive:
        c.process.join(max(0.0, deadline - time.monotonic()))
    for c in alive:
        if c.process.is_alive():
            logger.warning("the %s process (pid %d) ignored SIGTERM; killing it", c.name, c.process.pid)
            c.process.kill()
            c.process.join(2.0)
    for c in children:
        try:
            c.conn.close()
        except OSError:
            pass


class ChildWatchdog:
    """Calls `on_death(message)` once when any child exits while we serve."""

    def __init__(self, children: List[Child], on_death: Callable[[str], None]) -> None:
        self.children = children
        self.on_death = on_death
        self.failure: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        for c in self.children:
            self._loop.add_reader(c.process.sentinel, self._check)
        self._check()

    def stop(self) -> None:
        if self._loop is not None:
            for c in self.children:
                try:
                    self._loop.remove_reader(c.process.sentinel)
                except (ValueError, OSError):
                    pass

    def _check(self) -> None:
        if self.failure is not None:
            return
        for c in self.children:
            if c.process.exitcode is not None:
                self.failure = (
                    f"the {c.name} process (pid {c.process.pid}) {describe_exit(c.process.exitcode)} unexpectedly; the server shuts down"
                )
                self.stop()
                self.on_death(self.failure)
                return
