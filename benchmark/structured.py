"""The throughput cost of structured output: the same requests free and constrained by a JSON
schema (xgrammar masks in the batched sampler; constrained steps run the loop synchronously).

    python benchmark/structured.py                  # embedded SmolLM2-135M on the CPU
    python benchmark/structured.py --model DIR --dtype bfloat16 --num-requests 64

Both runs generate exactly `--max-tokens` tokens per request (EOS ignored; the schema is an
array of up to `--max-tokens` small integers so the grammar never ends first), so the ratio is
the cost per token of building masks, applying them, and giving up overlap scheduling.
Prints both figures, the ratio and one line of JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from minisgl.core import SamplingParams
from minisgl.llm import LLM
from minisgl.sampling_params import GrammarSpec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF folder or .gguf (default: the embedded SmolLM2-135M)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    llm = LLM(args.model, dtype=args.dtype)
    prompts = [f"List some numbers, request {i}:" for i in range(args.num_requests)]
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": args.max_tokens * 4}
    grammar = GrammarSpec("json_schema", json.dumps(schema))
    free = SamplingParams(temperature=0.6, max_tokens=args.max_tokens, ignore_eos=True, seed=0)
    constrained = SamplingParams(temperature=0.6, max_tokens=args.max_tokens, ignore_eos=True, seed=0, grammar=grammar)
    llm.generate(prompts[:2], [free, constrained], use_tqdm=False)  # warm-up (compiles the grammar once)
    figures = {}
    for name, params in (("free", free), ("json_schema", constrained)):
        llm.scheduler.reset_prefix_cache()
        start = time.perf_counter()
        results = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        tokens = sum(r.completion_tokens for r in results)
        figures[name] = tokens / elapsed
        print(f"{name:12s} {tokens} tokens in {elapsed:.2f} s = {figures[name]:.1f} tok/s")
    ratio = figures["json_schema"] / figures["free"]
    print(f"structured / free: {ratio:.3f}")
    print(json.dumps({"bench": "structured", "model": args.model or "embedded", "num_requests": args.num_requests,
                      "max_tokens": args.max_tokens, "loadavg": os.getloadavg()[0], **figures, "ratio": ratio}))  # fmt: skip
    llm.shutdown()


if __name__ == "__main__":
    main()
