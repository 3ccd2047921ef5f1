"""Where the device time of a run goes: a torch.profiler (CUPTI) trace reduced to a summary.

    from gpu_timeline import traced  # (benchmark/ is on sys.path when a benchmark script runs)
    result, summary = traced(lambda: llm.generate(...))   # CUDA only

The summary answers the questions the offline benchmark raises: how long the GPU was busy
(union of kernel and copy intervals) versus the wall span, how much of the idle time sits in
long gaps (the host not keeping up: eager prefill launches, per-step scheduling), and which
kernels and kernel families take the busy time. Tracing slows the host down (each launch is
recorded), so the idle figures are upper bounds; the kernel durations are exact.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections import defaultdict
from typing import Any, Callable, Dict, List, Tuple

# kernel family by name (first match wins); names come from cuBLAS/CUTLASS, Triton and torch
FAMILIES: Tuple[Tuple[str, str], ...] = (
    ("prologue", r"prologue"),
    ("attention", r"_decode|_extend|attn|flash|BatchDecode|BatchPrefill|reduce_splits"),
    ("norm", r"rmsnorm|rms_norm"),
    ("silu", r"silu"),
    ("rotary", r"rope"),
    ("moe", r"moe"),
    ("gemm", r"gemm|cutlass|sm90_|nvjet|cublas|Kernel2|splitKreduce"),
    ("sampling", r"softmax|cumsum|scan|searchsorted|gumbel|argmax|sort|topk|sampl|rand|philox|distribution"),
    ("index/copy", r"index|gather|scatter|copy|cat|fill|elementwise|vectorized|unrolled|reduce"),
)


def family(name: str) -> str:
    for fam, pattern in FAMILIES:
        if re.search(pattern, name, re.IGNORECASE):
            return fam
    return "other"


def _merge(intervals: List[Tuple[float, float]]) -> List[Tuple[float, float]]:
    merged: List[Tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            if end > merged[-1][1]:
                merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged


def summarize(trace: Dict[str, Any], top: int = 20) -> Dict[str, Any]:
    """Reduce a chrome trace (torch.profiler export) to busy/idle time, gaps and kernel shares (µs)."""
    device_events = [
        e for e in trace.get("traceEvents", [])
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
    ]  # fmt: skip
    if not device_events:
        return {"error": "no device events in the trace (CUDA activity not recorded)"}
    intervals = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in device_events]
    merged = _merge(intervals)
    span = merged[-1][1] - merged[0][0]
    busy = sum(end - start for start, end in merged)
    gaps = [merged[i + 1][0] - merged[i][1] for i in range(len(merged) - 1)]
    buckets = {"<10us": (0.0, 10.0), "10-100us": (10.0, 100.0), "0.1-1ms": (100.0, 1000.0), ">=1ms": (1000.0, 1e18)}
    gap_summary = {
        label: {"count": sum(lo <= g < hi for g in gaps), "total_ms": round(sum(g for g in gaps if lo <= g < hi) / 1e3, 2)}
        for label, (lo, hi) in buckets.items()
    }
    by_name: Dict[str, List[float]] = defaultdict(list)
    by_family: Dict[str, float] = defaultdict(float)
    for e in device_events:
        name = e.get("name", "?") if e.get("cat") == "kernel" else e.get("cat", "?")
        by_name[name].append(float(e["dur"]))
        by_family[family(name) if e.get("cat") == "kernel" else "memcpy/memset"] += float(e["dur"])
    kernels = sorted(((sum(d), len(d), n) for n, d in by_name.items()), reverse=True)[:top]
    return {
        "span_ms": round(span / 1e3, 2),
        "busy_ms": round(busy / 1e3, 2),
        "idle_ms": round((span - busy) / 1e3, 2),
        "busy_fraction": round(busy / span, 4) if span else 0.0,
        "device_events": len(device_events),
        "gaps": gap_summary,
        "families_ms": {k: round(v / 1e3, 2) for k, v in sorted(by_family.items(), key=lambda kv: -kv[1])},
        "top_kernels": [{"name": n[:90], "total_ms": round(t / 1e3, 2), "count": c, "mean_us": round(t / c, 2)} for t, c, n in kernels],
    }


def format_summary(s: Dict[str, Any]) -> str:
    if "error" in s:
        return f"timeline: {s['error']}"
    lines = [
        f"device timeline: span {s['span_ms']:.1f} ms, busy {s['busy_ms']:.1f} ms ({100 * s['busy_fraction']:.1f}%), "
        f"idle {s['idle_ms']:.1f} ms",
        "idle gaps: " + ", ".join(f"{k}: {v['count']} = {v['total_ms']} ms" for k, v in s["gaps"].items()),
        "busy by family (ms): " + ", ".join(f"{k} {v}" for k, v in s["families_ms"].items()),
        "top kernels:",
    ]
    lines += [f"  {k['total_ms']:9.2f} ms {k['count']:8d} x {k['mean_us']:8.2f} us  {k['name']}" for k in s["top_kernels"]]
    return "\n".join(lines)


def traced(fn: Callable[[], Any], save_trace: str | None = None) -> Tuple[Any, Dict[str, Any]]:
    """Run fn under torch.profiler with CUDA activity only; returns (fn's result, summary)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        result = fn()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    finally:
        if save_trace:
            os.replace(path, save_trace)
        else:
            os.unlink(path)
    return result, summarize(trace)
