"""Where one decode step's device time goes: the kernels of a CUDA-graph replay, by name.

    PYTHONPATH=. python3 tools/step_profile.py --batch-sizes 1,64 [--out DIR]

Qwen3-0.6B shape, dummy bf16 weights, context 600 per request (as benchmark/latency.py), the
Engine driven directly; torch.profiler (CUPTI) over 20 steps of each batch size; prints per kernel
name the calls per step and the device µs per step, and the step's span (first kernel start to
last kernel end) against the sum of kernel times (the rest is launch gaps inside the graph).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict
from typing import Any, Dict, List

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmark"))  # latency.py's decode step

from latency import decode_step_time  # noqa: E402

from minisgl.distributed import DistributedInfo  # noqa: E402
from minisgl.engine import Engine, EngineConfig  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=os.path.join(ROOT, "benchmark", "models", "qwen3-0.6b"))
    ap.add_argument("--batch-sizes", default="1,64")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    sizes = [int(v) for v in a.batch_sizes.split(",")]
    cfg = EngineConfig(
        model_path=a.model, tp_info=DistributedInfo(0, 1), dtype=torch.bfloat16, device="cuda",
        use_dummy_weight=True, max_running_req=max(sizes), cuda_graph_bs=sizes, max_seq_len_override=1024,
        num_page_override=max(sizes) * 1024 + 4096,
    )  # fmt: skip
    engine = Engine(cfg)
    plan = getattr(engine, "skinny_plan", None)
    summary: Dict[str, Any] = {"skinny_plan": plan.timings if plan is not None else None, "steps": []}
    if plan is not None:
        for t in plan.timings:
            print(f"plan {t['kind']:6s} {t['n']:6d}x{t['k']:<6d} m={t['m']:<3d} fused {t['fused_us']:6.2f} us "
                  f"module {t['module_us']:6.2f} us -> {'fused' if t['fused'] else 'module'}")  # fmt: skip
    for bs in sizes:
        step_s = decode_step_time(engine, bs, 600, 50)
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            decode_step_time(engine, bs, 600, a.steps)
        events = [e for e in prof.events() if e.device_type.name == "CUDA" and e.device_time > 0]
        by: Dict[str, List[float]] = defaultdict(list)
        for e in events:
            by[e.name].append(e.device_time)
        n = a.steps + 3
        total = sum(sum(v) for v in by.values()) / n
        print(f"\n== batch {bs}: step {step_s * 1e3:.3f} ms (host loop), kernels {total:.1f} us/step, {len(events) / n:.0f} kernels/step")
        rows = sorted(by.items(), key=lambda kv: -sum(kv[1]))
        for name, ts in rows[:25]:
            print(f"  {sum(ts) / n:8.1f} us/step {len(ts) / n:6.1f} calls/step {sum(ts) / len(ts):7.2f} us/call  {name[:110]}")
        summary["steps"].append({"batch": bs, "step_ms": step_s * 1e3, "kernel_us_per_step": total,
                                 "kernels_per_step": len(events) / n,
                                 "top": [(name[:120], sum(ts) / n, len(ts) / n) for name, ts in rows[:25]]})  # fmt: skip
    if a.out:
        with open(os.path.join(a.out, "step_profile.json"), "w") as f:
            json.dump(summary, f, indent=1)
    engine.shutdown()


if __name__ == "__main__":
    main()
