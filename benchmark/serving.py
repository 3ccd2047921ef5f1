"""Online serving benchmark (in the style of SGLang's bench_serving and `vllm bench serve`).

Targets a running OpenAI-compatible server (`--base-url`); starts nothing. For each request rate
of `--request-rates` (Poisson arrivals, seeded; `inf` sends everything at once), bounded by
`--max-concurrency` requests in flight, it streams every request and reports: completed/failed,
request throughput, output and total token throughput, TTFT / ITL / E2E / TPOT percentiles, the
burstiness of the SSE arrivals, and the most requests the server ran at once (/metrics).

    python -m minisgl --model benchmark/models/qwen3-0.6b --load-format dummy --skip-tokenizer-init &
    python benchmark/serving.py --workload random-ids --num-requests 256 --max-input 1024 \\
        --max-output 1024 --request-rates inf,30,60 --max-concurrency 256 --output out.json --plot lat.png

Workloads:
  random-ids  the offline recipe of benchmark/offline.py, call for call (random.seed(0): N prompts
              of randint(min_input, max_input) ids in [0, 10000], then N max_tokens of
              randint(min_output, max_output)); temperature 0.6, ignore_eos; /v1/completions with
              token-id prompts, so it also runs against --skip-tokenizer-init.
  chat        a synthetic ShareGPT-shaped mix (no dataset can be downloaded): prompt and output
              lengths from log-normal fits of ShareGPT's (median ~ 180 / 200 tokens, long tails,
              clipped); prompts are words of a fixed list (~1.3 tokens a word); one to three turns;
              /v1/chat/completions with max_tokens the drawn length, or none (`--chat-max-tokens
              none`: the model decides, up to the context).

Token counts are exact: each chunk's `token_ids` (the request asks `return_token_ids`, as vLLM's
API names it) and the final usage chunk (`stream_options.include_usage`) are both read and must
agree (a mismatch is reported). ITL is the gap between consecutive chunks that carry tokens, as
both SGLang and vLLM define it; TPOT is (E2E - TTFT) / (output tokens - 1).

Burstiness: the SSE path is healthy when every chunk arrives on its own, one engine step apart.
When the server's API path falls behind the engine, chunks pile up and arrive back to back:
`gaps_below_0_1ms` is the share of a stream's inter-chunk gaps under 0.1 ms (chunks read in
the same socket read), `itl_p99_over_p50` how far the tail is from the median, and
`tokens_per_chunk` how many tokens a chunk carries on average (above 1: coalesced).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serving_http import request, sse_events  # noqa: E402

WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at which but have an they you were "
    "her she there been one all we their has would when if so no what up out who them some time can only new into "
    "system model server request token stream latency memory python kernel cache batch answer question explain write"
).split()


@dataclass
class Req:
    body: Dict[str, Any]  # without stream fields
    path: str
    prompt_len: int  # planned (random-ids: exact; chat: approximate)
    max_tokens: int | None


@dataclass
class Outcome:
    ok: bool = False
    error: str = ""
    start: float = 0.0
    ttft: float = 0.0
    e2e: float = 0.0
    chunk_times: List[float] = field(default_factory=list)  # arrival of each chunk with tokens
    chunk_tokens: List[int] = field(default_factory=list)
    output_tokens: int = 0  # sum of token_ids over chunks
    usage_completion: int | None = None
    usage_prompt: int | None = None


# ---- workloads -------------------------------------------------------------------------------


def random_ids(args: argparse.Namespace) -> List[Req]:
    """benchmark/offline.py's make_requests, call for call."""
    rng = random.Random(0)
    top = min(10000, args.vocab_size - 1)
    prompts = [[rng.randint(0, top) for _ in range(rng.randint(args.min_input, args.max_input))] for _ in range(args.num_requests)]
    max_tokens = [rng.randint(args.min_output, args.max_output) for _ in range(args.num_requests)]
    return [
        Req({"prompt": p, "max_tokens": m, "temperature": args.temperature, "ignore_eos": True}, "/v1/completions", len(p), m)
        for p, m in zip(prompts, max_tokens)
    ]


def _lognormal(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, round(rng.lognormvariate(math.log(median), sigma)))))


def _words(rng: random.Random, tokens: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(max(1, round(tokens / 1.3))))


