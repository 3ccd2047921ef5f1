"""Check and time the skinny-M GEMV kernels (minisgl/kernel/triton_gemv.py) on a GPU, against the
module path they replace (cuBLAS + the fused add+RMSNorm / SiLU-and-mul kernels), and sweep their
tiles: the source of `minisgl.kernel.skinny.default_config`.

    PYTHONPATH=. python3 tools/gemv_tune.py --out DIR [--models 0.6b,14b] [--budget-s 150]

Every case runs inside a CUDA graph over L distinct weight copies (together > 2x the 50 MB L2, so
weights come from HBM as in a decode step: 28 layers of 30 MB each), replayed 10 times, median
of 3; "us" is per call. Bandwidth = weight bytes / time. Correctness, for every config: output
against a float32 evaluation of the same bf16 inputs, error = max |out - ref| / max |ref|,
bf16 tolerance 1e-2 (the module path's own error is printed beside it); the new residual must be
bitwise equal to x + residual. The output is poisoned (NaN) before each check. All kernel variants
are compiled first, in parallel worker processes (Triton's on-disk cache), so the sweep's
timings never include a compile.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import multiprocessing as mp
import os
import sys
import time
from typing import Any, Dict, List, Tuple

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from minisgl.kernel import pdl, triton_ops  # noqa: E402
from minisgl.kernel.triton_gemv import GemvConfig, gemv  # noqa: E402

SHAPES = {  # (kind, weight rows, K): qkv (pre-norm), o, gate_up (pre-norm, gated), down
    "0.6b": [("norm", 4096, 1024), ("plain", 1024, 2048), ("gated", 6144, 1024), ("plain", 1024, 3072)],
    "14b": [("norm", 7168, 5120), ("plain", 5120, 5120), ("gated", 34816, 5120), ("plain", 5120, 17408)],
}
LM_HEAD = ("norm", 151936, 1024)
L2_BYTES = 50 << 20


def candidates(m: int) -> List[GemvConfig]:
    if m < 16:  # broadcast path, rows in registers (BLOCK_M = m), plus the dot path at 16 rows
        bns = (1, 2, 4, 8, 16) if m == 1 else (1, 2, 4, 8)
        bks = (512, 1024, 2048) if m == 1 else (256, 512, 1024)
        out = [GemvConfig(m, bn, bk, w, 1) for bn, bk, w in itertools.product(bns, bks, (4, 8)) if m * bn * bk <= 16384]
        out += [GemvConfig(16, bn, bk, 4, st) for bn, bk, st in itertools.product((16, 32), (128, 256), (3, 4))]
        return out
    bm = max(16, 1 << (m - 1).bit_length())
    out = [GemvConfig(bm, bn, bk, 4, st) for bn, bk, st in itertools.product((16, 32, 64), (64, 128, 256), (3, 4))]
    return [c for c in out if (bm + 2 * c.block_n) * c.block_k * 2 * c.num_stages <= 160 * 1024]


def _compile_worker(jobs: List[Tuple[str, int, int, GemvConfig]]) -> int:
    dev = torch.device("cuda")
    done = 0
    for kind, n_w, k, cfg in jobs:
        x = torch.randn(max(1, min(cfg.block_m, 2)), k, device=dev, dtype=torch.bfloat16)
        w = torch.randn(n_w, k, device=dev, dtype=torch.bfloat16)
        nw = torch.ones(k, device=dev, dtype=torch.bfloat16)
        try:
            run(kind, x, x, nw, w, cfg)
            done += 1
        except Exception as e:  # reported again (and counted) by the sweep
            print(f"compile {kind} {cfg}: {e!r}"[:300], flush=True)
    torch.cuda.synchronize()
    return done


def run(kind: str, x: torch.Tensor, r: torch.Tensor, nw: torch.Tensor, w: torch.Tensor, cfg: GemvConfig) -> Tuple[torch.Tensor, Any]:
    if kind == "plain":
        return gemv(x, w, cfg)
    return gemv(x, w, cfg, residual=r, norm_weight=nw, eps=1e-6, gated=kind == "gated")


def module(kind: str, x: torch.Tensor, r: torch.Tensor, nw: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    if kind == "plain":
        return F.linear(x, w)
    h, _ = triton_ops.fused_add_rms_norm(x, r, nw, 1e-6)
    y = F.linear(h, w)
    return triton_ops.silu_and_mul(y) if kind == "gated" else y


def reference(kind: str, x: torch.Tensor, r: torch.Tensor, nw: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """float32 evaluation of the same bf16 inputs (the norm's output rounded to bf16 as the model does)."""
    if kind == "plain":
        return x.float() @ w.float().t()
    s = (x.float() + r.float()).to(x.dtype).float()
    h = (nw.float() * (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype).float()).to(x.dtype)
    y = h.float() @ w.float().t()
    if kind == "gated":
        g, u = y.chunk(2, dim=-1)
        return F.silu(g) * u
    return y


def graph_time(fn: Any, reps: int = 10) -> float:
    """Seconds per call of fn replayed from a CUDA graph (the plan's own timer)."""
    from minisgl.kernel.skinny import _graph_time

    return _graph_time(fn, torch.cuda.Stream(), reps)


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/gemv")
    ap.add_argument("--models", default="0.6b")
    ap.add_argument("--ms", default="1,2,4,8,16,32,64")
    ap.add_argument("--kinds", default="norm,plain,gated")
    ap.add_argument("--lm-head", action="store_true")
    ap.add_argument("--budget-s", type=float, default=150)
    ap.add_argument("--workers", type=int, default=14)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    t0 = time.time()
    dev = torch.device("cuda")
    ms = [int(v) for v in a.ms.split(",")]
    cases: List[Tuple[str, str, int, int, int]] = []  # (model, kind, n_w, k, m)
    for model in a.models.split(","):
        for kind, n_w, k in SHAPES[model]:
            if kind not in a.kinds.split(","):
                continue
            for m in ms if model == "0.6b" else [v for v in ms if v in (1, 8, 32)]:
                cases.append((model, kind, n_w, k, m))
    if a.lm_head:
        cases += [("lm_head", *LM_HEAD, m) for m in (1, 4)]
    jobs = sorted({(kind, n_w, k, cfg) for _, kind, n_w, k, m in cases for cfg in candidates(m)}, key=str)
    # compile: the kernel's specialisation depends on kind and tile only (shapes are runtime ints
    # with the same divisibility), so one job per (kind, config) is enough
    by_variant: Dict[Tuple[str, GemvConfig], Tuple[str, int, int, GemvConfig]] = {}
    for j in jobs:
        by_variant.setdefault((j[0], j[3]), (j[0], 1024, 1024, j[3]) if j[0] != "gated" else (j[0], 2048, 1024, j[3]))
    work = list(by_variant.values())
    print(f"compiling {len(work)} kernel variants in {a.workers} processes", flush=True)
    chunks = [work[i :: a.workers] for i in range(a.workers)]
    with mp.get_context("spawn").Pool(a.workers) as pool:
        n_ok = sum(pool.map(_compile_worker, chunks))
    print(f"compiled {n_ok}/{len(work)} in {time.time() - t0:.1f}s", flush=True)

    gen = torch.Generator(device=dev).manual_seed(0)
    rows: List[Dict[str, Any]] = []
    failures: List[str] = []
    best: Dict[str, Any] = {}
    for model, kind, n_w, k, m in cases:
        if time.time() - t0 > a.budget_s:
            print("budget spent; stopping the sweep", flush=True)
            break
        wbytes = n_w * k * 2
        copies = max(2, min(28, math.ceil(2 * L2_BYTES / wbytes)))
        ws = [(torch.randn(n_w, k, generator=gen, device=dev) / math.sqrt(k)).to(torch.bfloat16) for _ in range(copies)]
        nws = [(torch.rand(k, generator=gen, device=dev) + 0.5).to(torch.bfloat16) for _ in range(copies)]
        x = torch.randn(m, k, generator=gen, device=dev).to(torch.bfloat16)
        r = torch.randn(m, k, generator=gen, device=dev).to(torch.bfloat16)
        ref = reference(kind, x, r, nws[0], ws[0])
        err_module = rel(module(kind, x, r, nws[0], ws[0]), ref)
        t_mod = graph_time(lambda: [module(kind, x, r, nw, w) for w, nw in zip(ws, nws)]) / copies
        t_cublas = graph_time(lambda: [F.linear(x, w) for w in ws]) / copies
        key = f"{model} {kind} {n_w}x{k} m={m}"
        results = []
        for cfg in candidates(m):
            try:
                out, res = run(kind, x, r, nws[0], ws[0], cfg)
                torch.cuda.synchronize()
                err = rel(out, ref)
                ok = math.isfinite(err) and err < max(1e-2, 2 * err_module)
                if res is not None:
                    ok = ok and torch.equal(res, x + r)
                if not ok:
                    failures.append(f"{key} {cfg}: err {err:.3g}")
                t = graph_time(lambda: [run(kind, x, r, nw, w, cfg) for w, nw in zip(ws, nws)]) / copies
                results.append((t, cfg, err, ok))
            except Exception as e:
                failures.append(f"{key} {cfg}: {e!r}"[:300])
        results.sort(key=lambda v: v[0])
        if not results:
            continue
        t_best, cfg_best, err_best, _ = results[0]
        row = dict(model=model, kind=kind, n=n_w, k=k, m=m, module_us=t_mod * 1e6, cublas_us=t_cublas * 1e6,
                   best_us=t_best * 1e6, best=list(cfg_best), speedup=t_mod / t_best, err=err_best, err_module=err_module,
                   best_GBps=wbytes / t_best / 1e9, cublas_GBps=wbytes / t_cublas / 1e9,
                   top5=[(round(t * 1e6, 2), list(c)) for t, c, _, _ in results[:5]])  # fmt: skip
        rows.append(row)
        best[key] = row
        print(f"{key:34s} module {t_mod * 1e6:7.2f} us (cuBLAS alone {t_cublas * 1e6:6.2f}, {wbytes / t_cublas / 1e9:5.0f} GB/s) | "
              f"best {t_best * 1e6:6.2f} us {wbytes / t_best / 1e9:5.0f} GB/s {tuple(cfg_best)} x{t_mod / t_best:.2f} "
              f"err {err_best:.2e} (module {err_module:.2e})", flush=True)  # fmt: skip
        print("    top5:", row["top5"], flush=True)
        if m == 1 and pdl.pdl_enabled():  # the same tile without programmatic dependent launch
            pdl._state["enabled"] = False
            try:
                row["best_us_no_pdl"] = 1e6 * graph_time(lambda: [run(kind, x, r, nw, w, cfg_best) for w, nw in zip(ws, nws)]) / copies
                print(f"    without PDL: {row['best_us_no_pdl']:.2f} us", flush=True)
            finally:
                pdl._state["enabled"] = True
    with open(os.path.join(a.out, "gemv_tune.json"), "w") as f:
        json.dump({"rows": rows, "failures": failures}, f, indent=1)
    print(f"failures: {len(failures)}", *failures[:20], sep="\n  ")
    print(f"done in {time.time() - t0:.1f}s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
