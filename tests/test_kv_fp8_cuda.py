"""The fp8_e4m3 KV cache on CUDA (kv_cache_dtype="fp8_e4m3"): the GPU kernels that write it store
the bytes of the pool's reference store (`KVCachePool._store_quantized`), the engine on an fp8
pool computes what the same engine computes on a model-dtype pool holding the same K/V rounded
through fp8, and CUDA graphs replay what runs eagerly. Skipped unless MINISGL_TEST_DEVICE=cuda
(CI has no GPU; every CUDA import is inside a test)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import (
    TEST_DEVICE,
    allocated_reqs,
    random_prompts,
    run_generation,
    running_engine,
    teacher_forced_logits,
)

from minisgl.kvcache.pool import FP8_MAX, KVCachePool

pytestmark = pytest.mark.skipif(TEST_DEVICE != "cuda", reason="the fp8 KV cache is the CUDA format (MINISGL_TEST_DEVICE=cuda)")
FP8 = torch.float8_e4m3fn


def _round_trip(x: torch.Tensor) -> torch.Tensor:
    """What an fp8 pool holds for x, back in x's dtype (the reference: saturate, round to nearest)."""
    return x.float().clamp(-FP8_MAX, FP8_MAX).to(FP8).to(x.dtype)


def _with_outliers(x: torch.Tensor) -> torch.Tensor:
    """Values past e4m3's range (+-448, and infinities) must saturate, not turn into NaN."""
    x = x.clone()
    x.view(-1)[:6] = torch.tensor([1000.0, -1000.0, 448.0, 470.0, float("inf"), -float("inf")])
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kernels_write_the_pool_reference_bytes(dtype: torch.dtype) -> None:
    from minisgl.kernel import triton_ops
    from minisgl.kernel.triton_attention import store_kv
    from minisgl.layers.rotary import RotaryConfig, RotaryEmbedding

    dev = torch.device("cuda")
    torch.manual_seed(0)
    T, Hk, Hq, D, slots = 37, 4, 8, 128, 300
    loc = torch.randperm(slots, device=dev)[:T].to(torch.int32)
    ref = KVCachePool(1, slots, Hk, D, dev, dtype, kv_cache_dtype="fp8_e4m3")
    got = KVCachePool(1, slots, Hk, D, dev, dtype, kv_cache_dtype="fp8_e4m3")
    for scale in (0.01, 1.0, 100.0):  # subnormals, the bulk, saturation
        k = _with_outliers(torch.randn(T, Hk, D, device=dev) * scale).to(dtype)
        v = (torch.randn(T, Hk, D, device=dev) * scale).to(dtype)
        ref.store_kv(k, v, loc, 0)
        store_kv(got.k_cache(0), got.v_cache(0), k, v, loc)
        assert torch.equal(got.buffer.view(torch.uint8), ref.buffer.view(torch.uint8)), scale

    # the fused attention prologue: its fp8 store == the reference store of what it stores in the model dtype
    rope = RotaryEmbedding(RotaryConfig(D, D, 4096, 1e6))
    cos, sin = rope.cos.to(dev), rope.sin.to(dev)
    qkv = (torch.randn(T, (Hq + 2 * Hk) * D, device=dev) * 200).to(dtype)  # v saturates, k is normed
    pos = torch.randint(0, 4096, (T,), device=dev, dtype=torch.int32)
    qw, kw = ((torch.rand(D, device=dev) + 0.5).to(dtype) for _ in range(2))
    wide = torch.zeros(2, slots, Hk, D, device=dev, dtype=dtype)
    narrow = torch.zeros(2, slots, Hk, D, device=dev, dtype=FP8)
    q_wide = triton_ops.attention_prologue(qkv, pos, qw, kw, 1e-6, cos, sin, wide[0], wide[1], loc, Hq, Hk, D)
    q_narrow = triton_ops.attention_prologue(qkv, pos, qw, kw, 1e-6, cos, sin, narrow[0], narrow[1], loc, Hq, Hk, D)
    assert torch.equal(q_wide, q_narrow)
    ref8 = torch.zeros_like(narrow)
    idx = loc.long()
    ref8[:, idx] = wide[:, idx].float().clamp(-FP8_MAX, FP8_MAX).to(FP8)
    assert torch.equal(narrow.view(torch.uint8), ref8.view(torch.uint8))
    assert not narrow.float().isnan().any()


