"""The CUDA implementation of the projection ops at small batch: which projections take the
skinny-M Triton kernels (minisgl/kernel/triton_gemv.py), decided per weight shape and batch size
once, at engine init, by measurement.

The decoder layer is written once (models/base.py) from two ops: `layers.norm_linear` (residual
add + RMSNorm, then a projection, then SiLU-and-mul when gated) and the linear layers' own
`forward`. Each linear declares how its block calls it (`_Linear.fused_kind`: "plain",
"norm" = pre-norm with the residual add, "gated" = pre-norm + SiLU-gated output). With a plan
bound to the model (`SkinnyPlan.bind`), an op whose (kind, weight shape, batch bucket) the plan
covers is one GEMV launch instead of norm + GEMM (+ SiLU); everything else runs the native ops:

    qkv = gemv(x, W_qkv, pre-norm: input_layernorm, residual add)         # was add+norm, GEMM
    o   = gemv(attention(qkv), W_o)                                        # was GEMM
    act = gemv(o, W_gate_up, pre-norm: post_attention_layernorm,           # was add+norm, GEMM,
               residual add, gated: silu(gate) * up)                       #     SiLU-and-mul
    out = gemv(act, W_down)                                                # was GEMM

`build_plan` times, for each distinct (kind, shape) of the model and each batch bucket up to
`MAX_M`, the fused kernel against what it replaces (cuBLAS plus the separate norm / SiLU
kernels), each inside a CUDA graph over the model's own per-layer weights (so the weights come
from HBM, not L2, as in a real step), and keeps the kernel only where it is faster. With no plan
(CPU, fp32, tensor parallelism, deterministic mode) every op runs its native implementation.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Tuple

import torch
from torch import nn

from minisgl.utils.logger import init_logger

logger = init_logger(__name__)

# the sweep and the in-step measurement: from 8 rows on cuBLAS (see default_config)
MAX_M = 4
BUCKETS = (1, 2, 4)
# kinds: "norm" = pre-norm (+ residual add), "gated" = pre-norm + residual + SiLU-gated, "plain"
Kind = str
ShapeKey = Tuple[Kind, int, int]  # (kind, weight rows, K)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def default_config(kind: Kind, n_w: int, k: int, m: int) -> Any:
    """The tile for (shape, batch bucket), or None to leave the bucket to cuBLAS without timing
    it. From the H200 sweep (tools/gemv_tune.py; figures in docs/PERFORMANCE.md): at one row, ~512
    programs of whole weight rows with long K tiles beat cuBLAS on every Qwen3-0.6B projection;
    at 2-4 rows the broadcast path beats it on the plain projections (o, down), while the pre-norm
    ones only tie. From 8 rows on, the tl.dot tiles that won in isolation made the whole step
    slower (benchmark/latency.py), so they are not offered. The init measurement then keeps a tile
    only where it beats the module path on this GPU."""
    from minisgl.kernel.triton_gemv import GemvConfig

    n_out = n_w // 2 if kind == "gated" else n_w
    if m == 1:
        warps = 8 if kind == "plain" and k > 2048 else 4
        block_n = max(1, min(8, _pow2(max(1, n_out // 512))))
        block_k = min(_pow2(k), 2048 if kind == "plain" else 512)
        # register budget: accumulators + the prefetched next tile, no spills (compile check)
        while block_n * block_k * (2 if kind == "gated" else 1) > 2048 * warps and block_n > 1:
            block_n //= 2
        while block_n * block_k * (2 if kind == "gated" else 1) > 2048 * warps and block_k > 256:
            block_k //= 2
        return GemvConfig(1, block_n, block_k, warps, 1)  # no dot: nothing for Triton to pipeline
    if m <= 4 and kind == "plain":
        block_n = max(1, min(4, _pow2(max(1, n_out // (1024 if m == 2 else 256)))))
        block_k = min(_pow2(k), 1024)
        while m * block_n * block_k > 16384 and block_n > 1:
            block_n //= 2
        return GemvConfig(m, block_n, block_k, 4, 1)
    return None


@dataclass
class SkinnyPlan:
    """(kind, weight rows, K, bucket) -> tile config; a missing entry means the module path."""

    table: Dict[Tuple[Kind, int, int, int], Any] = field(default_factory=dict)
    timings: List[Dict[str, Any]] = field(default_factory=list)
    max_m: int = 0
    build_s: float = 0.0

    def config(self, kind: Kind, weight: torch.Tensor, m: int) -> Any:
        if m > self.max_m or m < 1:
            return None
        bucket = next(b for b in BUCKETS if b >= m)
        return self.table.get((kind, weight.shape[0], weight.shape[1], bucket))

    def run(
        self, kind: Kind, x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None, norm: Any = None
    ) -> Tuple[torch.Tensor, torch.Tensor | None] | None:
        """The fused GEMV for this op (`norm`: the RMSNorm module of a "norm"/"gated" op), or None
        where the plan keeps the native op. Returns (out, new residual or None)."""
        if x.dim() != 2 or x.stride(1) != 1:
            return None
        cfg = self.config(kind, weight, x.shape[0])
        if cfg is None:
            return None
        from minisgl.kernel.triton_gemv import gemv

        if kind == "plain":
            return gemv(x, weight, cfg)
        return gemv(x, weight, cfg, residual=residual, norm_weight=norm.weight, eps=norm.eps, gated=kind == "gated")

    def bind(self, model: nn.Module) -> None:
        """Hand the plan to every projection op of `model` that may take it (no bias: the kernel
        adds none). The ops read it as `linear.skinny`; the model owns it from here on."""
        for lin in fusable_linears(model):
            lin.skinny = self


# ---- the plan: measured at engine init -----------------------------------------------------------


def _graph_time(fn: Callable[[], Any], stream: Any, reps: int = 10) -> float:
    """Seconds per call of fn (a sequence of launches) replayed from a CUDA graph, median of 3."""
    with torch.cuda.stream(stream):
        fn()  # compile / warm up outside the capture
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=stream):
            fn()
        g.replay()
        times = []
        for _ in range(3):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            for _ in range(reps):
                g.replay()
            end.record(stream)
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / reps)
    del g
    return sorted(times)[1]


def _reference(kind: Kind, x: torch.Tensor, r: torch.Tensor, nw: torch.Tensor, w: torch.Tensor) -> Any:
    """What the fused kernel replaces: the module path's kernels (fused add+RMSNorm, cuBLAS, SiLU)."""
    import torch.nn.functional as F

    from minisgl.kernel import triton_ops

    if kind == "plain":
        return F.linear(x, w)
    h, _ = triton_ops.fused_add_rms_norm(x, r, nw, 1e-6)
    y = F.linear(h, w)
    return triton_ops.silu_and_mul(y) if kind == "gated" else y


