"""The projection ops of the decoder layer (layers/norm_linear.py, the linear layers' forward) and
their CUDA implementation, the skinny GEMV plan (kernel/skinny.py), on a CPU machine.

1. Native: `norm_linear` is residual add + RMSNorm, the projection and (gated) SiLU-and-mul, and
   with no plan bound (or a plan that does not cover the shape) the layer runs exactly that.
2. Triton (in Triton's interpreter, a subprocess: TRITON_INTERPRET must be set before triton
   imports): with a plan bound, every op takes the fused GEMV, and a whole decoder layer (the one
   definition in models/base.py) agrees with its unfused reference, layer 0 (no residual yet)
   included.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, List, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from minisgl.distributed import set_tp_info
from minisgl.distributed.info import clear_tp_info
from minisgl.kernel import skinny
from minisgl.layers import ColumnParallelLinear, RMSNorm, RowParallelLinear
from minisgl.layers.activation import silu_and_mul, silu_and_mul_torch
from minisgl.layers.norm import rms_norm, rms_norm_torch
from minisgl.layers.norm_linear import norm_linear
from minisgl.models.base import DecoderLayer, GatedMLP

HIDDEN, Q, INTER = 96, 64, 40


class StandInAttention(nn.Module):
    """The block protocol of models/base.py with a projection pair like SelfAttention's, and in
    place of attention a scale of the first Q columns (attention needs a KV pool and a batch)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv_proj = ColumnParallelLinear(HIDDEN, 2 * Q)
        self.o_proj = RowParallelLinear(Q, HIDDEN)
        self.qkv_proj.fused_kind = "norm"

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm) -> Tuple[torch.Tensor, torch.Tensor]:
        qkv, residual = norm_linear(norm, self.qkv_proj, x, residual)
        return self.o_proj(qkv[:, :Q] * 0.5), residual


def _layer(dtype: torch.dtype) -> DecoderLayer:
    cfg: Any = type("Cfg", (), {"hidden_size": HIDDEN, "rms_norm_eps": 1e-6})()
    layer = DecoderLayer(cfg, StandInAttention(), GatedMLP(HIDDEN, INTER, "silu")).to(dtype)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            noise = torch.randn(p.shape, generator=gen) * 0.2 + (1.0 if p.dim() == 1 else 0.0)
            p.copy_(noise.to(dtype))
    return layer


def _reference(layer: DecoderLayer, x: torch.Tensor, residual: torch.Tensor | None) -> Tuple[torch.Tensor, torch.Tensor]:
    """The decoder layer written out in torch ops, nothing fused."""
    attn, mlp = layer.self_attn, layer.mlp
    ln1, ln2 = layer.input_layernorm, layer.post_attention_layernorm
    s = x if residual is None else x + residual
    qkv = F.linear(rms_norm_torch(s, ln1.weight, ln1.eps), attn.qkv_proj.weight)
    o = F.linear(qkv[:, :Q] * 0.5, attn.o_proj.weight)
    s2 = o + s
    act = silu_and_mul_torch(F.linear(rms_norm_torch(s2, ln2.weight, ln2.eps), mlp.gate_up_proj.weight))
    return F.linear(act, mlp.down_proj.weight), s2


def _plan(layer: nn.Module, buckets: Tuple[int, ...] = (1, 4)) -> skinny.SkinnyPlan:
    """A plan covering every projection of `layer` at `buckets` (tiles small enough for K=96)."""
    from minisgl.kernel.triton_gemv import GemvConfig

    plan = skinny.SkinnyPlan(max_m=max(buckets))
    for lin in skinny.fusable_linears(layer):
        n_w, k = lin.weight.shape
        for b in buckets:
            plan.table[(lin.fused_kind, n_w, k, b)] = GemvConfig(1, 16, 32, 4, 1) if b == 1 else GemvConfig(4, 2, 32, 4, 1)
    return plan


@pytest.fixture(autouse=True)
def _tp1():
    set_tp_info(rank=0, size=1)
    yield
    clear_tp_info()


def test_blocks_declare_how_they_call_each_projection() -> None:
    layer = _layer(torch.float32)
    kinds = {name: lin.fused_kind for name, lin in layer.named_modules() if hasattr(lin, "fused_kind")}
    assert kinds == {
        "self_attn.qkv_proj": "norm",
        "self_attn.o_proj": "plain",
        "mlp.gate_up_proj": "gated",
        "mlp.down_proj": "plain",
    }


