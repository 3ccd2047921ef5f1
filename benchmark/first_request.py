"""The first request after start-up: its latency and the Triton kernels it had to compile.

    PYTHONPATH=. python3 benchmark/first_request.py --model benchmark/models/qwen3-0.6b --dummy-weights

Engine start-up compiles (or loads from Triton's cache) what serving needs: decode kernels while
capturing CUDA graphs, the sampler's variants, and the prefill path through a warm-up prefill on
the dummy request. A first request that still compiles something pays for it in its TTFT (about a
second per kernel on a fresh machine). Prints the first and second request's latency and every
kernel specialisation built between start-up and the end of the first request.
"""

from __future__ import annotations

import argparse
import time
from typing import Any, List


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dummy-weights", action="store_true")
    ap.add_argument("--prompt-len", type=int, default=511)  # odd: unlike any warm-up shape
    ap.add_argument("--max-tokens", type=int, default=8)
    args = ap.parse_args()

    from minisgl.core import SamplingParams
    from minisgl.llm import LLM

    compiled: List[str] = []
    try:
        import triton

        def hook(*, repr: str, **_: Any) -> None:
            compiled.append(repr.split("(")[0])

        llm = LLM(args.model, use_dummy_weight=args.dummy_weights)
        triton.knobs.runtime.jit_cache_hook = hook  # from here on: what serving still compiles
    except ImportError:
        llm = LLM(args.model, use_dummy_weight=args.dummy_weights)
    params = SamplingParams(temperature=0.6, max_tokens=args.max_tokens, ignore_eos=True)
    times = []
    for i in range(2):
        prompt = [(7 * j + i) % 1000 for j in range(args.prompt_len)]
        t0 = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        times.append(time.perf_counter() - t0)
    llm.shutdown()
    print(f"first request {times[0] * 1e3:.1f} ms, second {times[1] * 1e3:.1f} ms "
          f"({args.prompt_len}-token prompt, {args.max_tokens} tokens)")  # fmt: skip
    print(f"Triton kernels compiled by serving: {len(compiled)} {compiled}")


if __name__ == "__main__":
    main()