def fusable_linears(model: nn.Module) -> List[Any]:
    """The projection ops of `model` a plan may cover: every linear layer (it declares its
    `fused_kind`) without a bias and with a dense weight (an FP8 one runs its own GEMM), in module order."""
    return [m for m in model.modules() if getattr(m, "fused_kind", None) is not None and getattr(m, "bias", 0) is None
            and getattr(m, "weight_scale", None) is None]  # fmt: skip


def build_plan(model: nn.Module, max_m: int, stream: Any, budget_s: float = 20.0) -> SkinnyPlan | None:
    """Time fused vs module path for each (kind, shape, bucket <= max_m) over the model's own
    weights; returns the plan (None if nothing wins). The caller binds it to the model."""
    from minisgl.kernel.triton_gemv import gemv

    linears = fusable_linears(model)
    if not linears or max_m < 1:
        return None
    p0 = linears[0].weight
    if not p0.is_cuda or p0.dtype not in (torch.bfloat16, torch.float16):
        return None
    weights: Dict[ShapeKey, List[Tuple[torch.Tensor, torch.Tensor]]] = {}
    norm_weights: Dict[int, torch.Tensor] = {}  # the pre-norm's weight only feeds the timing: ones of K
    for lin in linears:
        w = lin.weight
        k = w.shape[1]
        if k not in norm_weights:
            norm_weights[k] = torch.ones(k, dtype=w.dtype, device=w.device)
        weights.setdefault((lin.fused_kind, w.shape[0], k), []).append((w, norm_weights[k]))
    plan = SkinnyPlan(max_m=min(max_m, MAX_M))
    t_start = time.perf_counter()
    gen = torch.Generator(device=p0.device).manual_seed(0)
    for bucket in BUCKETS:
        if bucket > plan.max_m:
            break
        for (kind, n_w, k), pairs in weights.items():
            if time.perf_counter() - t_start > budget_s:
                logger.warning("skinny GEMM plan: init budget spent, the remaining shapes keep cuBLAS")
                break
            cfg = default_config(kind, n_w, k, bucket)
            if cfg is None:
                continue
            x = torch.randn(bucket, k, generator=gen, device=p0.device).to(p0.dtype)
            r = torch.randn(bucket, k, generator=gen, device=p0.device).to(p0.dtype)

            def fused(kind: Kind = kind, x: torch.Tensor = x, r: torch.Tensor = r, pairs: Any = pairs, cfg: Any = cfg) -> None:
                for w, nw in pairs:
                    if kind == "plain":
                        gemv(x, w, cfg)
                    else:
                        gemv(x, w, cfg, residual=r, norm_weight=nw, eps=1e-6, gated=kind == "gated")

            def module(kind: Kind = kind, x: torch.Tensor = x, r: torch.Tensor = r, pairs: Any = pairs) -> None:
                for w, nw in pairs:
                    _reference(kind, x, r, nw, w)

            try:
                t_module = _graph_time(module, stream) / len(pairs)
                t_fused = _graph_time(fused, stream) / len(pairs)
            except Exception as e:  # a tile this GPU cannot run (shared memory, say): cuBLAS
                logger.warning(f"skinny GEMM plan: {kind} {n_w}x{k} m={bucket} {cfg}: {e!r}; keeping cuBLAS")
                torch.cuda.synchronize()
                continue
            win = t_fused < t_module
            if win:
                plan.table[(kind, n_w, k, bucket)] = cfg
            plan.timings.append(
                {"kind": kind, "n": n_w, "k": k, "m": bucket, "fused_us": t_fused * 1e6, "module_us": t_module * 1e6, "fused": win}
            )
    if not plan.table:
        return None
    won = sum(t["fused"] for t in plan.timings)
    plan.build_s = time.perf_counter() - t_start
    logger.info_rank0(f"skinny GEMM plan: {won}/{len(plan.timings)} (shape, batch) cases take the fused kernels ({plan.build_s:.1f}s)")
    return plan
