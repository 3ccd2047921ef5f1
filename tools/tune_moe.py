"""Tile sweep for the Triton MoE GEMMs (minisgl/moe/triton_moe.py) on a Qwen3-30B-A3B-shaped layer
(hidden 2048, 128 experts, top-8, intermediate 768, bf16): per token count, the default config and
the three fastest, each checked against the default's output first (the sweep behind
`default_config`). CUDA only.

    PYTHONPATH=. python3 tools/tune_moe.py [--tokens 1,8,64,256,1024,4096] [--budget-s 170]
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Any, Callable, List, Tuple

import torch


def time_ms(fn: Callable[[], Any], graph: bool, reps: int = 10) -> float:
    """Per-call device time: inside a replayed CUDA graph (decode sizes) or eager calls."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(reps):
                fn()
        g.replay()
        torch.cuda.synchronize()
        start.record()
        for _ in range(10):
            g.replay()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / (10 * reps)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main() -> None:
    from minisgl.moe.triton_moe import MoeConfig, default_config, fused_moe, smem_bytes

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="1,8,64,256,1024,4096")
    ap.add_argument("--budget-s", type=float, default=170.0)
    args = ap.parse_args()
    t0 = time.time()
    dev, dtype = torch.device("cuda"), torch.bfloat16
    H, E, K, I = 2048, 128, 8, 768
    gen = torch.Generator(device=dev).manual_seed(5)
    w13 = (torch.randn(E, 2 * I, H, device=dev, generator=gen) / math.sqrt(H)).to(dtype)
    w2 = (torch.randn(E, H, I, device=dev, generator=gen) / math.sqrt(I)).to(dtype)
    small = [MoeConfig(16, n, k, 1, w, s) for n in (32, 64, 128) for k in (64, 128) for w, s in ((4, 3), (4, 4))]
    large = [MoeConfig(bm, n, 64, 8, w, s) for bm in (32, 64, 128) for n in (64, 128) for w, s in ((4, 3), (8, 3), (8, 4))]
    small = [c for c in small if smem_bytes(c) <= 200 * 1024]
    large = [c for c in large if smem_bytes(c) <= 200 * 1024]
    for tokens in [int(t) for t in args.tokens.split(",")]:
        if time.time() - t0 > args.budget_s:
            print("(budget: stopping the sweep)")
            break
        x = torch.randn(tokens, H, device=dev, dtype=dtype, generator=gen)
        probs = torch.softmax(torch.randn(tokens, E, device=dev, generator=gen) * 2, dim=-1)
        tw, ti = torch.topk(probs, K, dim=-1)
        tw = (tw / tw.sum(dim=-1, keepdim=True)).to(dtype)
        ref = fused_moe(x, w13, w2, tw, ti)
        scale = float(ref.float().abs().max())
        default = default_config(tokens * K, E, dtype)
        results: List[Tuple[float, Any]] = []
        for cfg in [default] + [c for c in (small if tokens * K <= 16 * E else large) if c != default]:
            try:
                out = fused_moe(x, w13, w2, tw, ti, cfg)
                if not torch.allclose(out.float(), ref.float(), atol=0.02 * scale, rtol=0):
                    print(f"  T={tokens} {cfg}: MISMATCH")
                    continue
                results.append((time_ms(lambda: fused_moe(x, w13, w2, tw, ti, cfg), graph=tokens <= 256), cfg))
            except Exception as e:  # a config the compiler rejects: report it, go on
                print(f"  T={tokens} {cfg}: {type(e).__name__}: {str(e)[:200]}")
        results.sort(key=lambda r: r[0])
        for ms, cfg in results[:3]:
            print(f"  T={tokens:5d} {ms:.4f} ms  {cfg}" + ("  (default)" if cfg == default else ""))
        d_ms = next((ms for ms, c in results if c == default), float("nan"))
        print(f"  T={tokens:5d} default {d_ms:.4f} ms  {default}")


if __name__ == "__main__":
    main()
