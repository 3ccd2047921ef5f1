"""Decode attention on a bf16 vs an fp8_e4m3 KV pool (CUDA): the tensor-core kernel's tiles and the
CUDA-core fp8 kernel's (keys per tile, warps, prefetch depth), Qwen3 heads.

For each (batch, mean context) the triton backend's own split rule picks the chunks; each config is
timed as a CUDA graph of 8 calls over 4 layers' pools in turn (KV several times the L2; the graph
keeps small cases from timing the Python launch), lengths uniform in [ctx/2, 3ctx/2], scattered
slots, longest-first order. Checked first: every fp8 kernel and config against float32 attention
over the fp8 values (poisoned output and scratch, max error relative to the largest output).
Timed: bf16 KV and fp8 through the tensor-core kernel (fp16 dots), and the CUDA-core kernel's
configs. (The tensor-core kernel over int32 words, timed in docs/PERFORMANCE.md, is gone.)
    python3 tools/kv_fp8_sweep.py --cases 256x1000,64x600,8x1000 --out sweep.json
    python3 tools/kv_fp8_sweep.py --heads 40x8 --cases 256x1000 --quick   # Qwen3-14B's group of 5
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Callable, Dict, List, Tuple

import torch
import triton

import minisgl.kernel.triton_attention as TA
from minisgl.kernel.triton_attention import decode_attention, decode_tile

D, LAYERS = 128, 4
MAX_SPLITS, MIN_SPLIT_LEN = 64, 64  # attention/triton_backend.py
# (label, FP8_DECODE mode, block_n, num_stages, num_warps, CC_PREFETCH)
Config = Tuple[str, str, int, int, int, int]
DOT = [("dot", "dot", bn, st, 4, 0) for bn in (64, 128) for st in (1, 3)]
CC = [("cc", "cc", keys * 4 * w, 1, w, pf) for keys in (2, 4, 8) for w in (4, 8) for pf in (2,)]
CC += [("cc", "cc", 64, 1, 4, 1), ("cc", "cc", 64, 1, 4, 0), ("cc", "cc", 32, 1, 2, 2), ("cc", "cc", 64, 1, 2, 2)]


def case(bs: int, ctx: int, hk: int, sms: int, gen: torch.Generator) -> dict:
    lens = torch.randint(ctx // 2, ctx * 3 // 2 + 1, (bs,), generator=gen) if bs > 1 else torch.tensor([ctx])
    grid = max(1, min(MAX_SPLITS, -(-2 * sms // (bs * hk))))
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


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, c: dict) -> torch.Tensor:
    """float32 attention of each request's q over its keys (k/v: [slots, Hk, D], any dtype)."""
    B, hq, _ = q.shape
    hk = k.shape[1]
    idx = c["pt"].long()  # [B, W]
    valid = torch.arange(idx.shape[1], device=q.device)[None, :] < c["seq"][:, None]
    kk, vv = k[idx].float(), v[idx].float()  # [B, W, Hk, D]
    qq = q.float().view(B, hk, hq // hk, D)
    s = torch.einsum("bhgd,bwhd->bhgw", qq, kk) * D**-0.5
    s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
    return torch.einsum("bhgw,bwhd->bhgd", s.softmax(-1), vv).reshape(B, hq, D)


def time_graph(fn: Callable[[], None]) -> float:
    fn()  # compile outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(2):
            fn()
    return triton.testing.do_bench(g.replay, warmup=10, rep=40, return_mode="median") / 2


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="256x1000,64x600,8x1000")
    ap.add_argument("--heads", default="16x8", help="q heads x kv heads")
    ap.add_argument("--quick", action="store_true", help="only the defaults (dot and cc) and bf16")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    hq, hk = (int(x) for x in a.heads.split("x"))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator().manual_seed(0)
    rows: List[Dict] = []
    failures: List[str] = []
    for spec in a.cases.split(","):
        bs, ctx = (int(x) for x in spec.split("x"))
        c = case(bs, ctx, hk, sms, gen)
        q = torch.randn(bs, hq, D, device="cuda", dtype=torch.bfloat16)
        kv16 = [torch.randn(2, c["slots"], hk, D, device="cuda", dtype=torch.bfloat16) for _ in range(LAYERS)]
        kv8 = [(x.float() * 4).clamp(-448, 448).to(torch.float8_e4m3fn) for x in kv16]  # subnormals to 448
        mid_o = torch.empty(bs, hq, c["grid"], D, device="cuda")
        mid_lse = torch.empty(bs, hq, c["grid"], device="cuda")
        out = torch.empty_like(q)
        base = decode_tile(bs, torch.bfloat16)
        cc_default = TA.CC_TILE

        def run(kv: torch.Tensor, cfg: Config) -> None:
            _, mode, bn, st, w, pf = cfg
            TA.FP8_DECODE, TA.CC_PREFETCH, TA.CC_TILE = mode, pf, (bn, w)
            decode_attention(q, kv[0], kv[1], c["pt"], c["rows"], c["seq"], c["splits"], mid_o, mid_lse, out,
                             D**-0.5, block_n=bn, num_warps=w, num_stages=st, order=c["order"])  # fmt: skip

        def is_default(cfg: Config) -> bool:
            if cfg[1] == "dot":
                return cfg[2] == base and cfg[3] == 3
            return (cfg[2], cfg[4], cfg[5]) == (cc_default[0], cc_default[1], 2)

        dot_cfgs = [x for x in DOT if not a.quick or is_default(x)]
        cc_cfgs = [x for x in CC if not a.quick or is_default(x)]
        # correctness: every fp8 config against float32 attention over the fp8 values
        ref = reference(q, kv8[0][0], kv8[0][1], c)
        for cfg in dot_cfgs + cc_cfgs:
            out.fill_(float("nan"))
            mid_o.fill_(float("nan"))
            run(kv8[0], cfg)
            err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
            ok = not out.isnan().any().item() and err < 1e-2
            print(f"  check {spec} fp8 {cfg[0]} {cfg[2]}/{cfg[3]}/{cfg[4]}/pf{cfg[5]}: max rel err vs fp32 {err:.2e}"
                  f"{'' if ok else '  FAIL'}")  # fmt: skip
            if not ok:
                failures.append(f"{spec} {cfg}")
        kv_bytes = int(c["lens"].sum()) * hk * D * 2  # K and V elements per layer
        timed = [("bf16", kv16, 2, x) for x in dot_cfgs] + [("fp8dot", kv8, 1, x) for x in dot_cfgs]
        timed += [("fp8cc", kv8, 1, x) for x in cc_cfgs]
        for kvname, kvs, itemsize, cfg in timed:

            def layers(kvs: List[torch.Tensor] = kvs, cfg: Config = cfg) -> None:
                for kv in kvs:
                    run(kv, cfg)

            try:
                us = time_graph(layers) / LAYERS * 1e3
            except Exception as e:  # an out-of-resources config
                print(f"  {spec} {kvname} {cfg}: {type(e).__name__} {str(e)[:200]}")
                continue
            rows.append(dict(case=spec, heads=a.heads, kv=kvname, block_n=cfg[2], stages=cfg[3], warps=cfg[4],
                             prefetch=cfg[5], us=us, GBps=kv_bytes * itemsize / (us * 1e-6) / 1e9,
                             default=is_default(cfg)))  # fmt: skip
        TA.FP8_DECODE, TA.CC_PREFETCH, TA.CC_TILE = "auto", 2, cc_default
        for kvname in ("bf16", "fp8dot", "fp8cc"):
            mine = [r for r in rows if r["case"] == spec and r["kv"] == kvname]
            if not mine:
                continue
            best = min(mine, key=lambda r: r["us"])
            dflt = next((r for r in mine if r["default"]), None)
            print(f"{a.heads} {spec:>9} {kvname:>7}: default {dflt['us'] if dflt else math.nan:7.1f} us "
                  f"({dflt['GBps'] if dflt else 0:5.0f} GB/s)  best {best['us']:7.1f} us ({best['GBps']:5.0f} GB/s) "
                  f"at {best['block_n']}/{best['stages']}/{best['warps']}/pf{best['prefetch']}  grid {c['grid']}",
                  flush=True)  # fmt: skip
    for r in rows:
        print(f"  {r['heads']} {r['case']} {r['kv']} {r['block_n']}/{r['stages']}/{r['warps']}/pf{r['prefetch']}: "
              f"{r['us']:.1f} us {r['GBps']:.0f} GB/s")  # fmt: skip
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(rows=rows, failures=failures), f, indent=1)
    print("FAILURES:", failures)


if __name__ == "__main__":
    main()
