"""GPU check of the fused Triton ops and the Triton MoE backend against their torch references,
with timings (one process, one device call).

  PYTHONPATH=. python3 benchmark/gpu_kernels_check.py [--parts moe,norm,silu,rotary,prologue,graph]
                                                      [--budget-s 170] [--out DIR]
  PYTHONPATH=. python3 benchmark/gpu_kernels_check.py --parts moe_tune   # tile sweep, not default
  TRITON_INTERPRET=1 python3 benchmark/gpu_kernels_check.py --smoke       # tiny shapes, CPU ok

norm:     RMSNorm and fused add+RMSNorm (hidden 1024 and 5120; per-head q_norm on a strided q view
          split out of qkv), through the layer entry points (so the dispatch is checked too)
          against layers/norm.py's torch code.
silu:     SiLU-and-mul (I 768, 3072, 17408).
rotary:   RotaryEmbedding.forward (Qwen3-0.6B / 14B head layouts, strided q/k views, int32 and
          int64 positions) against its torch path.
prologue: the fused attention prologue (split qkv, q/k RMSNorm, rotary, K/V store into pool
          slots) against the torch ops it replaces (Qwen3-0.6B/14B and a no-norm layout).
moe:      TritonMoeBackend vs TorchMoeBackend on a Qwen3-30B-A3B-shaped layer (hidden 2048,
          128 experts, top-8, moe_intermediate 768), tokens 1..4096. bf16: both are compared
          with a float32 evaluation of the same bf16 weights; the Triton error must not exceed
          1.5x the torch backend's (plus a floor), and the two must agree within 2% of the output
          scale. fp32: within 2e-5 + 1e-5 relative (IEEE dots on both sides, TF32 off).
          Timings: eager for both, CUDA-graph replay for Triton at decode sizes, and the bandwidth
          achieved on the weights of the experts actually hit (decode is memory-bound).
graph:    the fused ops and the MoE captured in one CUDA graph, replayed on new inputs (new
          routing), equal to the eager results: no host syncs, no data-dependent allocations.

bf16 tolerance is a few bf16 ulps (atol 1e-2, rtol 1.6e-2); fp32 tolerance 1e-5 (the kernels
round to the model dtype exactly where the torch code does). Every part catches its own
exceptions and reports them; the exit status is 1 when any comparison failed or any part raised.
Timings: ms per call; "graph" columns are per call inside a replayed CUDA graph (device time
without the host's launch cost, which is what a captured decode step pays).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from typing import Any, Callable, Dict, List, Optional

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from minisgl.kernel.fused import set_fused_ops_enabled, triton_ops, use_fused  # noqa: E402
from minisgl.kernel.interpreter import patch_interpreter  # noqa: E402
from minisgl.layers.activation import silu_and_mul, silu_and_mul_torch  # noqa: E402
from minisgl.layers.norm import RMSNorm, rms_norm, rms_norm_torch  # noqa: E402
from minisgl.layers.rotary import RotaryConfig, RotaryEmbedding, set_rope_device  # noqa: E402

T0 = time.time()
ROWS: List[Dict[str, Any]] = []
ERRORS: List[str] = []
FAILED: List[str] = []
BUDGET_S = 170.0


def log(msg: str) -> None:
    print(msg, flush=True)


def time_left() -> float:
    return BUDGET_S - (time.time() - T0)


def sync() -> None:
    if DEV.type == "cuda":
        torch.cuda.synchronize()


def time_eager(fn: Callable[[], Any], target_ms: float = 25.0) -> float:
    if DEV.type != "cuda":  # --smoke on CPU: one call, wall time
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    fn()
    sync()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        fn()
    end.record()
    sync()
    est = max(start.elapsed_time(end) / 3, 1e-3)
    iters = int(min(200, max(3, math.ceil(target_ms / est))))
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    sync()
    return start.elapsed_time(end) / iters


def time_graph(fn: Callable[[], Any], reps: int = 20) -> Optional[float]:
    """Per-call device time of `fn` captured `reps` times in one graph; None if capture fails."""
    if DEV.type != "cuda":
        return None
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(s)
        sync()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(reps):
                fn()
        g.replay()
        sync()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        n = 10
        start.record()
        for _ in range(n):
            g.replay()
        end.record()
        sync()
        ms = start.elapsed_time(end) / (n * reps)
        del g
        return ms
    except Exception as e:  # report, never abort the run for a timing
        log(f"  (graph timing failed: {type(e).__name__}: {e})")
        return None


def compare(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, atol: float | None = None,
            rtol: float | None = None) -> Dict[str, Any]:  # fmt: skip
    g, r = got.float(), ref.float()
    if atol is None:
        atol, rtol = (1e-5, 1e-5) if dtype == torch.float32 else (1e-2, 1.6e-2)
    assert rtol is not None
    same_shape = g.shape == r.shape
    finite = bool(torch.isfinite(g).all()) if same_shape else False
    err = float((g - r).abs().max()) if same_shape and g.numel() else 0.0
    ok = same_shape and finite and bool(torch.allclose(g, r, atol=atol, rtol=rtol))
    identical = float((got == ref).float().mean()) if same_shape and got.numel() else 1.0
    return {"ok": ok, "max_err": err, "identical": identical, "finite": finite}


def fmt_ms(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.4f}"


def record(part: str, case: str, dtype: torch.dtype, cmp: Dict[str, Any], t_torch: Optional[float] = None,
           t_fused: Optional[float] = None, g_torch: Optional[float] = None, g_fused: Optional[float] = None,
           note: str = "") -> None:  # fmt: skip
    row = {"part": part, "case": case, "dtype": str(dtype).replace("torch.", ""), **cmp,
           "torch_ms": t_torch, "fused_ms": t_fused, "torch_graph_ms": g_torch, "fused_graph_ms": g_fused, "note": note}  # fmt: skip
    ROWS.append(row)
    best_t = g_torch if g_torch is not None else t_torch
    best_f = g_fused if g_fused is not None else t_fused
    speed = f"{best_t / best_f:.2f}x" if best_t and best_f else "-"
    status = "ok  " if cmp["ok"] else "FAIL"
    log(f"{status} {part:7s} {case:44s} {row['dtype']:8s} err {cmp['max_err']:.3g} same {cmp['identical']:.3f} | "
        f"eager torch {fmt_ms(t_torch)} fused {fmt_ms(t_fused)} | graph torch {fmt_ms(g_torch)} fused {fmt_ms(g_fused)} "
        f"| {speed} {note}")  # fmt: skip
    if not cmp["ok"]:
        FAILED.append(f"{part}: {case} {row['dtype']}")


def run_part(name: str, fn: Callable[[], None]) -> None:
    log(f"\n=== {name} (t={time.time() - T0:.0f}s) ===")
    try:
        fn()
    except Exception:
        tb = traceback.format_exc()
        log(f"ERROR in part {name}:\n{tb}")
        ERRORS.append(f"{name}: {tb.strip().splitlines()[-1]}")
    finally:
        set_fused_ops_enabled(True)


def torch_ref(fn: Callable[[], Any]) -> Any:
    prev = set_fused_ops_enabled(False)
    try:
        return fn()
    finally:
        set_fused_ops_enabled(prev)


DEV = torch.device("cuda")
DTYPES = (torch.bfloat16, torch.float32)
# realistic shapes; --smoke swaps in tiny ones (and allows CPU under TRITON_INTERPRET=1)
SHAPES: Dict[str, Any] = {
    "norm_hidden": (1024, 5120), "tokens": (1, 64, 4096), "head_tokens": (1, 256, 4096), "silu_inter": (768, 3072, 17408),
    "head_dim": 128, "max_pos": 40960,
    "moe": dict(hidden=2048, experts=128, top_k=8, inter=768),
    "moe_tokens_bf16": (1, 4, 16, 64, 256, 1024, 4096), "moe_tokens_fp32": (1, 64, 1024),
}  # fmt: skip
SMOKE_SHAPES: Dict[str, Any] = {
    "norm_hidden": (64, 160), "tokens": (1, 5), "head_tokens": (3,), "silu_inter": (48,), "head_dim": 32,
    "max_pos": 256, "moe": dict(hidden=64, experts=8, top_k=3, inter=32),
    "moe_tokens_bf16": (1, 5), "moe_tokens_fp32": (3,),
}  # fmt: skip


# The fused side goes through the layers' dispatch on CUDA (checking the wiring too); on CPU
# (--smoke) the layers stay on torch, so the kernels are called directly.
def f_rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return rms_norm(x, w, eps) if x.is_cuda else triton_ops().rms_norm(x, w, eps)  # type: ignore[union-attr]


def f_add_rms(layer: RMSNorm, x: torch.Tensor, res: torch.Tensor):
    if x.is_cuda:
        return layer.forward_with_residual(x, res)
    return triton_ops().fused_add_rms_norm(x, res, layer.weight, layer.eps)  # type: ignore[union-attr]


def f_silu(x: torch.Tensor) -> torch.Tensor:
    return silu_and_mul(x) if x.is_cuda else triton_ops().silu_and_mul(x)  # type: ignore[union-attr]


def f_rope(rope: RotaryEmbedding, pos: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
    if q.is_cuda:
        return rope(pos, q, k)
    return triton_ops().apply_rotary(pos, q, k, rope.cos, rope.sin, rope.rotary_dim)  # type: ignore[union-attr]


def new_gen(seed: int) -> torch.Generator:
    return torch.Generator(device=DEV).manual_seed(seed)


# ---- parts --------------------------------------------------------------------------------------
def part_norm() -> None:
    gen = new_gen(0)
    for dtype in DTYPES:
        for hidden in SHAPES["norm_hidden"]:
            for tokens in SHAPES["tokens"]:
                if time_left() < 30:
                    log("  (budget: skipping remaining norm cases)")
                    return
                x = torch.randn(tokens, hidden, device=DEV, dtype=dtype, generator=gen) * 2
                res = torch.randn(tokens, hidden, device=DEV, dtype=dtype, generator=gen)
                layer = RMSNorm(hidden, 1e-6).to(DEV)
                layer.weight.data = (torch.rand(hidden, device=DEV, generator=gen) + 0.5).to(dtype)
                w = layer.weight
                assert use_fused(x) == x.is_cuda
                graph = tokens <= 256
                tfn = lambda: rms_norm_torch(x, w, 1e-6)  # noqa: E731
                ffn = lambda: f_rms(x, w, 1e-6)  # noqa: E731
                record("norm", f"rms_norm T={tokens} H={hidden}", dtype, compare(ffn(), tfn(), dtype),
                       time_eager(tfn), time_eager(ffn),
                       time_graph(tfn) if graph else None, time_graph(ffn) if graph else None)  # fmt: skip
                tfn = lambda: torch_ref(lambda: layer.forward_with_residual(x, res))  # noqa: E731
                ffn = lambda: f_add_rms(layer, x, res)  # noqa: E731
                (g_out, g_res), (r_out, r_res) = ffn(), tfn()
                c1, c2 = compare(g_out, r_out, dtype), compare(g_res, r_res, dtype)
                both = {**c1, "ok": c1["ok"] and c2["ok"], "max_err": max(c1["max_err"], c2["max_err"]),
                        "identical": min(c1["identical"], c2["identical"])}  # fmt: skip
                record("norm", f"add+rms_norm T={tokens} H={hidden}", dtype, both, time_eager(tfn), time_eager(ffn),
                       time_graph(tfn) if graph else None, time_graph(ffn) if graph else None)  # fmt: skip
        # per-head q norm on a strided view of qkv (Qwen3-0.6B: 16 q heads, 8 kv heads)
        d = SHAPES["head_dim"]
        for tokens in SHAPES["head_tokens"]:
            qkv = torch.randn(tokens, 32 * d, device=DEV, dtype=dtype, generator=gen)
            q = qkv[:, : 16 * d].view(tokens, 16, d)
            w = (torch.rand(d, device=DEV, generator=gen) + 0.5).to(dtype)
            graph = tokens <= 256
            tfn = lambda: rms_norm_torch(q, w, 1e-6)  # noqa: E731
            ffn = lambda: f_rms(q, w, 1e-6)  # noqa: E731
            record("norm", f"q_norm strided T={tokens} 16x{d}", dtype, compare(ffn(), tfn(), dtype),
                   time_eager(tfn), time_eager(ffn),
                   time_graph(tfn) if graph else None, time_graph(ffn) if graph else None)  # fmt: skip


def part_silu() -> None:
    gen = new_gen(1)
    for dtype in DTYPES:
        for inter in SHAPES["silu_inter"]:
            for tokens in SHAPES["tokens"]:
                if time_left() < 25:
                    log("  (budget: skipping remaining silu cases)")
                    return
                x = torch.randn(tokens, 2 * inter, device=DEV, dtype=dtype, generator=gen) * 2
                graph = tokens <= 256
                tfn = lambda: silu_and_mul_torch(x)  # noqa: E731
                ffn = lambda: f_silu(x)  # noqa: E731
                record("silu", f"silu_and_mul T={tokens} I={inter}", dtype, compare(ffn(), tfn(), dtype),
                       time_eager(tfn), time_eager(ffn),
                       time_graph(tfn) if graph else None, time_graph(ffn) if graph else None)  # fmt: skip


def part_rotary() -> None:
    gen = new_gen(2)
    set_rope_device(DEV)
    d, max_pos = SHAPES["head_dim"], SHAPES["max_pos"]
    ropes = {
        f"0.6B 16/8x{d}": (16, 8, RotaryEmbedding(RotaryConfig(d, d, max_pos, 1000000.0))),
        f"14B 40/8x{d}": (40, 8, RotaryEmbedding(RotaryConfig(d, d, max_pos, 1000000.0))),
        f"partial 8/2x{d} rot {d // 2}": (8, 2, RotaryEmbedding(RotaryConfig(d, d // 2, max_pos, 10000.0))),
    }
    for dtype in DTYPES:
        for label, (hq, hk, rope) in ropes.items():
            for i, tokens in enumerate(SHAPES["tokens"]):
                if time_left() < 25:
                    log("  (budget: skipping remaining rotary cases)")
                    return
                qkv = torch.randn(tokens, (hq + 2 * hk) * d, device=DEV, dtype=dtype, generator=gen)
                q = qkv[:, : hq * d].view(tokens, hq, d)
                k = qkv[:, hq * d : (hq + hk) * d].view(tokens, hk, d)
                pdt = torch.int64 if i % 2 else torch.int32
                pos = torch.randint(0, max_pos, (tokens,), device=DEV, dtype=pdt, generator=gen)
                tfn = lambda: rope.forward_torch(pos, q, k)  # noqa: E731
                ffn = lambda: f_rope(rope, pos, q, k)  # noqa: E731
                (gq, gk), (rq, rk) = ffn(), tfn()
                cmp = compare(torch.cat([gq.flatten(), gk.flatten()]), torch.cat([rq.flatten(), rk.flatten()]), dtype)
                graph = tokens <= 256
                record("rotary", f"{label} T={tokens} pos {str(pdt)[6:]}", dtype, cmp, time_eager(tfn), time_eager(ffn),
                       time_graph(tfn) if graph else None, time_graph(ffn) if graph else None)  # fmt: skip


def part_prologue() -> None:
    """The fused attention prologue (q/k norm + rotary + K/V store) against the torch ops it replaces."""
    from minisgl.layers.norm import rms_norm_torch

    gen = new_gen(3)
    set_rope_device(DEV)
    d, max_pos = SHAPES["head_dim"], SHAPES["max_pos"]
    rope = RotaryEmbedding(RotaryConfig(d, d, max_pos, 1000000.0))
    for dtype in DTYPES:
        for hq, hk, norm in ((16, 8, True), (40, 8, True), (32, 8, False)):
            for tokens in SHAPES["head_tokens"]:
                if time_left() < 25:
                    log("  (budget: skipping remaining prologue cases)")
                    return
                slots = 2 * tokens + 7
                qkv = torch.randn(tokens, (hq + 2 * hk) * d, device=DEV, dtype=dtype, generator=gen)
                qw = (torch.rand(d, device=DEV, generator=gen) + 0.5).to(dtype) if norm else None
                kw = (torch.rand(d, device=DEV, generator=gen) + 0.5).to(dtype) if norm else None
                pos = torch.randint(0, max_pos, (tokens,), device=DEV, dtype=torch.int32, generator=gen)
                loc = torch.randperm(slots, device=DEV, generator=gen)[:tokens].to(torch.int32)
                kc = torch.zeros(slots, hk, d, device=DEV, dtype=dtype)
                vc = torch.zeros_like(kc)
                rkc, rvc = torch.zeros_like(kc), torch.zeros_like(kc)

                def fused() -> torch.Tensor:
                    return triton_ops().attention_prologue(  # type: ignore[union-attr]
                        qkv, pos, qw, kw, 1e-6, rope.cos, rope.sin, kc, vc, loc, hq, hk, d
                    )

                def reference() -> torch.Tensor:
                    q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
                    q, k, v = q.view(tokens, hq, d), k.view(tokens, hk, d), v.view(tokens, hk, d)
                    if norm:
                        q, k = rms_norm_torch(q, qw, 1e-6), rms_norm_torch(k, kw, 1e-6)
                    q, k = rope.forward_torch(pos, q, k)
                    rkc.index_copy_(0, loc.long(), k)
                    rvc.index_copy_(0, loc.long(), v)
                    return q

                got, want = fused(), reference()
                cmp = compare(torch.cat([got.flatten(), kc.flatten(), vc.flatten()]),
                              torch.cat([want.flatten(), rkc.flatten(), rvc.flatten()]), dtype)  # fmt: skip
                graph = tokens <= 256
                record("prologue", f"{hq}/{hk}x{d} norm={norm} T={tokens}", dtype, cmp, time_eager(reference),
                       time_eager(fused), time_graph(reference) if graph else None, time_graph(fused) if graph else None)  # fmt: skip


def _moe_inputs(tokens: int, hidden: int, experts: int, top_k: int, dtype: torch.dtype, gen: torch.Generator):
    x = torch.randn(tokens, hidden, device=DEV, dtype=dtype, generator=gen)
    logits = torch.randn(tokens, experts, device=DEV, generator=gen) * 2
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    tw, ti = torch.topk(probs, top_k, dim=-1)
    tw = (tw / tw.sum(dim=-1, keepdim=True)).to(dtype)
    return x, tw, ti


def _moe_weights(gen: torch.Generator, dtype: torch.dtype = torch.float32):
    m = SHAPES["moe"]
    H, E, I = m["hidden"], m["experts"], m["inter"]
    w13 = (torch.randn(E, 2 * I, H, device=DEV, generator=gen) / math.sqrt(H)).to(dtype)
    w2 = (torch.randn(E, H, I, device=DEV, generator=gen) / math.sqrt(I)).to(dtype)
    return w13, w2


def part_moe() -> None:
    from minisgl.moe.torch_moe import TorchMoeBackend
    from minisgl.moe.triton_moe import TritonMoeBackend

    torch.backends.cuda.matmul.allow_tf32 = False
    m = SHAPES["moe"]
    H, E, K, I = m["hidden"], m["experts"], m["top_k"], m["inter"]
    gen = new_gen(3)
    ref_be, tri_be = TorchMoeBackend(), TritonMoeBackend()
    w13_32, w2_32 = _moe_weights(gen)
    for dtype in DTYPES:
        w13, w2 = w13_32.to(dtype), w2_32.to(dtype)
        w13_t, w2_t = w13.float(), w2.float()  # float32 "truth" of the same (rounded) weights
        token_list = SHAPES["moe_tokens_bf16"] if dtype == torch.bfloat16 else SHAPES["moe_tokens_fp32"]
        for tokens in token_list:
            if time_left() < 20:
                log("  (budget: skipping remaining moe cases)")
                break
            x, tw, ti = _moe_inputs(tokens, H, E, K, dtype, gen)
            tfn = lambda: torch_ref(lambda: ref_be.forward(x, w13, w2, tw, ti))  # noqa: E731
            ffn = lambda: tri_be.forward(x, w13, w2, tw, ti)  # noqa: E731
            got, ref = ffn(), tfn()
            scale = float(ref.float().abs().max())
            if dtype == torch.float32:
                cmp = compare(got, ref, dtype, atol=2e-5, rtol=1e-5)
                note = ""
            else:
                truth = torch_ref(lambda: ref_be.forward(x.float(), w13_t, w2_t, tw.float(), ti))
                e_tri = float((got.float() - truth).abs().max())
                e_ref = float((ref.float() - truth).abs().max())
                cmp = compare(got, ref, dtype, atol=0.02 * scale, rtol=0.0)
                cmp["ok"] = cmp["ok"] and e_tri <= max(1.5 * e_ref, 1e-3 * scale)
                note = f"vs fp32: triton {e_tri:.3g} torch {e_ref:.3g} (scale {scale:.3g});"
            t_ref = time_eager(tfn, target_ms=15)
            t_tri = time_eager(ffn)
            g_tri = time_graph(ffn, reps=10) if tokens <= 256 else None
            hit = int(torch.unique(ti).numel())
            wbytes = hit * (3 * I * H) * w13.element_size()
            best = g_tri if g_tri is not None else t_tri
            note += f" experts hit {hit}, weights {wbytes / 1e6:.0f} MB -> {wbytes / best / 1e9:.0f} GB/s"
            record("moe", f"T={tokens} H={H} E={E} k={K} I={I}", dtype, cmp, t_ref, t_tri, None, g_tri, note)
        if DEV.type == "cuda":
            torch.cuda.empty_cache()


def part_graph() -> None:
    """Fused ops + MoE captured once, replayed on new inputs, equal to eager."""
    from minisgl.moe.triton_moe import TritonMoeBackend

    if DEV.type != "cuda":
        log("  (no CUDA: skipped)")
        return
    gen = new_gen(4)
    set_rope_device(DEV)
    dtype, T, H, E, K, I = torch.bfloat16, 8, 512, 16, 4, 256
    norm = RMSNorm(H, 1e-6).to(DEV)
    norm.weight.data = (torch.rand(H, device=DEV, generator=gen) + 0.5).to(dtype)
    rope = RotaryEmbedding(RotaryConfig(64, 64, 4096, 10000.0))
    w13 = (torch.randn(E, 2 * I, H, device=DEV, generator=gen) / math.sqrt(H)).to(dtype)
    w2 = (torch.randn(E, H, I, device=DEV, generator=gen) / math.sqrt(I)).to(dtype)
    gate_up = (torch.randn(2 * I, H, device=DEV, generator=gen) / math.sqrt(H)).to(dtype)
    moe = TritonMoeBackend()
    static = {
        "x": torch.zeros(T, H, device=DEV, dtype=dtype), "res": torch.zeros(T, H, device=DEV, dtype=dtype),
        "pos": torch.zeros(T, device=DEV, dtype=torch.int32), "tw": torch.zeros(T, K, device=DEV, dtype=dtype),
        "ti": torch.zeros(T, K, device=DEV, dtype=torch.int64),
    }  # fmt: skip

    def step() -> List[torch.Tensor]:
        h, r = norm.forward_with_residual(static["x"], static["res"])
        q = h[:, : 4 * 64].view(T, 4, 64)
        k = h[:, 4 * 64 : 6 * 64].view(T, 2, 64)
        q2, k2 = rope(static["pos"], q, k)
        act = silu_and_mul(h @ gate_up.t())
        y = moe.forward(h, w13, w2, static["tw"], static["ti"])
        return [h, r, q2, k2, act, y]

    def fill() -> None:
        static["x"].copy_(torch.randn(T, H, device=DEV, generator=gen).to(dtype))
        static["res"].copy_(torch.randn(T, H, device=DEV, generator=gen).to(dtype))
        static["pos"].copy_(torch.randint(0, 4096, (T,), device=DEV, generator=gen, dtype=torch.int32))
        _, tw, ti = _moe_inputs(T, H, E, K, dtype, gen)
        static["tw"].copy_(tw)
        static["ti"].copy_(ti)

    fill()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    sync()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = step()
    for trial in range(3):
        fill()
        g.replay()
        want = step()
        sync()
        for name, a, b in zip(("add+rms_norm", "residual", "rope q", "rope k", "silu_and_mul", "moe"), outs, want):
            # same kernels on the same inputs: expect bitwise equality ("same" column); pass on bf16 tolerance
            record("graph", f"replay {trial} {name}", dtype, compare(a, b, dtype))


def part_moe_tune() -> None:
    """Sweep tile configs for the MoE GEMMs (bf16, Qwen3-30B-A3B layer) and print the best."""
    from minisgl.moe.triton_moe import MoeConfig, default_config, fused_moe, smem_bytes

    m = SHAPES["moe"]
    H, E, K = m["hidden"], m["experts"], m["top_k"]
    gen = new_gen(5)
    dtype = torch.bfloat16
    w13, w2 = _moe_weights(gen, dtype)
    small = [MoeConfig(16, n, k, 1, w, s) for n in (32, 64, 128) for k in (64, 128) for w, s in ((4, 3), (4, 4))]
    large = [MoeConfig(bm, n, 64, 8, w, s) for bm in (32, 64, 128) for n in (64, 128) for w, s in ((4, 3), (8, 3), (8, 4))]
    small = [c for c in small if smem_bytes(c) <= 200 * 1024]
    large = [c for c in large if smem_bytes(c) <= 200 * 1024]
    for tokens in (1, 8, 64, 256, 1024, 4096):
        if time_left() < 15:
            log("  (budget: stopping the sweep)")
            break
        x, tw, ti = _moe_inputs(tokens, H, E, K, dtype, gen)
        ref = fused_moe(x, w13, w2, tw, ti)
        scale = float(ref.float().abs().max())
        cands = small if tokens * K <= 16 * E else large
        default = default_config(tokens * K, E, dtype)
        results = []
        for cfg in [default] + [c for c in cands if c != default]:
            if time_left() < 10:
                break
            try:
                out = fused_moe(x, w13, w2, tw, ti, cfg)
                if not torch.allclose(out.float(), ref.float(), atol=0.02 * scale, rtol=0):
                    log(f"  T={tokens} {cfg}: MISMATCH")
                    FAILED.append(f"moe_tune: T={tokens} {cfg}")
                    continue
                fn = lambda: fused_moe(x, w13, w2, tw, ti, cfg)  # noqa: E731
                ms = time_graph(fn, reps=10) if tokens <= 256 else time_eager(fn)
                if ms is not None:
                    results.append((ms, cfg))
            except Exception as e:
                log(f"  T={tokens} {cfg}: {type(e).__name__}: {str(e)[:200]}")
        results.sort(key=lambda r: r[0])
        d_ms = next((ms for ms, c in results if c == default), None)
        for ms, cfg in results[:3]:
            log(f"  T={tokens:5d} {ms:.4f} ms  {cfg}" + ("  (default)" if cfg == default else ""))
        log(f"  T={tokens:5d} default {fmt_ms(d_ms)} ms  {default}")
        ROWS.append({"part": "moe_tune", "case": f"T={tokens}", "best": [(ms, str(c)) for ms, c in results[:3]],
                     "default_ms": d_ms})  # fmt: skip


PARTS: Dict[str, Callable[[], None]] = {
    "norm": part_norm, "silu": part_silu, "rotary": part_rotary, "prologue": part_prologue, "moe": part_moe, "graph": part_graph,
    "moe_tune": part_moe_tune,
}  # fmt: skip
DEFAULT_PARTS = "moe,norm,silu,rotary,prologue,graph"


def main() -> int:
    global BUDGET_S, DEV
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default=DEFAULT_PARTS, help=f"comma list of {','.join(PARTS)} (default {DEFAULT_PARTS})")
    ap.add_argument("--budget-s", type=float, default=170.0, help="skip remaining large cases past this many seconds")
    ap.add_argument("--out", default=None, help="directory to write kernels_check.json into")
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="tiny shapes; without CUDA runs on CPU (needs TRITON_INTERPRET=1): checks this script's plumbing",
    )
    args = ap.parse_args()
    BUDGET_S = args.budget_s
    if args.smoke:
        SHAPES.update(SMOKE_SHAPES)
    if args.smoke and not torch.cuda.is_available():
        if os.environ.get("TRITON_INTERPRET") != "1":
            log("gpu_kernels_check --smoke without CUDA needs TRITON_INTERPRET=1")
            return 2
        DEV = torch.device("cpu")
        patch_interpreter()
    elif not torch.cuda.is_available():
        log("gpu_kernels_check: CUDA is not available; this script checks the Triton kernels on a GPU "
            "(on CPU run tests/test_triton_kernels_interpret.py, which uses Triton's interpreter)")  # fmt: skip
        return 2
    if triton_ops() is None:
        log("gpu_kernels_check: triton is not importable; install triton to use the fused kernels")
        return 2
    import triton

    name = torch.cuda.get_device_name() if DEV.type == "cuda" else "cpu (Triton interpreter)"
    log(f"device {name} | torch {torch.__version__} | triton {triton.__version__}")
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        log(f"unknown parts {unknown}; choose from {sorted(PARTS)}")
        return 2
    for p in parts:
        run_part(p, PARTS[p])
    log(f"\n=== summary (t={time.time() - T0:.0f}s) ===")
    n_ok = sum(1 for r in ROWS if r.get("ok"))
    n_cmp = sum(1 for r in ROWS if "ok" in r)
    log(f"{n_ok}/{n_cmp} comparisons ok; {len(FAILED)} failed; {len(ERRORS)} parts raised")
    for f in FAILED:
        log(f"  FAILED {f}")
    for e in ERRORS:
        log(f"  ERROR  {e}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "kernels_check.json"), "w") as fh:
            json.dump({"rows": ROWS, "failed": FAILED, "errors": ERRORS}, fh, indent=1, default=str)
    return 1 if FAILED or ERRORS else 0


if __name__ == "__main__":
    sys.exit(main())
