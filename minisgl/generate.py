"""`python -m minisgl.generate "prompt"`: one chat answer from a model (default: the embedded one)."""

from __future__ import annotations

import argparse
import sys
import time

from minisgl.core import SamplingParams


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("prompt", help="the user message")
    parser.add_argument("--model", default=None, help="HF folder or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--raw", action="store_true", help="do not apply the chat template")
    args = parser.parse_args(argv)

    from minisgl.llm import LLM

    llm = LLM(args.model, dtype=args.dtype, device=args.device, max_running_req=4, num_page_override=None)
    prompt = args.prompt if args.raw else [{"role": "user", "content": args.prompt}]
    start = time.perf_counter()
    [result] = llm.generate([prompt], SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens))
    elapsed = time.perf_counter() - start
    print(result.text)
    print(
        f"[{result.completion_tokens} tokens in {elapsed:.2f}s, finish_reason={result.finish_reason}]",
        file=sys.stderr,
    )
    llm.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
