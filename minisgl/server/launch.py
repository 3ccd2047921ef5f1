"""The process tree: start the workers, wait until every one is ready, serve, shut down.

    main process: API server (uvicorn + FastAPI) or the shell, plus a watchdog on the children
      ├─ tokenizer worker (minisgl.tokenizer.worker)
      ├─ scheduler rank 0 (minisgl.scheduler.process), owns the Engine
      └─ scheduler rank 1..N-1 with --tp N (follow rank 0's schedule, minisgl/scheduler/tp.py)

With --nnodes K, node R > 0 runs only its tp/K scheduler ranks (no HTTP, no tokenizer).

The children (server/children.py: spawned, each reporting readiness through a pipe) talk over
ZeroMQ ipc:// sockets in a private temporary folder. SIGINT/SIGTERM drains the HTTP server
(server/drain.py: 503 to new requests, --shutdown-timeout for those in flight), then the children
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
from contextlib import asynccontextmanager
from typing import Any, Dict, List

from minisgl.server.args import ServerArgs
from minisgl.server.children import Child, ChildWatchdog, StartupError, start_children, stop_children
from minisgl.server.loading import LoadingResponder
from minisgl.server.process_utils import IpcAddrs, configure_logging, describe_exit
from minisgl.utils.logger import init_logger

logger = init_logger("minisgl.server")

EXIT_OK = 0  # stopped by SIGINT/SIGTERM
EXIT_FAILURE = 1  # a worker failed to start, or died while serving
EXIT_USAGE = 2  # nothing started: bad option, model not found, port unavailable


class ShutdownRequested(BaseException):
    """SIGINT/SIGTERM arrived in the main process."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_shutdown(signum: int, frame: Any) -> None:
    raise ShutdownRequested(signum)


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
    from minisgl.server.drain import DrainingServer
    from minisgl.server.frontend import Frontend
    from minisgl.server.metrics import ServerMetrics

    metrics = ServerMetrics(args.model_name)
    tracing = None
    if args.otlp_traces_endpoint is not None:
        from minisgl.server.tracing import Tracing

        tracing = Tracing(args.otlp_traces_endpoint, args.model_name)
        logger.info("tracing: a span per generation request goes to %s (OTLP/HTTP, batched)", args.otlp_traces_endpoint)
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

    app = create_app(
        args, info.get("scheduler", {}), frontend, metrics, lifespan=lifespan, tokenizer_info=info.get("tokenizer"), tracing=tracing
    )
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=args.log_level == "debug",
        timeout_graceful_shutdown=5,  # after the drain (server/drain.py): only closing connections is left
        timeout_keep_alive=5,
        lifespan="on",
    )
    server = DrainingServer(config, frontend, args.shutdown_timeout)
    holder["server"] = server
    try:
        server.run(sockets=[listener])
    finally:
        if tracing is not None:
            tracing.shutdown()  # the spans of the drained requests, a few seconds at most
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
    if not args.engine_value("use_dummy_weight") and not has_weight_files(args.model_path):
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


def check_tp_fits(args: ServerArgs) -> str | None:
    """Why the model's heads and MLP cannot be split over --tp ranks (the fitting values named), or
    None: checked here, before any process starts, not as a traceback from a started rank."""
    if args.tp == 1:
        return None
    from minisgl.engine.engine import check_tp_size
    from minisgl.models import ModelConfig
    from minisgl.utils.hf import cached_load_hf_config

    try:
        check_tp_size(ModelConfig.from_hf(cached_load_hf_config(args.model_path)), args.tp)
    except ValueError as exc:
        return f"--tp {args.tp}: {exc}"
    return None


def launch(args: ServerArgs) -> int:
    """Run the server (or the shell) until a signal or a failure; returns the exit status
    (EXIT_OK, EXIT_FAILURE or EXIT_USAGE; argparse also exits 2 for a bad command line)."""
    configure_logging(args.log_level)
    problem = args.check_tp_layout()
    if problem is None and args.otlp_traces_endpoint is not None and args.node_rank == 0:
        from minisgl.server.tracing import missing_packages

        problem = missing_packages()
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
    # from now until the workers are ready, the port answers 503 (server/loading.py)
    loading = LoadingResponder(listener).start() if listener is not None else None
    try:
        from minisgl.utils.hf import resolve_model_path

        try:
            args.model_path = resolve_model_path(args.model)
        except (FileNotFoundError, ValueError) as exc:
            logger.error("cannot load the model: %s", exc)
            return EXIT_USAGE
        problem = check_model_files(args) or check_tp_fits(args)
        if problem is not None:
            logger.error("%s", problem)
            return EXIT_USAGE
        args.ipc_dir = ipc_dir
        try:
            info = start_children(args, children)
        except StartupError as exc:
            logger.error("start-up failed: %s", exc)
            return EXIT_FAILURE
        finally:
            if loading is not None:
                loading.stop()  # before uvicorn (or the shell) takes over
        if args.node_rank != 0:
            return serve_follower_node(args, children)
        if args.shell and info.get("scheduler", {}).get("task") == "embed":
            logger.error("--shell chats: it needs the generate task, and this model runs the embed task (serve /v1/embeddings)")
            return EXIT_USAGE
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
        if loading is not None:
            loading.stop()
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
