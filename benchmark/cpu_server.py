"""The server on CPU: N concurrent streaming chat completions on the embedded model.

    python benchmark/cpu_server.py                 # 16 streams x 128 tokens, EOS ignored
    python benchmark/cpu_server.py --streams 16 --max-tokens 128 --extra "--dtype bfloat16"

Starts `python -m minisgl` (the embedded SmolLM2-135M, CPU), waits for /health, warms up with one
request, then opens --streams streaming /v1/chat/completions at once and reports output tok/s
over the wall time of the whole burst, the mean per-stream rate and TTFT, and the load average
(docs/PERFORMANCE.md: only runs on a quiet machine are measurements).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import socket
import subprocess
import sys
import time
from typing import Any, Dict, List

import httpx

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUESTIONS = [
    "What is the capital of France?", "Name three primary colors.", "Explain photosynthesis briefly.",
    "Write a haiku about the sea.", "What is 17 times 23?", "Give me a tip for learning Python.",
    "Why is the sky blue?", "Describe a cat in one paragraph.",
]  # fmt: skip


MODEL: List[str] = ["default"]  # replaced by the served id from /v1/models


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _stream(client: httpx.AsyncClient, url: str, question: str, max_tokens: int) -> Dict[str, float]:
    body = {"model": MODEL[0], "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "ignore_eos": True}  # fmt: skip
    t0 = time.perf_counter()
    first, chunks = None, 0
    async with client.stream("POST", url, json=body, timeout=600) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            delta = json.loads(line[6:])["choices"][0].get("delta", {})
            if delta.get("content"):
                chunks += 1
                first = first or time.perf_counter()
    end = time.perf_counter()
    return {"ttft_s": (first or end) - t0, "wall_s": end - t0, "chunks": chunks}


async def _burst(base: str, n: int, max_tokens: int) -> List[Dict[str, float]]:
    async with httpx.AsyncClient() as client:
        url = base + "/v1/chat/completions"
        await _stream(client, url, QUESTIONS[0], 4)  # warm-up
        return await asyncio.gather(*[_stream(client, url, QUESTIONS[i % len(QUESTIONS)], max_tokens) for i in range(n)])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--extra", default="", help="more server arguments")
    a = p.parse_args()
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "minisgl", "--port", str(port), *shlex.split(a.extra)]
    load0 = os.getloadavg()[0]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server did not start: {' '.join(cmd)}")
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        MODEL[0] = httpx.get(base + "/v1/models", timeout=10).json()["data"][0]["id"]
        t0 = time.perf_counter()
        res = asyncio.run(_burst(base, a.streams, a.max_tokens))
        wall = time.perf_counter() - t0
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
    # one streamed chunk per token (the server streams each token's text delta)
    tokens = a.streams * a.max_tokens
    out: Dict[str, Any] = {
        "streams": a.streams, "max_tokens": a.max_tokens, "wall_s": wall, "tok_s": tokens / wall,
        "mean_stream_tok_s": sum(a.max_tokens / r["wall_s"] for r in res) / len(res),
        "mean_ttft_s": sum(r["ttft_s"] for r in res) / len(res),
        "loadavg_start": load0, "loadavg_end": os.getloadavg()[0],
    }  # fmt: skip
    print(f"{a.streams} concurrent chat streams x {a.max_tokens} tokens: {out['tok_s']:.0f} output tok/s "
          f"({wall:.1f} s), per stream {out['mean_stream_tok_s']:.1f} tok/s, mean TTFT {out['mean_ttft_s'] * 1e3:.0f} ms; "
          f"load {load0:.2f} -> {out['loadavg_end']:.2f}")  # fmt: skip
    print(json.dumps(out))


if __name__ == "__main__":
    main()
