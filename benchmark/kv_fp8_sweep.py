"""Decode attention on a bf16 vs an fp8_e4m3 KV pool (CUDA): tiles and stages, Qwen3-0.6B heads.

For each (batch, mean context) the triton backend's own split rule picks the chunks; each config
(BLOCK_N, num_stages, num_warps) is timed as a CUDA graph of 8 calls over 4 layers' pools in turn
(KV several times the L2; the graph keeps small cases from timing the Python launch),
lengths uniform in [ctx/2, 3ctx/2], scattered slots, longest-first order. Checked first: the
fp8 kernel's output equals the bf16 kernel's over the fp8 values widened to bf16, same tile.
    python3 benchmark/kv_fp8_sweep.py --out sweep.json
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import triton

import minisgl.kernel.triton_attention as TA
from minisgl.kernel.triton_attention import decode_attention, decode_tile

HQ, HK, D, LAYERS = 16, 8, 128, 4
MAX_SPLITS, MIN_SPLIT_LEN = 64, 64  # attention/triton_backend.py


def case(bs: int, ctx: int, sms: int, gen: torch.Generator) -> dict:
    lens = torch.randint(ctx // 2, ctx * 3 // 2 + 1, (bs,), generator=gen) if bs > 1 else torch.tensor([ctx])
    grid = max(1, min(MAX_SPLITS, -(-2 * sms // (bs * HK))))
    splits = [max(1, min(grid, -(-int(n) // MIN_SPLIT_LEN))) for n in lens]
    total = int(lens.sum())
    width = int(lens.max())
    perm = torch.randperm(total + 16, generator=gen)[:total]
    pt = torch.zeros(bs, width, dtype=torch.int32)
    off = 0
    for i, n in enumerate(lens.tolist()):
        pt[i, :n] = perm[off : off + n]
        off += n
    order = sorted(range(bs), key=lambda i: -int(lens[i]))
    dev = "cuda"
    return dict(
        lens=lens, grid=grid, slots=total + 16, pt=pt.to(dev), rows=torch.arange(bs, device=dev),
        seq=lens.to(dev), splits=torch.tensor(splits, device=dev), order=torch.tensor(order, device=dev),
    )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="256x1000,64x800,8x1000,1x600")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator().manual_seed(0)
    rows = []
    configs = [(bn, st, 4) for bn in (64, 128, 256) for st in (1, 3)] + [(128, 2, 4), (256, 3, 8)]
    for spec in a.cases.split(","):
        bs, ctx = (int(x) for x in spec.split("x"))
        c = case(bs, ctx, sms, gen)
        q = torch.randn(bs, HQ, D, device="cuda", dtype=torch.bfloat16)
        kv16 = [torch.randn(2, c["slots"], HK, D, device="cuda", dtype=torch.bfloat16) for _ in range(LAYERS)]
        kv8 = [x.float().clamp(-448, 448).to(torch.float8_e4m3fn) for x in kv16]
        kv8w = [x.to(torch.bfloat16) for x in kv8]
        mid_o = torch.empty(bs, HQ, c["grid"], D, device="cuda")
        mid_lse = torch.empty(bs, HQ, c["grid"], device="cuda")
        out = torch.empty_like(q)

        def run(kv: torch.Tensor, bn: int, st: int, w: int) -> None:
            decode_attention(q, kv[0], kv[1], c["pt"], c["rows"], c["seq"], c["splits"], mid_o, mid_lse, out,
                             D**-0.5, block_n=bn, num_warps=w, num_stages=st, order=c["order"])  # fmt: skip

        # correctness: fp8 (each read mode) against the bf16 kernel over the widened values, same tile
        for bn in (64, 128, 256):
            run(kv8w[0], bn, 3, 4)
            ref = out.clone()
            for mode in ("bf16", "f16"):
                TA.FP8_DOT = mode
                out.fill_(float("nan"))
                run(kv8[0], bn, 3, 4)
                err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                print(f"  check {spec} tile {bn} fp8 {mode}: max rel diff vs the bf16 kernel {err:.2e}")
                assert not out.isnan().any() and err < 2e-2
        kv_bytes = int(c["lens"].sum()) * HK * D * 2  # K and V elements per layer
        base = decode_tile(bs, torch.bfloat16)
        for kvname, kvs, itemsize in (("bf16", kv16, 2), ("fp8f16", kv8, 1), ("fp8bf16dot", kv8, 1)):
            TA.FP8_DOT = "f16" if kvname == "fp8f16" else "bf16"
            for bn, st, w in configs:
                try:
                    run(kvs[0], bn, st, w)  # compile outside the capture
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g):
                        for _ in range(2):
                            for kv in kvs:
                                run(kv, bn, st, w)
                    ms = triton.testing.do_bench(g.replay, warmup=10, rep=40, return_mode="median") / (2 * LAYERS)
                except Exception as e:  # an out-of-resources config
                    print(f"  {spec} {kvname} {bn}/{st}/{w}: {type(e).__name__}")
                    continue
                gbs = kv_bytes * itemsize / (ms * 1e-3) / 1e9
                rows.append(dict(case=spec, kv=kvname, block_n=bn, stages=st, warps=w, us=ms * 1e3, GBps=gbs,
                                 default=(bn == base and st == 3 and w == 4)))  # fmt: skip
        for kvname in ("bf16", "fp8f16", "fp8bf16dot"):
            mine = [r for r in rows if r["case"] == spec and r["kv"] == kvname]
            best = min(mine, key=lambda r: r["us"])
            dflt = next((r for r in mine if r["default"]), None)
            print(f"{spec:>9} {kvname}: default {dflt['us'] if dflt else math.nan:8.1f} us "
                  f"({dflt['GBps'] if dflt else 0:6.0f} GB/s)  best {best['us']:8.1f} us ({best['GBps']:6.0f} GB/s) "
                  f"at {best['block_n']}/{best['stages']}/{best['warps']}  grid {c['grid']}", flush=True)  # fmt: skip
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