def _round_trip_on_store(engine: Any) -> None:
    """A model-dtype pool whose every stored K/V goes through fp8 and back: before each layer's
    attention (the fused prologue or the backend stored them just before), the step's slots are
    replaced by their fp8 round trip. What an fp8 pool must compute."""
    backend, kv = engine.attn_backend, engine.kv_cache
    attend = backend.attend

    def fake(q: torch.Tensor, layer_id: int, batch: Any) -> torch.Tensor:
        idx = batch.out_loc.long()
        for cache in (kv.k_cache(layer_id), kv.v_cache(layer_id)):
            cache[idx] = _round_trip(cache[idx])
        return attend(q, layer_id, batch)

    backend.attend = fake


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_fp8_pool_equals_attention_over_round_tripped_kv(tiny_model_dir: Any, name: str, backend: str, dtype: torch.dtype) -> None:
    """Teacher-forced logits at every step (a prefill, then decode steps, eager): the fp8 pool's
    equal those of the model-dtype pool holding the fp8-rounded K/V; against the plain pool they
    differ (the format is lossy) but stay close."""
    path = tiny_model_dir(name)
    prompts = random_prompts([9, 23, 40, 70], seed=3)
    steps = 12
    kw = dict(max_running_req=4, attention_backend=backend, dtype=dtype)
    with running_engine(path, **kw) as engine:
        ref_tokens = run_generation(engine, allocated_reqs(engine, prompts, steps), steps)
        plain = torch.stack(teacher_forced_logits(engine, allocated_reqs(engine, prompts, steps), ref_tokens))
        _round_trip_on_store(engine)
        fake = torch.stack(teacher_forced_logits(engine, allocated_reqs(engine, prompts, steps), ref_tokens))
    with running_engine(path, kv_cache_dtype="fp8_e4m3", **kw) as engine:
        assert engine.kv_cache.dtype == FP8
        fp8 = torch.stack(teacher_forced_logits(engine, allocated_reqs(engine, prompts, steps), ref_tokens))
    assert not fp8.isnan().any()
    diff = (fp8 - fake).abs().max().item()
    print(f"{name} {backend} {dtype}: |fp8 - round-tripped| {diff:.3g}, |fp8 - plain| {(fp8 - plain).abs().max().item():.3g}")
    # fp32 (and the torch backend): the same arithmetic on the same values. bf16 on triton: decode
    # runs its dots in fp16 over an fp8 pool (exact inputs, p rounded to fp16 instead of bf16)
    assert diff <= (1e-5 if dtype == torch.float32 or backend == "torch" else 2e-2) * plain.abs().max().item()
    lossy = (fp8 - plain).abs().max().item()
    assert 0 < lossy < 0.5 * plain.abs().max().item()  # a tiny random model: e4m3 keeps ~4 bits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_cuda_graphs_equal_eager(tiny_model_dir: Any, dtype: torch.dtype) -> None:
    """Greedy tokens on an fp8 pool, triton backend: the prefill through the mixed-step graphs and
    the decode steps through the decode graphs (batch 3 pads to 4) == every step eager."""
    path = tiny_model_dir("qwen3")
    prompts = random_prompts([9, 23, 40], seed=5)
    steps = 16
    kw = dict(max_running_req=4, attention_backend="triton", dtype=dtype, kv_cache_dtype="fp8_e4m3")
    with running_engine(path, **kw) as engine:
        assert engine.graph_runner.batch_sizes, "no decode graphs captured"
        graphs = run_generation(engine, allocated_reqs(engine, prompts, steps), steps)
    with running_engine(path, cuda_graph_bs=[], cuda_graph_max_tokens=0, **kw) as engine:
        eager = run_generation(engine, allocated_reqs(engine, prompts, steps), steps)
    assert graphs == eager


@pytest.mark.parametrize("mode", ["dot", "cc"])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_fp8_decode_kernels_match_a_float32_reference(mode: str, group: int) -> None:
    """Every decode kernel over an fp8 pool (tensor-core, CUDA-core) ==
    float32 attention over the pool's values: direct and split-K, mixed lengths (one shorter than a
    tile, one not a multiple of it), scattered slots, every e4m3 magnitude class."""
    import minisgl.kernel.triton_attention as TA

    gen = torch.Generator().manual_seed(group)
    hk, D, lens = 4, 128, [3, 77, 700, 1029]
    hq, B, slots = hk * group, len(lens), 8192
    k8 = (torch.randn(slots, hk, D, generator=gen) * 8).clamp(-448, 448).to(FP8).cuda()
    v8 = (torch.randn(slots, hk, D, generator=gen) * 8).clamp(-448, 448).to(FP8).cuda()
    k8.view(-1)[:4] = torch.tensor([2.0**-9, -448.0, 448.0, -0.0]).to(FP8)
    pt = torch.zeros(B, max(lens), dtype=torch.int32)
    perm = torch.randperm(slots, generator=gen)
    for i, n in enumerate(lens):
        pt[i, :n] = perm[i * 1030 : i * 1030 + n]
    pt, seq = pt.cuda(), torch.tensor(lens).cuda()
    q = torch.randn(B, hq, D, generator=gen).to(torch.bfloat16).cuda()
    idx = pt.long()
    kk, vv = k8[idx].float(), v8[idx].float()  # [B, W, Hk, D]
    s = torch.einsum("bhgd,bwhd->bhgw", q.float().view(B, hk, group, D), kk) * D**-0.5
    s = s.masked_fill(torch.arange(idx.shape[1], device="cuda")[None, None, None, :] >= seq[:, None, None, None], -1e30)
    ref = torch.einsum("bhgw,bwhd->bhgd", s.softmax(-1), vv).reshape(B, hq, D)
    old = TA.FP8_DECODE
    try:
        TA.FP8_DECODE = mode
        for S in (1, 5):
            splits = torch.tensor([min(S, -(-n // 64)) for n in lens]).cuda()
            mid_o = torch.full((B, hq, S, D), float("nan"), device="cuda")
            mid_lse = torch.full((B, hq, S), float("nan"), device="cuda")
            out = torch.full_like(q, float("nan"))
            order = torch.tensor([3, 2, 1, 0]).cuda()
            TA.decode_attention(q, k8, v8, pt, torch.arange(B).cuda(), seq, splits, mid_o, mid_lse, out, D**-0.5, order=order)
            err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
            assert not out.isnan().any() and err < 8e-3, (mode, group, S, err)  # the bf16 output's rounding
    finally:
        TA.FP8_DECODE = old
