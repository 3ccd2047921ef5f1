"""Tile/split sweep for the Triton attention kernels on the GPU (Qwen3-0.6B attention shape).

  PYTHONPATH=. python3 tools/tune_triton_attention.py [--out DIR]

Decode: µs per call and achieved KV bandwidth for (BLOCK_N, warps, stages) x KV splits at batch
1/64/256 with context 600 and a few long contexts. Extend: µs per call for (BLOCK_M, BLOCK_N,
warps, stages) against torch's flash SDPA on the same dense problem. Each timing replays a CUDA
graph of 20 calls, so launch gaps are out of the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Callable, Dict, List

import torch
import torch.nn.functional as F

from minisgl.kernel.triton_attention import decode_attention, extend_attention


def time_us(fn: Callable[[], Any], calls: int = 20, reps: int = 10) -> float:
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps):
        g.replay()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / (calls * reps) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT"))
    args = ap.parse_args()
    dev = torch.device("cuda")
    Hq, Hk, D = 16, 8, 128
    dt = torch.bfloat16
    max_bs = 256
    width = 8192 + 64
    slots = 256 * 640 + 64 * 4200
    k_cache = torch.randn(slots, Hk, D, device=dev, dtype=dt)
    v_cache = torch.randn(slots, Hk, D, device=dev, dtype=dt)
    table = torch.zeros(max_bs + 1, width, dtype=torch.int32, device=dev)
    results: Dict[str, List[Dict[str, Any]]] = {"decode": [], "extend": []}
    scale = D**-0.5

    configs = [(bn, w, st) for bn in (32, 64, 128) for w in (4, 8) for st in (1, 2, 3)]
    cases = [(1, 600), (64, 600), (256, 600), (1, 8192), (32, 4096)]
    for bs, ctx in cases:
        # contiguous rows (a fresh allocator's layout) and, for the default tile, scattered slots
        for layout in ("contiguous", "scattered"):
            if layout == "contiguous":
                base = torch.arange(bs, device=dev)[:, None] * ctx + torch.arange(ctx, device=dev)[None, :]
            else:
                base = torch.randperm(slots, device=dev)[: bs * ctx].view(bs, ctx)
            table[:bs, :ctx] = base.int()
            rows = torch.arange(bs, device=dev)
            seq = torch.full((bs,), ctx, device=dev)
            q = torch.randn(bs, Hq, D, device=dev, dtype=dt)
            out = torch.empty_like(q)
            kv_bytes = bs * ctx * Hk * D * 2 * 2
            for S in (1, 2, 4, 8, 16):
                if S > 1 and ctx // S < 32:
                    continue
                nsplit = torch.full((bs,), S, device=dev)
                mid_o = torch.empty(bs, Hq, S, D, device=dev, dtype=torch.float32)
                mid_lse = torch.empty(bs, Hq, S, device=dev, dtype=torch.float32)
                cfgs = configs if layout == "contiguous" else [(64, 4, 2), (128, 8, 2), (64, 8, 3)]
                for bn, w, st in cfgs:
                    try:
                        us = time_us(lambda: decode_attention(q, k_cache, v_cache, table, rows, seq, nsplit, mid_o, mid_lse,
                                                              out, scale, block_n=bn, num_warps=w, num_stages=st))  # fmt: skip
                    except Exception as e:  # e.g. out of shared memory
                        print(f"decode bs{bs} ctx{ctx} S{S} {bn}/{w}/{st}: {type(e).__name__}", flush=True)
                        continue
                    results["decode"].append(dict(bs=bs, ctx=ctx, layout=layout, splits=S, block_n=bn, warps=w,
                                                  stages=st, us=us, gbs=kv_bytes / us / 1e3))  # fmt: skip
        best = sorted((r for r in results["decode"] if r["bs"] == bs and r["ctx"] == ctx), key=lambda r: r["us"])[:5]
        for r in best:
            print(f"decode bs {bs:>3} ctx {ctx:>5} {r['layout']:<10} S={r['splits']:<2} BLOCK_N={r['block_n']:<3} "
                  f"warps={r['warps']} stages={r['stages']}: {r['us']:.1f} us, {r['gbs']:.0f} GB/s", flush=True)  # fmt: skip
        cur = [r for r in results["decode"] if r["bs"] == bs and r["ctx"] == ctx and r["block_n"] == 64 and r["warps"] == 4
               and r["stages"] == 2 and r["layout"] == "contiguous"]  # fmt: skip
        for r in cur:
            print(f"   current tile (64/4/2) S={r['splits']}: {r['us']:.1f} us", flush=True)

    # ---- extend
    ext_cases = [(4, 0, 1024), (2, 2048, 512), (16, 0, 256)]
    ext_cfgs = [(64, 64, 4, 2), (64, 32, 4, 2), (128, 64, 8, 2), (128, 32, 4, 2), (128, 64, 8, 3), (64, 64, 4, 3), (128, 128, 8, 2)]
    for bs, pre, ext in ext_cases:
        L = pre + ext
        table[:bs, :L] = (torch.arange(bs, device=dev)[:, None] * L + torch.arange(L, device=dev)[None, :]).int()
        rows = torch.arange(bs, device=dev)
        q = torch.randn(bs * ext, Hq, D, device=dev, dtype=dt)
        out = torch.empty_like(q)
        q_start = torch.arange(bs, device=dev) * ext
        cached = torch.full((bs,), pre, device=dev)
        exts = torch.full((bs,), ext, device=dev)
        flops = 4 * bs * Hq * D * (ext * pre + ext * ext / 2)
        for cfg in ext_cfgs:
            try:
                us = time_us(lambda: extend_attention(q, k_cache, v_cache, table, rows, q_start, cached, exts, ext, out,
                                                      scale, config=cfg))  # fmt: skip
            except Exception as e:
                print(f"extend {cfg}: {type(e).__name__}", flush=True)
                continue
            results["extend"].append(dict(bs=bs, prefix=pre, ext=ext, cfg=cfg, us=us, tflops=flops / us / 1e6))
        # torch flash SDPA on the same problem laid out densely (no prefix case: plain causal)
        qd = q.view(bs, ext, Hq, D).transpose(1, 2)
        kd = k_cache[: bs * L].view(bs, L, Hk, D).transpose(1, 2)
        vd = v_cache[: bs * L].view(bs, L, Hk, D).transpose(1, 2)
        if pre == 0:
            sdpa = time_us(lambda: F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=True))
        else:
            sdpa = float("nan")
        rs = sorted((r for r in results["extend"] if r["bs"] == bs and r["prefix"] == pre), key=lambda r: r["us"])
        for r in rs:
            print(f"extend bs {bs} prefix {pre} ext {ext} cfg {r['cfg']}: {r['us']:.1f} us ({r['tflops']:.0f} TFLOP/s)"
                  f"   torch SDPA {sdpa:.1f} us", flush=True)  # fmt: skip
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "tune.json"), "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
