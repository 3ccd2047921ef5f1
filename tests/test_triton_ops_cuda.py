"""The fused Triton ops and the Triton MoE backend against their torch references on CUDA, at the
shapes the models run (Qwen3-0.6B/14B norms and heads, a Qwen3-30B-A3B-shaped MoE layer):

norm:     RMSNorm and fused add+RMSNorm (hidden 1024 and 5120; per-head q_norm on a strided q view
          split out of qkv), through the layer entry points, so the dispatch is checked too.
silu:     SiLU-and-mul (I 768, 3072, 17408).
rotary:   RotaryEmbedding.forward (0.6B / 14B head layouts, a partial rotary dim, strided q/k views,
          int32 and int64 positions).
prologue: the fused attention prologue (split qkv, q/k RMSNorm, rotary, K/V store into pool slots).
moe:      TritonMoeBackend vs TorchMoeBackend (hidden 2048, 128 experts, top-8, intermediate 768),
          1..4096 tokens. bf16: both against a float32 evaluation of the same bf16 weights; the
          Triton error at most 1.5x the torch backend's (or 1e-3 of the output scale), and the two
          within 2% of the output scale. fp32: within 2e-5 + 1e-5 relative (TF32 off).
graph:    the fused ops and the MoE captured in one CUDA graph, replayed on new inputs (new
          routing): equal to the eager results.

Tolerances: bf16 a few ulps (atol 1e-2, rtol 1.6e-2), fp32 1e-5 (the kernels round to the model
dtype where the torch code does). Skipped unless MINISGL_TEST_DEVICE=cuda; on the CPU
tests/test_triton_kernels_interpret.py runs the kernels through Triton's interpreter."""

from __future__ import annotations

import math
from typing import Any, Callable, Optional, Tuple

import pytest
import torch
from helpers import TEST_DEVICE

pytestmark = pytest.mark.skipif(TEST_DEVICE != "cuda", reason="the Triton kernels on the GPU (MINISGL_TEST_DEVICE=cuda)")

DEV = torch.device("cuda")
DTYPES = [torch.bfloat16, torch.float32]
TOKENS = [1, 64, 4096]
HEAD_TOKENS = [1, 256, 4096]
D, MAX_POS = 128, 40960
MOE = dict(hidden=2048, experts=128, top_k=8, inter=768)


def assert_close(
    got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, atol: Optional[float] = None, rtol: float = 0.0, name: str = ""
) -> None:
    g, r = got.float(), ref.float()
    if atol is None:
        atol, rtol = (1e-5, 1e-5) if dtype == torch.float32 else (1e-2, 1.6e-2)
    assert g.shape == r.shape, f"{name}: shape {tuple(g.shape)} vs {tuple(r.shape)}"
    assert bool(torch.isfinite(g).all()), f"{name}: non-finite output"
    err = float((g - r).abs().max()) if g.numel() else 0.0
    assert torch.allclose(g, r, atol=atol, rtol=rtol), f"{name}: max |err| {err:.3g}"


def torch_ref(fn: Callable[[], Any]) -> Any:
    """fn with the fused ops switched off: the torch code the kernels replace."""
    from minisgl.kernel.fused import set_fused_ops_enabled

    prev = set_fused_ops_enabled(False)
    try:
        return fn()
    finally:
        set_fused_ops_enabled(prev)


def gen(seed: int) -> torch.Generator:
    return torch.Generator(device=DEV).manual_seed(seed)


@pytest.fixture(autouse=True)
def _rope_tables_on_cuda():
    """RotaryEmbedding builds its tables on the rope device (a module global): CUDA here, put back after."""
    import minisgl.layers.rotary as R

    prev = R._ROPE_DEVICE
    R.set_rope_device(DEV)
    yield
    R.set_rope_device(prev)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [1024, 5120])
