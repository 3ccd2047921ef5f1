"""8-bit KV cache formats (kvcache/pool.py `kv_cache_dtype`): the quantizing store, the
dequantizing gather, validation, and the engine on an int8 pool against the same engine on a
model-dtype pool and against HF."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    TEST_DEVICE,
    allocated_reqs,
    engine_config,
    random_prompts,
    run_generation,
    running_engine,
    teacher_forced_logits,
)

from minisgl.engine import Engine
from minisgl.kvcache.pool import FP8_MAX, KVCachePool, kv_bytes_per_slot, quantize_int8_per_head


def test_int8_per_head_quantization_error_is_within_half_a_step():
    torch.manual_seed(0)
    x = torch.randn(50, 3, 64) * torch.logspace(-3, 2, 50)[:, None, None]
    x[7, 1] = 0.0  # an all-zero head: scale 0, codes 0, no division by zero
    codes, scale = quantize_int8_per_head(x)
    assert codes.dtype == torch.int8 and scale.shape == (50, 3)
    back = codes.float() * scale.unsqueeze(-1)
    amax = x.abs().amax(-1, keepdim=True)
    # round to nearest of x * 127 / amax: at most half a code step (amax / 254) off, plus fp32 slack
    assert torch.all((back - x).abs() <= amax / 254 * (1 + 1e-5) + 1e-30)
    assert torch.equal(back[7, 1], torch.zeros(64)) and scale[7, 1] == 0
    assert int(codes.abs().max()) == 127  # every head's absmax lands on the top code


def test_pool_store_and_gather_round_trip():
    torch.manual_seed(0)
    pool = KVCachePool(2, 40, 3, 16, torch.device("cpu"), torch.bfloat16, kv_cache_dtype="int8")
    assert pool.dtype == torch.int8 and pool.model_dtype == torch.bfloat16 and pool.quantized
    k, v = torch.randn(5, 3, 16, dtype=torch.bfloat16), torch.randn(5, 3, 16, dtype=torch.bfloat16) * 30
    loc = torch.tensor([3, 17, 4, 39, 0])
    pool.store_kv(k, v, loc, layer_id=1)
    gk, gv = pool.gather(1, loc.view(1, 5), torch.float32)
    assert gk.shape == (1, 5, 3, 16)
    for got, want in ((gk[0], k), (gv[0], v)):
        amax = want.float().abs().amax(-1, keepdim=True)
        assert torch.all((got - want.float()).abs() <= amax / 254 * (1 + 1e-5))
    assert torch.count_nonzero(pool.k_cache(0)) == 0  # the other layer is untouched
    expect = 2 * 2 * 40 * kv_bytes_per_slot("int8", torch.bfloat16, 1, 3, 16) // 2
    assert pool.nbytes == expect == 2 * 2 * 40 * 3 * (16 + 4)


def test_fp8_store_saturates_instead_of_nan():
    pool = KVCachePool(1, 8, 1, 4, torch.device("cpu"), torch.bfloat16, kv_cache_dtype="fp8_e4m3")
    k = torch.tensor([[[1000.0, -1000.0, 0.3, -2.5]]], dtype=torch.bfloat16)
    pool.store_kv(k, k, torch.tensor([2]), 0)
    gk, _ = pool.gather(0, torch.tensor([2]), torch.float32)
    assert torch.equal(gk[0, 0], torch.tensor([FP8_MAX, -FP8_MAX, 0.3, -2.5]).to(torch.float8_e4m3fn).float())
    assert pool.nbytes == 2 * 8 * 4  # one byte per value, no scales


def test_kv_cache_dtype_is_validated(tiny_model_dir):
    path = tiny_model_dir("llama")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8_e4m3, int8"):
        Engine(engine_config(path, kv_cache_dtype="fp4"))
    if TEST_DEVICE == "cpu":
        with pytest.raises(ValueError, match="needs a CUDA device"):
            Engine(engine_config(path, kv_cache_dtype="fp8_e4m3"))
    with pytest.raises(ValueError, match="deterministic mode needs the model-dtype KV cache"):
        Engine(engine_config(path, kv_cache_dtype="int8" if TEST_DEVICE == "cpu" else "fp8_e4m3", deterministic=True))


def test_server_args_take_kv_cache_dtype():
    from minisgl.server.args import parse_args

    args = parse_args(["--kv-cache-dtype", "int8"])
    assert args.engine["kv_cache_dtype"] == "int8"
    with pytest.raises(SystemExit):
        parse_args(["--kv-cache-dtype", "fp16"])


def _fake_quantized_store(monkeypatch):
    """The model-dtype pool, but every stored K/V first goes through int8 and back (the
    reference quantizer, checked on its own above): what an int8 pool must compute."""
    store = KVCachePool.store_kv

    def fake(self, k, v, out_loc, layer_id):
        def rt(x):
            codes, scale = quantize_int8_per_head(x)
            return (codes.float() * scale.unsqueeze(-1)).to(x.dtype)

        store(self, rt(k), rt(v), out_loc, layer_id)

    monkeypatch.setattr(KVCachePool, "store_kv", fake)


@pytest.mark.skipif(TEST_DEVICE != "cpu", reason="int8 is the CPU format (CUDA: fp8_e4m3, tested on the GPU)")
@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_int8_pool_equals_attention_over_dequantized_kv(tiny_model_dir, name, monkeypatch):
    """fp32 model, teacher-forced on one token sequence: the int8 pool's logits at every step
    (prefill and decode, the torch backend) equal those of the fp32 pool holding the same K/V
    quantized and dequantized, and greedy decoding (the engine's own path: the CPU attention
    backend's int8 kernels) gives the same tokens; against the plain fp32 pool they
    differ (the format is lossy) but stay close."""
    path = tiny_model_dir(name)
    prompts = random_prompts([9, 23, 40], seed=3)
    steps = 12
    with running_engine(path, max_running_req=3) as engine:
        ref_tokens = run_generation(engine, allocated_reqs(engine, prompts, steps), steps)
        plain = torch.stack(teacher_forced_logits(engine, allocated_reqs(engine, prompts, steps), ref_tokens))

    def run(fast: bool, **kw):
        # the logits on torch ops and the torch backend (the store's inputs bitwise alike); the
        # tokens on the engine's own path (the CPU kernels, where it runs them)
        with running_engine(path, max_running_req=3, cpu_fast_decode=False, **kw) as engine:
            logits = torch.stack(teacher_forced_logits(engine, allocated_reqs(engine, prompts, steps), ref_tokens))
        with running_engine(path, max_running_req=3, cpu_fast_decode=fast, **kw) as engine:
            return logits, run_generation(engine, allocated_reqs(engine, prompts, steps), steps)

    int8_logits, int8_tokens = run(True, kv_cache_dtype="int8")
    with monkeypatch.context() as m:
        _fake_quantized_store(m)
        fake_logits, fake_tokens = run(False)  # the torch backend stores through store_kv
    assert (int8_logits - fake_logits).abs().max().item() < 1e-4
    assert int8_tokens == fake_tokens
    diff = (int8_logits - plain).abs().max().item()
    assert 0 < diff < 0.1 * plain.abs().max().item()


# ---- the C kernels of the int8 pool (kernel/cpu/kv_int8.c) -----------------------------------
def _cpu_kernels():
    from minisgl.kernel.cpu import cpu_kernels

    kern = cpu_kernels()
    if kern is None:
        pytest.skip("no C compiler here")
    return kern


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 48])
def test_c_int8_store_is_bitwise_the_reference_store(dtype, d):
    """rope_store_q8 at position 0 (cos 1, sin 0: the rotation is the identity) writes the same
    codes and scales as KVCachePool's reference store, and leaves in the qkv row the values the
    pool now holds."""
    kern = _cpu_kernels()
    torch.manual_seed(0)
    hq, hk, rows, slots = 4, 2, 70, 100  # 70 rows: the store's parallel loop
    qkv = (torch.randn(rows, (hq + 2 * hk) * d) * torch.logspace(-2, 2, rows)[:, None]).to(dtype)
    qkv[3, hq * d : (hq + 1) * d] = 0  # an all-zero K head
    cos, sin = torch.ones(1, d, dtype=dtype), torch.zeros(1, d, dtype=dtype)
    pos = torch.zeros(rows, dtype=torch.int32)
    loc = torch.randperm(slots)[:rows].to(torch.int64)
    pool = KVCachePool(1, slots, hk, d, torch.device("cpu"), dtype, kv_cache_dtype="int8")
    k = qkv[:, hq * d : (hq + hk) * d].view(rows, hk, d).clone()
    v = qkv[:, (hq + hk) * d :].view(rows, hk, d).clone()
    pool.store_kv(k, v, loc, 0)
    kc, vc = torch.zeros(slots, hk, d, dtype=torch.int8), torch.zeros(slots, hk, d, dtype=torch.int8)
    ks, vs = torch.zeros(slots, hk), torch.zeros(slots, hk)
    kern.get("rope_store_q8", dtype)(
        qkv.data_ptr(), pos.data_ptr(), cos.data_ptr(), sin.data_ptr(), None, None, 1e-6, kc.data_ptr(), vc.data_ptr(),
        ks.data_ptr(), vs.data_ptr(), loc.data_ptr(), rows, hq, hk, d,
    )  # fmt: skip
    assert torch.equal(kc, pool.k_cache(0)) and torch.equal(vc, pool.v_cache(0))
    assert torch.equal(ks, pool.k_scale(0)) and torch.equal(vs, pool.v_scale(0))
    gk, gv = pool.gather(0, loc, torch.float32)
    assert torch.equal(qkv[:, hq * d : (hq + hk) * d].view(rows, hk, d), gk.to(dtype))
    assert torch.equal(qkv[:, (hq + hk) * d :].view(rows, hk, d), gv.to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d,hq,hk", [(64, 9, 3), (128, 8, 1), (32, 4, 2)])  # 32: the generic loop
def test_c_int8_attention_matches_softmax_over_dequantized_kv(dtype, d, hq, hk):
    """paged_attention_q8 over scattered slots of an int8 pool (lengths off the 16-key block)
    equals fp32 softmax(q k^T / sqrt(d)) v on the pool's dequantized K/V (KVCachePool.gather),
    up to the output's rounding."""
    kern = _cpu_kernels()
    torch.manual_seed(0)
    lens = [1, 15, 17, 100, 33]
    slots = 512
    pool = KVCachePool(1, slots, hk, d, torch.device("cpu"), dtype, kv_cache_dtype="int8")
    all_slots = torch.arange(slots)
    pool.store_kv(torch.randn(slots, hk, d) * 3, torch.randn(slots, hk, d), all_slots, 0)
    table = torch.stack([torch.randperm(slots)[:128] for _ in lens]).to(torch.int32).contiguous()
    width = (hq + 2 * hk) * d
    qkv = torch.randn(len(lens), width).to(dtype)
    out = torch.empty(len(lens), hq * d, dtype=dtype)
    rows = torch.arange(len(lens), dtype=torch.int64)
    kv_len = torch.tensor(lens, dtype=torch.int64)
    scale = d**-0.5
    kern.get("paged_attention_q8", dtype)(
        qkv.data_ptr(), width, pool.k_cache(0).data_ptr(), pool.v_cache(0).data_ptr(), pool.k_scale(0).data_ptr(),
        pool.v_scale(0).data_ptr(), table.data_ptr(), table.stride(0), rows.data_ptr(), kv_len.data_ptr(),
        out.data_ptr(), len(lens), hq, hk, d, scale, 2,
    )  # fmt: skip
    g = hq // hk
    for t, n in enumerate(lens):
        k, v = pool.gather(0, table[t, :n].long(), torch.float32)
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)  # [n, hq, d]
        q = qkv[t, : hq * d].float().view(hq, d)
        p = torch.softmax(torch.einsum("hd,nhd->hn", q, k) * scale, dim=-1)
        ref = torch.einsum("hn,nhd->hd", p, v).reshape(-1)
        err = ((out[t].float() - ref).abs() / (ref.abs() + 0.1)).max().item()
        # fp32: the scores are (q * scale . codes) * k_scale here, q . (codes * k_scale) * scale in
        # the reference; with keys 3x the unit scale that rounding reaches ~1e-5 after the softmax
        tol = 3e-5 if dtype == torch.float32 else 2**-8
        assert err <= tol, (t, n, err)
