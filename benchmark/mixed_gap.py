"""How long a decoding stream stalls while long prompts arrive (issue 13, mixed batches).

One stream decodes; after its 100th token four 1,500-token prompts arrive. Reports the stream's
median inter-token gap, its longest gap while the prompts prefill, and their ratio, with mixed
batches (chunks of --chunk tokens ride along with the decode rows) and without (prefill and
decode alternate, one budget-sized prefill step at a time). Measured in the scheduler, where the
tokens are made.

  python benchmark/mixed_gap.py [--model PATH] [--chunk 16,32,64] [--stream-tokens 800] [--dtype bfloat16]
  python benchmark/mixed_gap.py --defaults 64:3,16:2.5   # the server's step budget, per FLOOR:AUTO_FACTOR

The last line printed is the JSON of every run (tests/test_retraction.py reads it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any, Dict, List


def run(
    model: str, chunk: int, mixed: bool, dtype: Any, device: str, stream_tokens: int = 300, budget: bool = False,
    arrive_at: int = 100, prompt_len: int = 1500,
) -> Dict[str, float]:  # fmt: skip
    """`budget`: the server's defaults (the step budget of --max-step-ms on; `chunk` is then the
    chunked-prefill size it caps), else a fixed chunk with the budget off."""
    from minisgl.core import SamplingParams
    from minisgl.distributed import DistributedInfo
    from minisgl.scheduler import Scheduler, SchedulerConfig, UserRequest

    sched = Scheduler(
        SchedulerConfig(
            model_path=model, tp_info=DistributedInfo(0, 1), dtype=dtype, device=device,
            max_seq_len_override=2048, num_page_override=8192, max_extend_tokens=chunk, mixed_batches=mixed,
            max_step_ms=None if budget else 0.0,
        )
    )  # fmt: skip
    ttft: List[float] = []
    try:
        sched.add_request(UserRequest(0, [1, 2, 3, 4], SamplingParams(temperature=0.0, max_tokens=stream_tokens, ignore_eos=True)))
        times: List[float] = []
        window: List[int] = []
        arrived = 0.0
        while sched.has_work():
            outs = sched.step()
            now = time.perf_counter()
            if any(o.uid == 0 for o in outs):
                times.append(now)
            ttft += [now - arrived for o in outs if o.uid >= 10 and o.token_id is not None]
            if len(times) == arrive_at and not window:
                for i in range(4):
                    prompt = [(7 * i + j) % 5000 + 1 for j in range(prompt_len)]
                    sched.add_request(UserRequest(10 + i, prompt, SamplingParams(temperature=0.0, max_tokens=1)))
                arrived = time.perf_counter()
                window.append(len(times))
            if len(window) == 1 and not any(r.uid >= 10 for r in sched.prefilling) and not sched.waiting:
                window.append(len(times))
    finally:
        sched.shutdown()
    gaps = [b - a for a, b in zip(times, times[1:])]
    # gaps[k] ends at token k + 1: from the gap ending at the first token after the prompts
    # arrived (window[0]) to one step past the last chunk (overlap reads a step late)
    during = gaps[window[0] - 1 : window[1] + 1]
    median = statistics.median(gaps)
    outside = statistics.median(gaps[: window[0] - 1] + gaps[window[1] + 1 :])  # decode-only steps
    return {
        "median_ms": median * 1e3,
        "decode_median_ms": outside * 1e3,
        "max_during_ms": max(during) * 1e3,
        "ratio": max(during) / median,
        "ratio_to_decode_median": max(during) / outside,
        "steps_during": len(during),
        "prompt_ttft_s": [round(t, 3) for t in ttft],
    }


def _defaults(args: argparse.Namespace) -> None:
    import torch

    import minisgl.scheduler.step_budget as step_budget
    from minisgl.utils.hf import resolve_model_path

    model = resolve_model_path(args.model)
    out: Dict[str, Any] = {"model": args.model or "embedded", "loadavg_start": os.getloadavg()[0], "runs": {}}
    for _ in range(args.reps):
        for pair in args.defaults.split(","):
            floor, factor = pair.split(":")
            step_budget.FLOOR, step_budget.AUTO_FACTOR = int(floor), float(factor)
            res = run(model, 8192, True, getattr(torch, args.dtype), args.device, 200, budget=True, arrive_at=20, prompt_len=1400)
            out["runs"].setdefault(pair, []).append(res)
            print(f"defaults, FLOOR {floor}, AUTO_FACTOR {factor}: longest gap {res['max_during_ms']:.0f} ms = {res['ratio']:.2f}x the "
                  f"median {res['median_ms']:.1f} ms; prompts' TTFT {res['prompt_ttft_s']} s", flush=True)  # fmt: skip
    out["loadavg_end"] = os.getloadavg()[0]
    print(json.dumps(out))


def main() -> None:
    import torch

    from minisgl.utils.hf import resolve_model_path

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    ap.add_argument("--chunk", default="16,32,64")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--skip-alternating", action="store_true", help="only the mixed runs")
    ap.add_argument("--stream-tokens", type=int, default=800, help="the decoding stream's length (the prompts arrive at its 100th token)")
    ap.add_argument("--defaults", default=None, metavar="FLOOR:FACTOR,...",
                    help="instead: the server's defaults (the step budget caps 8,192-token chunks; issue 32's setting: a "
                         "200-token stream, four 1,400-token prompts at its 20th token), once per step_budget FLOOR:AUTO_FACTOR "
                         "pair, the pairs interleaved --reps times")  # fmt: skip
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    if args.defaults:
        _defaults(args)
        return
    model = resolve_model_path(args.model)
    dtype = getattr(torch, args.dtype)
    out: Dict[str, Any] = {"model": args.model or "embedded", "loadavg_start": os.getloadavg()[0]}
    for chunk in [int(c) for c in args.chunk.split(",")]:
        out[f"mixed chunk={chunk}"] = run(model, chunk, True, dtype, args.device, args.stream_tokens)
        print(f"mixed, chunk {chunk}:", out[f"mixed chunk={chunk}"], flush=True)
    if not args.skip_alternating:
        out["alternating chunk=8192"] = run(model, 8192, False, dtype, args.device, args.stream_tokens)
        print("alternating, budget 8192:", out["alternating chunk=8192"])
    out["loadavg_end"] = os.getloadavg()[0]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
