"""The process tree: start the workers, wait until every one is ready, serve, shut down.

    main process: API server (uvicorn + FastAPI) or the shell, plus a watchdog on the children
      ├─ tokenizer worker (minisgl.tokenizer.worker)
      ├─ scheduler rank 0 (minisgl.scheduler.process), owns the Engine
      └─ scheduler rank 1..N-1 with --tp N (follow rank 0's schedule, minisgl/scheduler/tp.py)

With --nnodes K, node R > 0 runs only its tp/K scheduler ranks (no HTTP, no tokenizer).

Children are started with the multiprocessing *spawn* context (fork after torch is unsafe), talk
over ZeroMQ ipc:// sockets in a private temporary folder, and report readiness (or the error that
stopped them) through a pipe. SIGINT/SIGTERM stops the HTTP server gracefully, then the children
are terminated (SIGTERM, SIGKILL after a few seconds); children also die with the parent
(PR_SET_PDEATHSIG) and notice a vanished parent on their own. If a child dies while serving, the
server logs which one and how, fails the requests in flight with 503, and exits with status 1.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Callable, Dict, List

from minisgl.server.args import ServerArgs
from minisgl.server.process_utils import IpcAddrs, configure_logging, describe_exit
from minisgl.utils.logger import init_logger

logger = init_logger("minisgl.server")

TERMINATE_GRACE_S = 5.0

EXIT_OK = 0  # stopped by SIGINT/SIGTERM
EXIT_FAILURE = 1  # a worker failed to start, or died while serving
EXIT_USAGE = 2  # nothing started: bad option, model not found, port unavailable


class ShutdownRequested(BaseException):
    """SIGINT/SIGTERM arrived in the main process."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class StartupError(RuntimeError):
    pass


@dataclass
class Child:
    name: str
    process: Any  # multiprocessing.Process
    conn: Any  # the read end of its ready pipe


def _raise_shutdown(signum: int, frame: Any) -> None:
    raise ShutdownRequested(signum)


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
    start = time.monotonic()
    while waiting:
        for obj in mp.connection.wait(list(waiting) + list(sentinels), timeout=30.0):
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
        if waiting:
            logger.debug("still waiting for: %s", ", ".join(c.name for c in waiting.values()))
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


def _log_banner(args: ServerArgs, info: Dict[str, Any], children: List[Child]) -> None:
    sched = info.get("scheduler", {})
    pids = ", ".join(f"{c.name} pid {c.process.pid}" for c in children)
    logger.info(
        "minisgl ready: model %s (%s, %s on %s, context %s tokens, %s KV pages); processes: API server pid %d, %s",
        args.model_name, args.model_path, sched.get("dtype"), sched.get("device"), sched.get("max_seq_len"),
        sched.get("num_pages"), os.getpid(), pids,
    )  # fmt: skip


class PortInUse(RuntimeError):
    pass