def test_norm_linear_native_is_norm_then_linear() -> None:
    norm, lin = RMSNorm(HIDDEN, 1e-6), ColumnParallelLinear(HIDDEN, 2 * INTER, bias=True)
    with torch.no_grad():
        for p in (*norm.parameters(), *lin.parameters()):
            p.copy_(torch.randn_like(p))
    x, r = torch.randn(3, HIDDEN), torch.randn(3, HIDDEN)
    y, res = norm_linear(norm, lin, x, r)
    torch.testing.assert_close(res, x + r, rtol=0, atol=0)
    # (the ops themselves, whichever implementation this device takes: the C kernels on a CPU)
    torch.testing.assert_close(y, F.linear(rms_norm(x + r, norm.weight, 1e-6), lin.weight, lin.bias), rtol=0, atol=0)
    y, res = norm_linear(norm, lin, x, None, gated=True)  # layer 0: the stream starts as x
    assert res is x
    ref = silu_and_mul(F.linear(rms_norm(x, norm.weight, 1e-6), lin.weight, lin.bias))
    torch.testing.assert_close(y, ref, rtol=0, atol=0)


def test_decoder_layer_without_a_covering_plan_runs_the_native_ops() -> None:
    """A plan that covers no batch of this size, or no shape of this layer, changes nothing: the
    layer's result is bitwise the one with no plan. Biased projections are never bound."""
    layer = _layer(torch.float32)
    x, r = torch.randn(3, HIDDEN), torch.randn(3, HIDDEN)
    want = layer(x, r)
    torch.testing.assert_close(want, _reference(layer, x, r), rtol=1e-5, atol=1e-5)
    plan = _plan(layer, buckets=(1,))  # 3 rows: past the plan's max_m
    plan.bind(layer)
    assert all(lin.skinny is plan for lin in skinny.fusable_linears(layer))
    got = layer(x, r)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    biased = ColumnParallelLinear(HIDDEN, 8, bias=True)
    assert biased not in skinny.fusable_linears(nn.ModuleList([biased]))


def _interpreted_checks() -> None:
    """Run in a subprocess with TRITON_INTERPRET=1 (see the test below)."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from minisgl.kernel import triton_gemv
    from minisgl.kernel.interpreter import patch_interpreter

    patch_interpreter()
    set_tp_info(rank=0, size=1)
    calls: List[str] = []
    real_gemv = triton_gemv.gemv

    def counting_gemv(*args: Any, **kwargs: Any) -> Any:
        calls.append("gated" if kwargs.get("gated") else "norm" if kwargs.get("norm_weight") is not None else "plain")
        return real_gemv(*args, **kwargs)

    triton_gemv.gemv = counting_gemv  # type: ignore[assignment]
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        # float32: only the summation order differs. bf16: the product rounds once, possibly one
        # ulp from torch's, and the layer rounds a few more times after it.
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        layer = _layer(dtype)
        _plan(layer).bind(layer)
        for m in (1, 3):  # 3 rows: the broadcast path of bucket 4 (bf16 included: no tl.dot)
            x = torch.randn(m, HIDDEN, dtype=dtype)
            for residual in (None, torch.randn(m, HIDDEN, dtype=dtype)):
                calls.clear()
                got = layer(x, residual)
                assert calls == ["norm", "plain", "gated", "plain"], calls  # every op took the GEMV
                for g, w in zip(got, _reference(layer, x, residual)):
                    torch.testing.assert_close(g.float(), w.float(), rtol=tol, atol=tol)
        lin = layer.mlp.down_proj  # the plain op on its own
        x = torch.randn(1, INTER, dtype=dtype)
        calls.clear()
        torch.testing.assert_close(lin(x).float(), F.linear(x, lin.weight).float(), rtol=tol, atol=tol)
        assert calls == ["plain"]
    print("interpreted checks passed")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_ops_take_the_triton_gemv_in_the_interpreter() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    root = Path(__file__).resolve().parent.parent
    env["PYTHONPATH"] = os.pathsep.join([str(root), str(root / "tests"), env.get("PYTHONPATH", "")])
    code = "import test_norm_linear as t; t._interpreted_checks()"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, cwd=root)
    assert proc.returncode == 0, f"interpreted checks failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    assert "interpreted checks passed" in proc.stdout