def chat_mix(args: argparse.Namespace) -> List[Req]:
    """ShareGPT-shaped: log-normal lengths, a system prompt on a third, up to three turns."""
    rng = random.Random(args.seed)
    reqs = []
    for _ in range(args.num_requests):
        prompt_len = _lognormal(rng, 180, 1.0, 4, args.max_input)
        out_len = _lognormal(rng, 200, 0.9, 4, args.max_output)
        turns = rng.choice((1, 1, 1, 2, 3))
        messages: List[Dict[str, str]] = []
        if rng.random() < 0.33:
            messages.append({"role": "system", "content": "You are a helpful assistant."})
        for t in range(turns):
            share = prompt_len // turns
            messages.append({"role": "user", "content": _words(rng, share)})
            if t < turns - 1:
                messages.append({"role": "assistant", "content": _words(rng, min(share, 64))})
        body: Dict[str, Any] = {"messages": messages, "temperature": args.temperature}
        if args.chat_max_tokens == "sampled":
            body["max_tokens"] = out_len
        if args.ignore_eos:
            body["ignore_eos"] = True
        reqs.append(Req(body, "/v1/chat/completions", prompt_len, out_len if args.chat_max_tokens == "sampled" else None))
    return reqs


# ---- one request -----------------------------------------------------------------------------


def _tokens_of(event: Dict[str, Any]) -> int:
    return sum(len(c.get("token_ids") or []) for c in event.get("choices") or [])