@pytest.mark.parametrize("tokens", TOKENS)
def test_rms_norm(dtype: torch.dtype, hidden: int, tokens: int) -> None:
    from minisgl.kernel.fused import use_fused
    from minisgl.layers.norm import RMSNorm, rms_norm, rms_norm_torch

    g = gen(0)
    x = torch.randn(tokens, hidden, device=DEV, dtype=dtype, generator=g) * 2
    res = torch.randn(tokens, hidden, device=DEV, dtype=dtype, generator=g)
    layer = RMSNorm(hidden, 1e-6).to(DEV)
    layer.weight.data = (torch.rand(hidden, device=DEV, generator=g) + 0.5).to(dtype)
    assert use_fused(x)
    assert_close(rms_norm(x, layer.weight, 1e-6), rms_norm_torch(x, layer.weight, 1e-6), dtype)
    out, new_res = layer.forward_with_residual(x, res)
    ref_out, ref_res = torch_ref(lambda: layer.forward_with_residual(x, res))
    assert_close(out, ref_out, dtype)
    assert_close(new_res, ref_res, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", HEAD_TOKENS)
def test_q_norm_on_a_strided_view(dtype: torch.dtype, tokens: int) -> None:
    """Per-head q norm on a strided view of qkv (Qwen3-0.6B: 16 q heads, 8 kv heads)."""
    from minisgl.layers.norm import rms_norm, rms_norm_torch

    g = gen(1)
    qkv = torch.randn(tokens, 32 * D, device=DEV, dtype=dtype, generator=g)
    q = qkv[:, : 16 * D].view(tokens, 16, D)
    w = (torch.rand(D, device=DEV, generator=g) + 0.5).to(dtype)
    assert_close(rms_norm(q, w, 1e-6), rms_norm_torch(q, w, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [768, 3072, 17408])
@pytest.mark.parametrize("tokens", TOKENS)
def test_silu_and_mul(dtype: torch.dtype, inter: int, tokens: int) -> None:
    from minisgl.layers.activation import silu_and_mul, silu_and_mul_torch

    x = torch.randn(tokens, 2 * inter, device=DEV, dtype=dtype, generator=gen(2)) * 2
    assert_close(silu_and_mul(x), silu_and_mul_torch(x), dtype)


ROPES = {  # label: (q heads, kv heads, rotary dim, theta)
    "0.6B 16/8": (16, 8, D, 1000000.0),
    "14B 40/8": (40, 8, D, 1000000.0),
    "partial 8/2 rot 64": (8, 2, D // 2, 10000.0),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", list(ROPES))
@pytest.mark.parametrize("tokens, pos_dtype", [(1, torch.int32), (64, torch.int64), (4096, torch.int32)])
def test_rotary(dtype: torch.dtype, layout: str, tokens: int, pos_dtype: torch.dtype) -> None:
    from minisgl.layers.rotary import RotaryConfig, RotaryEmbedding

    hq, hk, rot, theta = ROPES[layout]
    rope = RotaryEmbedding(RotaryConfig(D, rot, MAX_POS, theta))
    g = gen(3)
    qkv = torch.randn(tokens, (hq + 2 * hk) * D, device=DEV, dtype=dtype, generator=g)
    q = qkv[:, : hq * D].view(tokens, hq, D)
    k = qkv[:, hq * D : (hq + hk) * D].view(tokens, hk, D)
    pos = torch.randint(0, MAX_POS, (tokens,), device=DEV, dtype=pos_dtype, generator=g)
    gq, gk = rope(pos, q, k)
    rq, rk = rope.forward_torch(pos, q, k)
    assert_close(torch.cat([gq.flatten(), gk.flatten()]), torch.cat([rq.flatten(), rk.flatten()]), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq, hk, norm", [(16, 8, True), (40, 8, True), (32, 8, False)])
@pytest.mark.parametrize("tokens", HEAD_TOKENS)
def test_attention_prologue(dtype: torch.dtype, hq: int, hk: int, norm: bool, tokens: int) -> None:
    """q/k norm + rotary + K/V store in one kernel against the torch ops it replaces."""
    from minisgl.kernel.fused import triton_ops
    from minisgl.layers.norm import rms_norm_torch
    from minisgl.layers.rotary import RotaryConfig, RotaryEmbedding

    rope = RotaryEmbedding(RotaryConfig(D, D, MAX_POS, 1000000.0))
    g = gen(4)
    slots = 2 * tokens + 7
    qkv = torch.randn(tokens, (hq + 2 * hk) * D, device=DEV, dtype=dtype, generator=g)
    qw = (torch.rand(D, device=DEV, generator=g) + 0.5).to(dtype) if norm else None
    kw = (torch.rand(D, device=DEV, generator=g) + 0.5).to(dtype) if norm else None
    pos = torch.randint(0, MAX_POS, (tokens,), device=DEV, dtype=torch.int32, generator=g)
    loc = torch.randperm(slots, device=DEV, generator=g)[:tokens].to(torch.int32)
    kc, vc = torch.zeros(slots, hk, D, device=DEV, dtype=dtype), torch.zeros(slots, hk, D, device=DEV, dtype=dtype)
    ops = triton_ops()
    assert ops is not None
    got = ops.attention_prologue(qkv, pos, qw, kw, 1e-6, rope.cos, rope.sin, kc, vc, loc, hq, hk, D)
    q, k, v = qkv.split([hq * D, hk * D, hk * D], dim=-1)
    q, k, v = q.view(tokens, hq, D), k.view(tokens, hk, D), v.view(tokens, hk, D)
    if qw is not None and kw is not None:
        q, k = rms_norm_torch(q, qw, 1e-6), rms_norm_torch(k, kw, 1e-6)
    q, k = rope.forward_torch(pos, q, k)
    rkc, rvc = torch.zeros_like(kc), torch.zeros_like(kc)
    rkc.index_copy_(0, loc.long(), k)
    rvc.index_copy_(0, loc.long(), v)
    assert_close(torch.cat([got.flatten(), kc.flatten(), vc.flatten()]), torch.cat([q.flatten(), rkc.flatten(), rvc.flatten()]), dtype)


def moe_inputs(tokens: int, dtype: torch.dtype, g: torch.Generator) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = torch.randn(tokens, MOE["hidden"], device=DEV, dtype=dtype, generator=g)
    probs = torch.softmax(torch.randn(tokens, MOE["experts"], device=DEV, generator=g) * 2, dim=-1, dtype=torch.float32)
    tw, ti = torch.topk(probs, MOE["top_k"], dim=-1)
    return x, (tw / tw.sum(dim=-1, keepdim=True)).to(dtype), ti


@pytest.fixture(scope="module")
def moe_weights() -> Tuple[torch.Tensor, torch.Tensor]:
    g = gen(5)
    H, E, I = MOE["hidden"], MOE["experts"], MOE["inter"]
    w13 = torch.randn(E, 2 * I, H, device=DEV, generator=g) / math.sqrt(H)
    w2 = torch.randn(E, H, I, device=DEV, generator=g) / math.sqrt(I)
    return w13, w2


@pytest.mark.parametrize(
    "dtype, tokens", [(torch.bfloat16, t) for t in (1, 4, 16, 64, 256, 1024, 4096)] + [(torch.float32, t) for t in (1, 64, 1024)]
)
def test_triton_moe_matches_torch_moe(moe_weights, dtype: torch.dtype, tokens: int) -> None:
    from minisgl.moe.torch_moe import TorchMoeBackend
    from minisgl.moe.triton_moe import TritonMoeBackend

    prev_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        w13, w2 = (w.to(dtype) for w in moe_weights)
        x, tw, ti = moe_inputs(tokens, dtype, gen(6 + tokens))
        ref_be = TorchMoeBackend()
        got = TritonMoeBackend().forward(x, w13, w2, tw, ti)
        ref = torch_ref(lambda: ref_be.forward(x, w13, w2, tw, ti))
        if dtype == torch.float32:
            assert_close(got, ref, dtype, atol=2e-5, rtol=1e-5)
            return
        scale = float(ref.float().abs().max())
        truth = torch_ref(lambda: ref_be.forward(x.float(), w13.float(), w2.float(), tw.float(), ti))
        e_tri, e_ref = float((got.float() - truth).abs().max()), float((ref.float() - truth).abs().max())
        assert_close(got, ref, dtype, atol=0.02 * scale)
        assert e_tri <= max(1.5 * e_ref, 1e-3 * scale), f"vs fp32: triton {e_tri:.3g}, torch {e_ref:.3g} (scale {scale:.3g})"
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev_tf32


def test_fused_ops_and_moe_replay_in_a_graph() -> None:
    """Captured once, replayed on new inputs (new routing): the eager results (no host syncs, no
    data-dependent allocations)."""
    from minisgl.layers.activation import silu_and_mul
    from minisgl.layers.norm import RMSNorm
    from minisgl.layers.rotary import RotaryConfig, RotaryEmbedding
    from minisgl.moe.triton_moe import TritonMoeBackend

    g = gen(7)
    dtype, T, H, E, K, I = torch.bfloat16, 8, 512, 16, 4, 256
    norm = RMSNorm(H, 1e-6).to(DEV)
    norm.weight.data = (torch.rand(H, device=DEV, generator=g) + 0.5).to(dtype)
    rope = RotaryEmbedding(RotaryConfig(64, 64, 4096, 10000.0))
    w13 = (torch.randn(E, 2 * I, H, device=DEV, generator=g) / math.sqrt(H)).to(dtype)
    w2 = (torch.randn(E, H, I, device=DEV, generator=g) / math.sqrt(I)).to(dtype)
    gate_up = (torch.randn(2 * I, H, device=DEV, generator=g) / math.sqrt(H)).to(dtype)
    moe = TritonMoeBackend()
    x, res = torch.zeros(T, H, device=DEV, dtype=dtype), torch.zeros(T, H, device=DEV, dtype=dtype)
    pos = torch.zeros(T, device=DEV, dtype=torch.int32)
    tw, ti = torch.zeros(T, K, device=DEV, dtype=dtype), torch.zeros(T, K, device=DEV, dtype=torch.int64)

    def step() -> list:
        h, r = norm.forward_with_residual(x, res)
        q2, k2 = rope(pos, h[:, : 4 * 64].view(T, 4, 64), h[:, 4 * 64 : 6 * 64].view(T, 2, 64))
        return [h, r, q2, k2, silu_and_mul(h @ gate_up.t()), moe.forward(h, w13, w2, tw, ti)]

    def fill() -> None:
        x.copy_(torch.randn(T, H, device=DEV, generator=g).to(dtype))
        res.copy_(torch.randn(T, H, device=DEV, generator=g).to(dtype))
        pos.copy_(torch.randint(0, 4096, (T,), device=DEV, generator=g, dtype=torch.int32))
        probs = torch.softmax(torch.randn(T, E, device=DEV, generator=g) * 2, dim=-1)
        w, i = torch.topk(probs, K, dim=-1)
        tw.copy_((w / w.sum(-1, keepdim=True)).to(dtype))
        ti.copy_(i)

    fill()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for _ in range(3):
        fill()
        graph.replay()
        want = step()
        torch.cuda.synchronize()
        for name, a, b in zip(("add+rms_norm", "residual", "rope q", "rope k", "silu_and_mul", "moe"), outs, want):
            assert_close(a, b, dtype, name=name)