def bind_listener(host: str, port: int) -> socket.socket:
    """Bind the HTTP port now, before the model loads: a port already taken is found in
    milliseconds, not after minutes of loading. uvicorn serves on this socket later."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise PortInUse(f"cannot resolve --host {host!r}: {exc}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise PortInUse(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.set_inheritable(False)
    return sock


def serve_http(args: ServerArgs, info: Dict[str, Any], children: List[Child], listener: socket.socket) -> int:
    import uvicorn

    from minisgl.server.api_server import create_app
    from minisgl.server.frontend import Frontend
    from minisgl.server.metrics import ServerMetrics

    metrics = ServerMetrics()
    sched = info.get("scheduler", {})
    max_pending = int(sched.get("max_running_req") or 0) + args.max_queued_requests
    frontend = Frontend(IpcAddrs.in_dir(args.ipc_dir), metrics, max_pending=max_pending)
    holder: Dict[str, Any] = {}

    def on_death(message: str) -> None:
        logger.error(message)
        frontend.fail_all(message)
        server = holder.get("server")
        if server is not None:
            server.should_exit = True

    watchdog = ChildWatchdog(children, on_death)

    @asynccontextmanager
    async def lifespan(app: Any) -> Any:
        await frontend.start()
        watchdog.start()
        banner = asyncio.create_task(_announce_when_started(holder, args, info, children))
        try:
            yield
        finally:
            banner.cancel()
            watchdog.stop()
            await frontend.close()

    app = create_app(args, info.get("scheduler", {}), frontend, metrics, lifespan=lifespan, tokenizer_info=info.get("tokenizer"))
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=args.log_level == "debug",
        timeout_graceful_shutdown=3,
        timeout_keep_alive=5,
        lifespan="on",
    )
    server = uvicorn.Server(config)
    holder["server"] = server
    server.run(sockets=[listener])
    if watchdog.failure is not None:
        logger.error("exiting with status 1: %s", watchdog.failure)
        return EXIT_FAILURE
    if not server.started:
        logger.error("the HTTP server did not start on %s:%d", args.host, args.port)
        return EXIT_FAILURE
    return EXIT_OK


async def _announce_when_started(holder: Dict[str, Any], args: ServerArgs, info: Dict[str, Any], children: List[Child]) -> None:
    while not getattr(holder.get("server"), "started", False):
        await asyncio.sleep(0.05)
    _log_banner(args, info, children)
    logger.info("serving on http://%s:%d (OpenAI API under /v1)", args.host, args.port)


def serve_follower_node(args: ServerArgs, children: List[Child]) -> int:
    """Node R > 0 of a multi-machine TP server: run this node's ranks until they exit (rank 0
    tells them to when the server stops) or one dies; no HTTP here."""
    logger.info(
        "node %d of %d: TP ranks %s ready, following rank 0 at %s", args.node_rank, args.nnodes,
        args.local_ranks, args.dist_init_addr,
    )  # fmt: skip
    sentinels = {c.process.sentinel: c for c in children}
    while True:
        ready = mp.connection.wait(list(sentinels), timeout=1.0)
        for obj in ready:
            child = sentinels.pop(obj)
            child.process.join(1.0)
            if child.process.exitcode != 0:
                logger.error("the %s process (pid %d) %s; this node shuts down", child.name, child.process.pid,
                             describe_exit(child.process.exitcode))  # fmt: skip
                return 1
        if not sentinels:
            logger.info("every TP rank of this node exited: rank 0 stopped the server")
            return 0


def check_model_files(args: ServerArgs) -> str | None:
    """What the model folder lacks for these options, or None: found now with a hint, rather than
    as a traceback from a worker after the weights have loaded."""
    from minisgl.utils.hf import has_tokenizer_files, has_weight_files

    if args.skip_tokenizer_init and args.tokenizer:
        return "--tokenizer and --skip-tokenizer-init exclude each other: give one"
    if args.skip_tokenizer_init and args.shell:
        return "--shell chats in text: it needs a tokenizer (drop --skip-tokenizer-init)"
    if args.load_format != "dummy" and not has_weight_files(args.model_path):
        return f"the model folder {args.model_path} has no weight files; --load-format dummy serves random weights (benchmarks)"
    if args.skip_tokenizer_init:
        return None
    if args.tokenizer:
        folder = os.path.expanduser(args.tokenizer)
        if os.path.isdir(folder) and not has_tokenizer_files(folder):
            return f"--tokenizer {args.tokenizer}: the folder has no tokenizer files (tokenizer.json, tokenizer_config.json, ...)"
        if not os.path.isdir(folder) and os.path.exists(folder):
            return f"--tokenizer {args.tokenizer} is not a folder"
        return None
    if not has_tokenizer_files(args.model_path):
        return (
            f"the model folder {args.model_path} has no tokenizer; pass --tokenizer FOLDER, "
            "or --skip-tokenizer-init to serve token ids only"
        )
    return None


def launch(args: ServerArgs) -> int:
    """Run the server (or the shell) until a signal or a failure; returns the exit status
    (EXIT_OK, EXIT_FAILURE or EXIT_USAGE; argparse also exits 2 for a bad command line)."""
    configure_logging(args.log_level)
    problem = args.check_tp_layout()
    if problem is not None:
        logger.error("%s", problem)
        return EXIT_USAGE
    rendezvous: Any = None  # held until the server stops: the ranks' store (see host_rendezvous)
    if args.tp > 1 and args.dist_init_addr is None:
        from minisgl.distributed import host_rendezvous

        rendezvous, args.dist_init_addr = host_rendezvous()
        args.dist_store_hosted = True
    listener: socket.socket | None = None
    if not args.shell and args.node_rank == 0:  # follower nodes serve no HTTP
        try:
            listener = bind_listener(args.host, args.port)
        except PortInUse as exc:
            logger.error("%s (is another server running? choose another --port)", exc)
            return EXIT_USAGE
    old_handlers = {sig: signal.signal(sig, _raise_shutdown) for sig in (signal.SIGINT, signal.SIGTERM)}
    children: List[Child] = []
    ipc_dir = tempfile.mkdtemp(prefix="minisgl-")
    try:
        from minisgl.utils.hf import resolve_model_path

        try:
            args.model_path = resolve_model_path(args.model)
        except (FileNotFoundError, ValueError) as exc:
            logger.error("cannot load the model: %s", exc)
            return EXIT_USAGE
        problem = check_model_files(args)
        if problem is not None:
            logger.error("%s", problem)
            return EXIT_USAGE
        args.ipc_dir = ipc_dir
        try:
            info = start_children(args, children)
        except StartupError as exc:
            logger.error("start-up failed: %s", exc)
            return EXIT_FAILURE
        if args.node_rank != 0:
            return serve_follower_node(args, children)
        if args.shell:
            from minisgl.shell import run_shell

            return run_shell(args, info, children)
        assert listener is not None
        return serve_http(args, info, children, listener)
    except ShutdownRequested as exc:
        logger.info("%s received: shutting down", exc)
        return EXIT_OK
    except KeyboardInterrupt:
        return EXIT_OK
    finally:
        if listener is not None:
            listener.close()
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if args.tp > 1 and children and children[0].name == "scheduler":
            stop_children(children[:1])  # TP rank 0 first: it tells the other ranks (other nodes too) to exit
        stop_children(children)
        del rendezvous  # only now: the store outlives every rank
        shutil.rmtree(ipc_dir, ignore_errors=True)
        for sig, handler in old_handlers.items():
            signal.signal(sig, handler)
        logging.getLogger("minisgl").info("shutdown complete")


def main(argv: List[str] | None = None) -> int:
    from minisgl.server.args import parse_args

    return launch(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