async def send(base_url: str, req: Req, headers: Dict[str, str], timeout: float) -> Outcome:
    out = Outcome(start=time.perf_counter())
    body = {**req.body, "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
    try:
        resp = await request(base_url + req.path, body, headers, timeout)
        try:
            if resp.status != 200:
                out.error = f"HTTP {resp.status}: {(await resp.read())[:300].decode(errors='replace')}"
                return out
            async for t, events in sse_events(resp):
                tokens = 0
                for ev in events:
                    if "error" in ev:
                        out.error = json.dumps(ev["error"])[:300]
                        return out
                    tokens += _tokens_of(ev)
                    if ev.get("usage"):
                        out.usage_completion = ev["usage"].get("completion_tokens")
                        out.usage_prompt = ev["usage"].get("prompt_tokens")
                if tokens:
                    if not out.chunk_times:
                        out.ttft = t - out.start
                    out.chunk_times.append(t)
                    out.chunk_tokens.append(tokens)
                    out.output_tokens += tokens
        finally:
            resp.close()
    except Exception as exc:  # counted as failed, the run goes on
        out.error = f"{type(exc).__name__}: {exc}"
        return out
    out.e2e = time.perf_counter() - out.start
    out.ok = out.output_tokens > 0
    if not out.ok:
        out.error = "no tokens"
    return out


# ---- one run ---------------------------------------------------------------------------------


async def _metrics(base_url: str) -> Dict[str, float]:
    resp = await request(base_url + "/metrics", timeout=10)
    try:
        text = (await resp.read()).decode()
    finally:
        resp.close()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            try:
                values[name] = float(value)
            except ValueError:
                pass
    return values


async def _watch_metrics(base_url: str, peak: Dict[str, float], stop: asyncio.Event) -> None:
    """The most requests running / waiting at once, from the scheduler's /metrics gauges."""
    while not stop.is_set():
        try:
            m = await _metrics(base_url)
            for key in ("minisgl_num_running_requests", "minisgl_num_waiting_requests", "minisgl_http_requests_in_flight"):
                if key in m:
                    peak[key] = max(peak.get(key, 0.0), m[key])
        except Exception:
            pass
        try:
            await asyncio.wait_for(stop.wait(), 0.25)
        except asyncio.TimeoutError:
            pass


async def _watch_lag(lags: List[float], stop: asyncio.Event, period: float = 0.005) -> None:
    """How late this client's event loop wakes up: when it is busy (parsing 256 streams on a
    shared CPU), chunks wait in the socket and look bursty; a large lag says the client, not the
    server, is the bottleneck."""
    while not stop.is_set():
        t = time.perf_counter()
        await asyncio.sleep(period)
        lags.append(max(0.0, time.perf_counter() - t - period))


async def wait_idle(base_url: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            m = await _metrics(base_url)
            if m.get("minisgl_num_running_requests", 0) == 0 and m.get("minisgl_num_waiting_requests", 0) == 0:
                return
        except Exception:
            return  # not a minisgl server: nothing to wait for
        await asyncio.sleep(0.2)


async def run_once(args: argparse.Namespace, reqs: List[Req], rate: float, headers: Dict[str, str]) -> Dict[str, Any]:
    rng = random.Random(args.seed + 1)
    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    peak: Dict[str, float] = {}
    stop = asyncio.Event()
    watcher = asyncio.create_task(_watch_metrics(args.base_url, peak, stop))
    lags: List[float] = []
    lag_watcher = asyncio.create_task(_watch_lag(lags, stop))

    async def one(req: Req) -> Outcome:
        if sem is None:
            return await send(args.base_url, req, headers, args.timeout)
        async with sem:
            return await send(args.base_url, req, headers, args.timeout)

    start = time.perf_counter()
    tasks = []
    for req in reqs:
        tasks.append(asyncio.create_task(one(req)))
        if rate != math.inf:
            await asyncio.sleep(rng.expovariate(rate))
    outcomes = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    stop.set()
    await watcher
    await lag_watcher
    result = summarize(outcomes, reqs, duration, rate, args.max_concurrency, peak)
    result["client_lag_ms"] = _pct(lags)
    return result


def _pct(values: List[float], scale: float = 1000.0) -> Dict[str, float]:
    if not values:
        return {}
    v = sorted(values)

    def q(p: float) -> float:
        return v[min(len(v) - 1, max(0, math.ceil(p * len(v)) - 1))] * scale

    return {"mean": sum(v) / len(v) * scale, "p50": q(0.5), "p90": q(0.9), "p99": q(0.99), "max": v[-1] * scale}


def summarize(
    outs: List[Outcome], reqs: List[Req], duration: float, rate: float, max_conc: int | None, peak: Dict[str, float]
) -> Dict[str, Any]:
    ok = [o for o in outs if o.ok]
    itl = [b - a for o in ok for a, b in zip(o.chunk_times, o.chunk_times[1:])]
    tpot = [(o.e2e - o.ttft) / (o.output_tokens - 1) for o in ok if o.output_tokens > 1]
    out_tokens = sum(o.output_tokens for o in ok)
    prompt_tokens = sum(o.usage_prompt if o.usage_prompt is not None else r.prompt_len for o, r in zip(outs, reqs) if o.ok)
    mismatched = sum(1 for o in ok if o.usage_completion is not None and o.usage_completion != o.output_tokens)
    itl_ms = _pct(itl)
    chunks = sum(len(o.chunk_tokens) for o in ok)
    return {
        "request_rate": "inf" if rate == math.inf else rate,
        "max_concurrency": max_conc,
        "completed": len(ok),
        "failed": len(outs) - len(ok),
        "errors": sorted({o.error for o in outs if not o.ok})[:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (out_tokens + prompt_tokens) / duration,
        "output_tokens": out_tokens,
        "prompt_tokens": prompt_tokens,
        "usage_mismatches": mismatched,  # choices whose usage disagrees with the streamed token ids
        "ttft_ms": _pct([o.ttft for o in ok]),
        "itl_ms": itl_ms,
        "tpot_ms": _pct(tpot),
        "e2e_ms": _pct([o.e2e for o in ok]),
        "burstiness": {
            "gaps_below_0_1ms": (sum(1 for g in itl if g < 1e-4) / len(itl)) if itl else 0.0,
            "itl_p99_over_p50": (itl_ms["p99"] / itl_ms["p50"]) if itl_ms and itl_ms["p50"] > 0 else None,
            "tokens_per_chunk": out_tokens / chunks if chunks else 0.0,
        },
        "max_running_requests": peak.get("minisgl_num_running_requests"),
        "max_waiting_requests": peak.get("minisgl_num_waiting_requests"),
        "max_http_in_flight": peak.get("minisgl_http_requests_in_flight"),
    }


# ---- report ----------------------------------------------------------------------------------


def print_run(r: Dict[str, Any]) -> None:
    def f(d: Dict[str, float]) -> str:
        return " / ".join(f"{d.get(k, float('nan')):.1f}" for k in ("p50", "p90", "p99", "max")) if d else "-"

    b = r["burstiness"]
    print(
        f"rate {r['request_rate']} conc {r['max_concurrency']}: {r['completed']} ok, {r['failed']} failed in {r['duration_s']:.1f} s; "
        f"{r['request_throughput']:.2f} req/s, {r['output_throughput']:.1f} out tok/s, {r['total_token_throughput']:.1f} tok/s\n"
        f"  TTFT ms p50/p90/p99/max {f(r['ttft_ms'])}; ITL {f(r['itl_ms'])}; E2E {f(r['e2e_ms'])}; TPOT p50 "
        f"{r['tpot_ms'].get('p50', float('nan')):.1f}\n"
        f"  burstiness: {b['gaps_below_0_1ms'] * 100:.1f}% gaps < 0.1 ms, ITL p99/p50 {b['itl_p99_over_p50'] or float('nan'):.1f}, "
        f"{b['tokens_per_chunk']:.2f} tokens/chunk; max running {r['max_running_requests']}, waiting {r['max_waiting_requests']}, "
        f"HTTP in flight {r['max_http_in_flight']}; client loop lag p99 {r['client_lag_ms'].get('p99', float('nan')):.1f} ms"
        + (f"; usage mismatches {r['usage_mismatches']}" if r["usage_mismatches"] else "")
        + (f"\n  errors: {r['errors']}" if r["errors"] else ""),
        flush=True,
    )


def plot(runs: List[Dict[str, Any]], path: str, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)", file=sys.stderr)
        return
    # offered load on the x axis, in order (inf last); the achieved rate is in the tick labels
    runs = sorted(runs, key=lambda r: math.inf if r["request_rate"] == "inf" else float(r["request_rate"]))
    x = list(range(len(runs)))
    ticks = [f"{r['request_rate']}\n({r['request_throughput']:.2f})" for r in runs]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, key, name in zip(axes, ("ttft_ms", "itl_ms", "e2e_ms"), ("TTFT", "ITL", "E2E")):
        for q, style in (("p50", "o-"), ("p90", "^:"), ("p99", "s--")):
            ax.plot(x, [r[key].get(q, float("nan")) for r in runs], style, label=q)
        ax.set_xticks(x, ticks, fontsize=8)
        ax.set_xlabel("offered requests/s (achieved)")
        ax.set_ylabel(f"{name} (ms)")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


# ---- main ------------------------------------------------------------------------------------


def parse_rates(text: str) -> List[float]:
    return [math.inf if t.strip().lower() in ("inf", "infinity") else float(t) for t in text.split(",") if t.strip()]


async def amain(args: argparse.Namespace) -> Dict[str, Any]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    load_start = os.getloadavg()
    if args.vocab_size is None:
        try:
            resp = await request(args.base_url + "/server_info", headers=headers, timeout=10)
            info = await resp.json()
            resp.close()
            args.vocab_size = int(info["limits"]["vocab_size"])
        except Exception:
            args.vocab_size = 32000  # not a minisgl server: the recipe's ids stay below 10000 anyway
    reqs = random_ids(args) if args.workload == "random-ids" else chat_mix(args)
    for _ in range(args.warmup):
        await send(args.base_url, Req({**reqs[0].body, "max_tokens": 4}, reqs[0].path, 0, 4), headers, args.timeout)
    runs = []
    for rate in parse_rates(args.request_rates):
        await wait_idle(args.base_url)
        r = run_once(args, reqs, rate, headers)
        result = await r
        print_run(result)
        runs.append(result)
    return {
        "workload": args.workload,
        "base_url": args.base_url,
        "num_requests": args.num_requests,
        "args": {k: v for k, v in vars(args).items() if k not in ("api_key",)},
        "host": platform.node(),
        "load_average_start": load_start,  # a shared machine's other work shows here
        "load_average": os.getloadavg(),
        "runs": runs,
    }


def main(argv: List[str] | None = None) -> Dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:1919")
    ap.add_argument("--api-key", default=os.environ.get("MINISGL_API_KEY"))
    ap.add_argument("--workload", choices=["random-ids", "chat"], default="random-ids")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--min-input", type=int, default=100, help="random-ids: shortest prompt (the recipe: 100)")
    ap.add_argument("--max-input", type=int, default=1024)
    ap.add_argument("--min-output", type=int, default=100, help="random-ids: fewest output tokens (the recipe: 100)")
    ap.add_argument("--max-output", type=int, default=1024)
    ap.add_argument("--request-rates", default="inf", help="comma-separated requests/s (Poisson arrivals); inf: all at once")
    ap.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most (default: unbounded)")
    ap.add_argument("--chat-max-tokens", choices=["sampled", "none"], default="sampled", help="chat: send the drawn max_tokens, or none")
    ap.add_argument("--ignore-eos", action="store_true", help="chat: generate the full max_tokens")
    ap.add_argument("--temperature", type=float, default=0.6, help="sampling temperature (the recipe: 0.6)")
    ap.add_argument("--vocab-size", type=int, default=None, help="default: from /server_info")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=1, help="short requests sent before the runs")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for a response's headers")
    ap.add_argument("--output", default=None, help="write the results as JSON here")
    ap.add_argument("--plot", default=None, help="write a latency-vs-load PNG here (needs matplotlib)")
    ap.add_argument("--replot", default=None, help="plot the runs of this --output JSON instead of running anything")
    args = ap.parse_args(argv)
    if args.replot:
        with open(args.replot) as fh:
            results = json.load(fh)
        plot(
            results["runs"],
            args.plot or args.replot.removesuffix(".json") + ".png",
            f"{results['workload']}, {results['num_requests']} requests",
        )
        return results
    results = asyncio.run(amain(args))
    if args.output:
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        with open(args.output, "w") as fh:
            json.dump(results, fh, indent=1)
        print(f"results: {args.output}")
    if args.plot:
        plot(results["runs"], args.plot, f"{args.workload}, {args.num_requests} requests, {args.base_url}")
    return results


if __name__ == "__main__":
    main()
