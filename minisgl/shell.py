"""`python -m minisgl --shell`: chat with the model in the terminal.

It starts the same process tree as the HTTP server (tokenizer worker + scheduler) and talks to it
through the same ZeroMQ frontend, without HTTP. The answer streams as it is generated; the
conversation is kept until `/reset`; `/exit` (or Ctrl-D) quits; Ctrl-C stops the current answer.
With a terminal it uses prompt_toolkit (line editing, input history); with piped input it reads
plain lines, so it can be scripted: `printf 'Hi\\n/reset\\nBye\\n' | python -m minisgl --shell`.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import threading
from typing import Any, Dict, List

from minisgl.message import ErrorMsg, TokenizeMsg
from minisgl.sampling_params import SamplingParams
from minisgl.server.children import ChildWatchdog

HELP = "commands: /reset (forget the conversation), /exit (quit); Ctrl-C stops an answer"


def run_shell(args: Any, info: Dict[str, Any], children: List[Any]) -> int:
    return asyncio.run(_shell(args, info, children))


class _LineReader:
    """Lines from a terminal (prompt_toolkit) or from a pipe (a daemon thread: never blocks exit)."""

    def __init__(self, interactive: bool) -> None:
        self.interactive = interactive
        self._session: Any = None
        if interactive:
            from prompt_toolkit import PromptSession
            from prompt_toolkit.history import InMemoryHistory

            self._session = PromptSession(history=InMemoryHistory())
        else:
            self._queue: asyncio.Queue[str | None] = asyncio.Queue()
            loop = asyncio.get_running_loop()

            def pump() -> None:
                for line in sys.stdin:
                    loop.call_soon_threadsafe(self._queue.put_nowait, line)
                loop.call_soon_threadsafe(self._queue.put_nowait, None)

            threading.Thread(target=pump, name="minisgl-shell-stdin", daemon=True).start()

    async def read(self) -> str | None:
        """The next line, or None at end of input."""
        if self._session is not None:
            try:
                return await self._session.prompt_async("> ")
            except EOFError:
                return None
            except KeyboardInterrupt:
                return ""
        line = await self._queue.get()
        if line is not None:
            print(f"> {line.rstrip()}", flush=True)
        return line


async def _shell(args: Any, info: Dict[str, Any], children: List[Any]) -> int:
    from minisgl.server.frontend import Frontend
    from minisgl.server.process_utils import IpcAddrs

    frontend = Frontend(IpcAddrs.in_dir(args.ipc_dir))
    await frontend.start()
    main_task = asyncio.current_task()
    failure: List[str] = []

    def on_death(message: str) -> None:
        failure.append(message)
        frontend.fail_all(message)
        if main_task is not None:
            main_task.cancel()

    watchdog = ChildWatchdog(children, on_death)
    watchdog.start()
    answering: List[asyncio.Task] = []
    loop = asyncio.get_running_loop()

    def on_sigint() -> None:
        if answering and not answering[0].done():
            answering[0].cancel()
        elif main_task is not None:
            main_task.cancel()

    loop.add_signal_handler(signal.SIGINT, on_sigint)
    interactive = sys.stdin.isatty() and sys.stdout.isatty()
    reader = _LineReader(interactive)
    history: List[Dict[str, str]] = []
    context = info.get("scheduler", {}).get("max_seq_len")
    print(f"minisgl shell: {args.model_name} (context {context} tokens). {HELP}", flush=True)
    try:
        while True:
            line = await reader.read()
            if line is None:
                break
            line = line.strip()
            if not line:
                continue
            if line in ("/exit", "/quit"):
                break
            if line == "/reset":
                history.clear()
                print("(conversation reset)", flush=True)
                continue
            if line.startswith("/"):
                print(f"unknown command {line!r}; {HELP}", flush=True)
                continue
            history.append({"role": "user", "content": line})
            sampling = SamplingParams(temperature=args.shell_temperature, max_tokens=args.shell_max_tokens)
            task = asyncio.create_task(_answer(frontend, history, sampling))
            answering[:] = [task]
            # prompt_toolkit removes SIGINT handlers when a prompt ends: install ours again
            loop.add_signal_handler(signal.SIGINT, on_sigint)
            try:
                await asyncio.wait({task})
            except asyncio.CancelledError:  # the shell itself is stopping
                task.cancel()
                raise
            reply: str | None
            error: str | None
            if task.cancelled():  # Ctrl-C stopped this answer
                reply, error = None, "stopped"
            else:
                reply, error = task.result()
            if error is not None:
                print(f"\n[{error}]", flush=True)
                history.pop()  # the question goes unanswered: forget it
            else:
                history.append({"role": "assistant", "content": reply or ""})
    except asyncio.CancelledError:
        if not failure:
            print("", flush=True)
    finally:
        loop.remove_signal_handler(signal.SIGINT)
        watchdog.stop()
        await frontend.close()
    if failure:
        print(f"error: {failure[0]}", file=sys.stderr, flush=True)
        return 1
    return 0


async def _answer(frontend: Any, history: List[Dict[str, str]], sampling: SamplingParams) -> tuple[str | None, str | None]:
    msg = TokenizeMsg(uid=frontend.new_uid(), messages=list(history), sampling=sampling)
    try:
        stream = frontend.submit([msg])
    except RuntimeError as exc:  # Unavailable or Overloaded
        return None, str(exc)
    parts: List[str] = []
    try:
        while True:
            _, out = await stream.next()
            if isinstance(out, ErrorMsg):
                hint = " (try /reset)" if "context" in out.message else ""
                return None, f"error: {out.message}{hint}"
            print(out.text, end="", flush=True)
            parts.append(out.text)
            if out.finished:
                print(flush=True)
                return "".join(parts), None
    except asyncio.CancelledError:
        stream.abort()
        raise
