"""The CPU forward (the C kernels behind the layers' ops, the decode loop: engine/cpu_decode.py,
kernel/cpu) and weight-only quantization.

- fp32 through the C kernels equals the torch ops (and so HF) on the tiny models; the decode
  loop is bitwise the module path;
- the GGUF's Q4_1 codes map onto the int4 kernel without loss (dequantized == transformers');
- fp32 + the GGUF's int4 codes is token-exact (tie-aware) against HF fp32 on the same weights;
- bf16 agrees with HF bf16 under the tie-aware rule with a bf16-sized tie threshold;
- bf16 + 4-bit: every token we generate is in HF's top 5 on the same prefix (HF bf16 on the
  dequantized weights, teacher-forced on our tokens); the rate of tokens that differ from
  HF's argmax is printed (pytest -s) and bounded.
"""

from __future__ import annotations

import functools
from typing import List, Tuple

import pytest
import torch
from helpers import PageAllocator, allocated_reqs, assert_greedy_match, make_req, prepare_batch, run_generation, running_engine

from minisgl.engine.cpu_decode import bound_gemms
from minisgl.layers.quant import Int4Weight, Int8Weight, QuantLinear

EOS = 2
QUESTIONS = ["What is the capital of France?", "Name three primary colors."]
# bf16 logits of this model (|logit| ~ 10-25) are spaced 0.06-0.125 apart: a divergence where
# HF's own top-2 gap is within a couple of those steps is a tie in bf16.
BF16_TIE_EPS = 0.3


def _chat_ids(tokenizer, question: str) -> List[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True)
    return list(ids if isinstance(ids, list) else ids["input_ids"])


def _generate(engine, prompts: List[List[int]], steps: int) -> List[List[int]]:
    alloc = PageAllocator(engine)
    reqs = []
    for row, ids in enumerate(prompts):
        alloc.allocate(row, len(ids) + steps)
        reqs.append(make_req(ids, row, output_len=steps))
    return run_generation(engine, reqs, steps)


# ---- quantized weights -------------------------------------------------------------------------
def _q4_1_blocks(n: int, k: int):
    """Random Q4_1 blocks as GGUF stores them: codes spanning [0, 15], fp16 d and m."""
    codes = torch.randint(0, 16, (n, k))
    codes[:, 0::32], codes[:, 1::32] = 0, 15  # Q4_1 blocks span their min and max
    d = (torch.rand(n, k // 32) * 0.01 + 1e-3).half().float()
    m = (torch.randn(n, k // 32) * 0.05).half().float()
    return codes, d, m


@pytest.mark.parametrize("k", [128, 96])  # 96: an odd number of blocks (the record pads a pair)
def test_q4_1_maps_onto_int4_without_loss(k):
    torch.manual_seed(0)
    n = 48
    codes, d, m = _q4_1_blocks(n, k)
    w = Int4Weight.from_q4_1(codes, d, m)
    expect = codes.float() * d.repeat_interleave(32, 1) + m.repeat_interleave(32, 1)
    assert torch.equal(w.dequantize(), expect)  # d * q + m in fp32, as gguf-py computes it
    got_codes, got_d, got_m = w.blocks()
    assert torch.equal(got_codes.long(), codes) and torch.equal(got_d, d) and torch.equal(got_m, m)
    # round-to-nearest on weights already on a Q4_1 grid recovers that grid (up to fp rounding)
    again = Int4Weight.quantize(expect)
    assert torch.allclose(again.dequantize(), expect, atol=1e-5)
    x = torch.randn(3, k)
    assert torch.allclose(w.mm(x), x @ expect.t(), atol=1e-4)  # fp32: torch's int4 kernel


def test_int8_blocks_and_quant_linear_dispatch():
    torch.manual_seed(0)
    dense = torch.randn(40, 64)
    q = Int8Weight.quantize(dense)
    # within half a step of each 32-block's own scale (fp16, as Q8_0 stores it)
    step = (dense.reshape(40, 2, 32).abs().amax(-1) / 127).half().float().repeat_interleave(32, 1)
    assert ((q.dequantize() - dense).abs() <= step / 2 + 1e-6).all()
    lin = QuantLinear(dense, q, dense_above=4)
    small, big = torch.randn(2, 64), torch.randn(6, 64)
    assert torch.allclose(lin(small), small @ q.dequantize().t(), atol=1e-4)  # quantized weights
    assert torch.equal(lin(big), torch.nn.functional.linear(big, dense))  # dense above the threshold


@pytest.mark.parametrize("bits,k", [(4, 576), (4, 1536), (4, 96), (8, 576), (8, 96)])
def test_quantized_gemv_matches_fp32_reference(bits, k):
    """The C kernel on GGUF's blocks (kernel/cpu/qgemv.c) for bf16 activations: fp32 sums of the
    exact dequantized weights, one rounding to bf16 (within one bf16 step of the fp32 reference
    on the same weights), for 1-8 rows (the register tiles), 11 (two row blocks), strided rows
    and an odd number of 64-column pairs; the same weights' torch path agrees."""
    from minisgl.kernel.cpu import cpu_kernels

    kern = cpu_kernels()
    if kern is None or not kern.has_qgemv:
        pytest.skip("no C compiler or no AVX512-BF16 here")
    torch.manual_seed(0)
    n = 203  # not a multiple of any row tile or the 16-row thread chunk
    if bits == 4:
        q = Int4Weight.from_q4_1(*_q4_1_blocks(n, k))
    else:
        q = Int8Weight.quantize(torch.randn(n, k) * 0.05)
    w = q.dequantize()
    for m in (1, 2, 3, 4, 5, 6, 7, 8, 11):
        wide = torch.randn(m, k + 32).bfloat16()
        for x in (wide[:, :k], wide[:, :k].contiguous()):
            ref = x.float() @ w.t()
            ours = q.mm(x, nthreads=2)
            assert ours.dtype == torch.bfloat16 and ours.shape == (m, n)
            assert ((ours.float() - ref).abs() <= ref.abs() * 2**-8 + 1e-3 * ref.abs().max()).all(), m
    # the fallback on the same records (fp32 activations) computes the same product
    x = torch.randn(3, k)
    if bits == 4 and n % 16:
        q = Int4Weight.from_q4_1(*_q4_1_blocks(208, k))  # torch's int4 layout wants n % 16 == 0
        w = q.dequantize()
    assert torch.allclose(q.mm(x), x @ w.t(), atol=1e-4)


@pytest.mark.parametrize("k", [576, 200])  # 200: a masked tail of 8 after six 32-blocks
def test_bf16_gemv_matches_fp32_reference(k):
    """The C skinny GEMM (kernel/cpu/gemv.c) behind QuantLinear for <= gemv_max_rows bf16 rows:
    fp32 sums of exact bf16 products, one rounding to bf16, so every output is within one bf16
    step of the fp32 reference (and as close as torch's own bf16 linear); rows past the limit
    and fp32 inputs take torch's GEMM."""
    from minisgl.kernel.cpu import cpu_kernels

    kern = cpu_kernels()
    if kern is None or not kern.has_gemv:
        pytest.skip("no C compiler or no AVX512-BF16 here")
    torch.manual_seed(0)
    n = 203  # not a multiple of the 8-row tile or the 64-row thread chunk
    w = (torch.randn(n, k) * 0.05).to(torch.bfloat16)
    bias = torch.randn(n).to(torch.bfloat16)
    for b in (None, bias):
        lin = QuantLinear(w, None, b, gemv=kern.lib.gemv_bf16, gemv_max_rows=8, nthreads=2)
        for m in (1, 2, 3, 5, 8):
            x = torch.randn(m, k).to(torch.bfloat16)
            ref = x.float() @ w.float().t() + (b.float() if b is not None else 0)
            ours = lin(x)
            assert ours.dtype == torch.bfloat16 and ours.shape == (m, n)
            step = ref.abs() * 2**-8 + 1e-6  # one bf16 rounding of the exact sum, with fp32 slack
            assert ((ours.float() - ref).abs() <= 1.01 * step).all(), m
            torch_err = (torch.nn.functional.linear(x, w, b).float() - ref).abs().mean()
            assert (ours.float() - ref).abs().mean() <= 1.5 * torch_err + 1e-6
        x = torch.randn(9, k).to(torch.bfloat16)
        assert torch.equal(lin(x), torch.nn.functional.linear(x, w, b))  # past the limit: torch
    # strided rows (a slice of a wider activation) are read correctly
    wide = torch.randn(2, k + 64).to(torch.bfloat16)
    x = wide[:, :k]
    got = QuantLinear(w, None, gemv=kern.lib.gemv_bf16, nthreads=2)(x)
    ref = QuantLinear(w, None)(x.contiguous())
    assert (got.float() - ref.float()).abs().max() <= ref.float().abs().max() * 2**-7


@pytest.mark.parametrize("m,n,k", [(9, 48, 64), (40, 960, 576), (500, 80, 1536), (16, 16, 32)])
def test_amx_gemm_matches_fp32_reference(m, n, k):
    """The AMX tile GEMM (kernel/cpu/amx.c) behind QuantLinear for > gemv_max_rows bf16 rows:
    within one bf16 rounding of the fp32 reference, as torch's bf16 linear is (row blocks off
    16, an odd number of 16-column tiles, strided rows); shapes it does not tile fall back."""
    from minisgl.kernel.cpu import cpu_kernels

    kern = cpu_kernels()
    if kern is None or not kern.has_amx:
        pytest.skip("no C compiler or no AMX here")
    torch.manual_seed(0)
    w = (torch.randn(n, k) * 0.05).to(torch.bfloat16)
    bias = torch.randn(n).to(torch.bfloat16)
    wide = torch.randn(m, k + 32).to(torch.bfloat16)
    for b, x in ((None, wide[:, :k].contiguous()), (bias, wide[:, :k])):
        lin = QuantLinear(w, None, b, gemv=kern.lib.gemv_bf16, gemv_max_rows=8, nthreads=2, gemm=kern.lib.gemm_amx_bf16)
        ref = x.float() @ w.float().t() + (b.float() if b is not None else 0)
        ours = lin(x)
        assert ours.dtype == torch.bfloat16 and ours.shape == (m, n)
        assert ((ours.float() - ref).abs() <= 1.01 * (ref.abs() * 2**-8 + 1e-6)).all()
        torch_err = (torch.nn.functional.linear(x, w, b).float() - ref).abs().mean()
        assert (ours.float() - ref).abs().mean() <= 1.5 * torch_err + 1e-6
    w_odd = (torch.randn(n, 40) * 0.05).to(torch.bfloat16)  # k % 32 != 0: declined, torch's GEMM
    lin = QuantLinear(w_odd, None, gemm=kern.lib.gemm_amx_bf16, nthreads=2)
    x = torch.randn(m, 40).to(torch.bfloat16)
    assert torch.equal(lin(x), torch.nn.functional.linear(x, w_odd))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d,hq,hk", [(64, 9, 3), (128, 8, 1), (32, 4, 2)])  # 32: the generic loop
def test_paged_attention_kernel_matches_softmax_reference(dtype, d, hq, hk):
    """The C decode attention over scattered pool slots (lengths off the 16-key block, one and
    several rows per table row) equals fp32 softmax(q k^T / sqrt(d)) v on the same values, up
    to the output's rounding."""
    from minisgl.kernel.cpu import cpu_kernels

    kern = cpu_kernels()
    if kern is None:
        pytest.skip("no C compiler here")
    torch.manual_seed(0)
    lens = [1, 15, 17, 100, 33]
    slots_n = 512
    kc = torch.randn(slots_n, hk, d).to(dtype)
    vc = torch.randn(slots_n, hk, d).to(dtype)
    table = torch.stack([torch.randperm(slots_n)[:128] for _ in lens]).to(torch.int32).contiguous()
    width = (hq + 2 * hk) * d  # queries are read out of qkv rows, as in the runner
    qkv = torch.randn(len(lens), width).to(dtype)
    out = torch.empty(len(lens), hq * d, dtype=dtype)
    rows = torch.arange(len(lens), dtype=torch.int64)
    kv_len = torch.tensor(lens, dtype=torch.int64)
    scale = d**-0.5
    fn = kern.get("paged_attention", dtype)
    fn(qkv.data_ptr(), width, kc.data_ptr(), vc.data_ptr(), table.data_ptr(), table.stride(0), rows.data_ptr(),
       kv_len.data_ptr(), out.data_ptr(), len(lens), hq, hk, d, scale, 2)  # fmt: skip
    g = hq // hk
    for t, n in enumerate(lens):
        sl = table[t, :n].long()
        q = qkv[t, : hq * d].float().view(hq, d)
        k = kc[sl].float().repeat_interleave(g, dim=1)  # [n, hq, d]
        v = vc[sl].float().repeat_interleave(g, dim=1)
        p = torch.softmax(torch.einsum("hd,nhd->hn", q, k) * scale, dim=-1)
        ref = torch.einsum("hn,nhd->hd", p, v).reshape(-1)
        tol = 1e-5 if dtype == torch.float32 else 2**-8
        assert ((out[t].float() - ref).abs() <= tol * (ref.abs() + 0.1)).all(), (t, n)


@pytest.mark.parametrize("h", [576, 40])  # 40: not a multiple of 16, the scalar loop
def test_bf16_norm_and_silu_kernels_match_torch(h):
    """add_rms_norm / silu_mul in bf16 (vectorized where h % 16 == 0) against the module path's
    torch ops: equal up to one bf16 step in a handful of elements (summation order, exp's last
    bit), the residual stream bitwise equal."""
    from minisgl.kernel.cpu import cpu_kernels

    kern = cpu_kernels()
    if kern is None:
        pytest.skip("no C compiler here")
    torch.manual_seed(0)
    rows, eps = 70, 1e-5  # >= 64 rows: the parallel loop
    x, res, w = (torch.randn(rows, h) * 3).bfloat16(), torch.randn(rows, h).bfloat16(), torch.randn(h).bfloat16()
    want_res = x + res
    xf = want_res.float()
    want = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).bfloat16()
    out, r = torch.empty_like(x), res.clone()
    kern.get("add_rms_norm", torch.bfloat16)(x.data_ptr(), r.data_ptr(), w.data_ptr(), out.data_ptr(), rows, h, eps, 1)
    assert torch.equal(r, want_res)
    step = want.float().abs() * 2**-7 + 1e-30
    close = (out.float() - want.float()).abs() <= step
    assert close.all() and (out != want).float().mean() < 0.01
    gu = (torch.randn(rows, 2 * h) * 4).bfloat16()
    want = torch.nn.functional.silu(gu[:, :h]) * gu[:, h:]
    act = torch.empty(rows, h, dtype=torch.bfloat16)
    kern.get("silu_mul", torch.bfloat16)(gu.data_ptr(), act.data_ptr(), rows, h)
    assert ((act.float() - want.float()).abs() <= want.float().abs() * 2**-7 + 1e-30).all()
    assert (act != want).float().mean() < 0.01


@pytest.mark.parametrize("d,qk_norm", [(64, False), (64, True), (128, True), (48, True)])  # 48: scalar loop
def test_bf16_rope_store_matches_torch(d, qk_norm):
    """rope_store in bf16 (16 lanes wide where d % 32 == 0) against HF's ops on the same rows:
    optional per-head RMSNorm, then T(x cos) + T(rotate_half(x) sin), every op rounded to bf16;
    K and V land in their pool slots."""
    from minisgl.kernel.cpu import cpu_kernels

    kern = cpu_kernels()
    if kern is None:
        pytest.skip("no C compiler here")
    torch.manual_seed(0)
    rows, hq, hk, eps = 70, 4, 2, 1e-6
    qkv = (torch.randn(rows, (hq + 2 * hk) * d) * 2).bfloat16()
    pos = torch.randint(0, 256, (rows,), dtype=torch.int32)
    cos, sin = torch.randn(256, d).bfloat16(), torch.randn(256, d).bfloat16()
    qn, kn = (torch.rand(d) + 0.5).bfloat16(), (torch.rand(d) + 0.5).bfloat16()
    loc = torch.randperm(128)[:rows].long()
    kc, vc = torch.zeros(128, hk, d, dtype=torch.bfloat16), torch.zeros(128, hk, d, dtype=torch.bfloat16)

    def ref(x: torch.Tensor, w: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:  # [rows, heads, d]
        """The rotated rows, and the size of the two terms they sum (the error scale: where
        x cos and rotate_half(x) sin nearly cancel, the normed x's last-bit differences between
        rsqrt implementations stay absolute, not relative to the small result)."""
        if qk_norm:
            xf = x.float()
            x = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).bfloat16()
        c, s_ = cos[pos.long()][:, None], sin[pos.long()][:, None]
        rot = torch.cat((-x[..., d // 2 :], x[..., : d // 2]), dim=-1)
        return x * c + rot * s_, (x * c).float().abs() + (rot * s_).float().abs()

    q = qkv[:, : hq * d].view(rows, hq, d)
    k = qkv[:, hq * d : (hq + hk) * d].view(rows, hk, d)
    (want_q, size_q), (want_k, size_k) = ref(q, qn), ref(k, kn)
    want_v = qkv[:, (hq + hk) * d :].view(rows, hk, d).clone()
    got = qkv.clone()
    nul = lambda t: t.data_ptr() if qk_norm else None  # noqa: E731
    kern.get("rope_store", torch.bfloat16)(got.data_ptr(), pos.data_ptr(), cos.data_ptr(), sin.data_ptr(), nul(qn), nul(kn),
                                           eps, kc.data_ptr(), vc.data_ptr(), loc.data_ptr(), rows, hq, hk, d)  # fmt: skip
    for ours, want, size in ((got[:, : hq * d].view(rows, hq, d), want_q, size_q), (kc[loc], want_k, size_k)):
        step = size * 2**-7 + want.float().abs() * 2**-8 + 1e-30  # the terms' last bits, and the sum's rounding
        assert ((ours.float() - want.float()).abs() <= step).all() and (ours != want).float().mean() < 0.01
    assert torch.equal(vc[loc], want_v)


def test_gguf_codes_equal_transformers_dequantization(embedded_model_dir):
    from safetensors.torch import load_file

    from minisgl.models.gguf_quant import gguf_source, load_gguf_quant

    src = gguf_source(embedded_model_dir)
    assert src is not None and src.endswith(".gguf")  # the converted folder remembers its GGUF
    quant = load_gguf_quant(src, 9, 3)
    sd = load_file(f"{embedded_model_dir}/model.safetensors")
    for layer in (0, 29):
        p = f"model.layers.{layer}."
        ref = {
            "self_attn.qkv_proj": torch.cat([sd[p + f"self_attn.{x}_proj.weight"] for x in "qkv"]),
            "self_attn.o_proj": sd[p + "self_attn.o_proj.weight"],
            "mlp.gate_up_proj": torch.cat([sd[p + f"mlp.{x}_proj.weight"] for x in ("gate", "up")]),
            "mlp.down_proj": sd[p + "mlp.down_proj.weight"],
        }
        for name, w in ref.items():
            assert torch.equal(quant[p + name].dequantize(), w.float()), f"{p}{name}"
    head = quant["lm_head"].dequantize()  # the file's Q8_0 blocks as they are
    assert torch.equal(head, sd["model.embed_tokens.weight"].float())


# ---- the CPU path on tiny models (fp32, exact) ------------------------------------------------
def _module_logits(engine, batch):
    from minisgl.engine.runners import ModuleRunner

    with torch.inference_mode(), engine.ctx.forward_batch(batch):
        return ModuleRunner(engine.model).run(batch).float()


@pytest.mark.parametrize("name,kv", [("llama", "auto"), ("qwen3", "auto"), ("mistral", "auto"), ("llama", "int8"), ("mistral", "int8")])
def test_cpu_ops_match_the_torch_ops(tiny_model_dir, name, kv, monkeypatch, request):
    """The same prompts through the CPU path (the C kernels behind the layers' ops and the cpu
    attention backend, prefill and decode) and through the torch ops alone (no C kernels, the
    torch backend): identical greedy tokens, and decode and prefill logits within float32
    noise. With the int8 KV pool (kv_int8.c against the pool's reference store and gather) as
    with the fp32 one."""
    from minisgl.kernel.cpu import cpu_kernels
    from minisgl.kernel.cpu.attention import CpuAttnBackend

    request.addfinalizer(cpu_kernels.cache_clear)  # later tests see the environment's setting
    prompts = [[3, 17, 42, 9, 100, 7], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 200]]
    outs, logits = {}, {}
    for fast in (False, True):
        monkeypatch.setenv("MINISGL_CPU_KERNELS", "1" if fast else "0")
        cpu_kernels.cache_clear()
        with running_engine(tiny_model_dir(name), max_running_req=2, cpu_fast_decode=fast, kv_cache_dtype=kv) as engine:
            assert isinstance(engine.attn_backend, CpuAttnBackend) == fast
            if fast:
                assert engine.attn_backend.kernels is not None, "the C kernels did not build"
            outs[fast] = _generate(engine, prompts, 8)
            reqs = [make_req(p + o[:-1], row, output_len=2, cached_len=len(p) + 6) for row, (p, o) in
                    enumerate(zip(prompts, outs[fast]))]  # fmt: skip
            logits[fast] = _module_logits(engine, prepare_batch(engine, reqs, "decode"))
            # a prefill of both prompts, the second over a cached prefix of 4 tokens
            reqs = [make_req(prompts[0], 0, output_len=1), make_req(prompts[1], 1, output_len=1, cached_len=4)]
            logits[fast, "prefill"] = _module_logits(engine, prepare_batch(engine, reqs, "prefill"))[:2]
    # int8 K/V: a 1-ulp difference in an fp32 K value (C rotary vs torch's) can move its code by
    # one step, ~1% of that value; anything wrong with codes, scales or slots is O(1)
    tol = 1e-4 if kv == "auto" else 3e-3
    assert outs[True] == outs[False]
    assert (logits[True] - logits[False]).abs().max().item() < tol
    assert (logits[True, "prefill"] - logits[False, "prefill"]).abs().max().item() < tol


def test_quantization_is_validated(tiny_model_dir):
    with pytest.raises(ValueError, match="unknown quantization"):
        with running_engine(tiny_model_dir("llama"), quantization="int3"):
            pass
    with pytest.raises(ValueError, match="CPU decode path"):
        with running_engine(tiny_model_dir("llama"), quantization="int8", cpu_fast_decode=False):
            pass
    with pytest.raises(ValueError, match="needs a .gguf"):
        with running_engine(tiny_model_dir("llama"), quantization="gguf"):
            pass


@pytest.mark.parametrize("method", ["int4", "int8"])
def test_rtn_quantization_runs_on_any_checkpoint(tiny_model_dir, method):
    with running_engine(tiny_model_dir("qwen3"), max_running_req=2, quantization=method) as engine:
        assert any(g.quant is not None for g in bound_gemms(engine.model))
        out = _generate(engine, [[3, 17, 42, 9]], 6)[0]
    assert len(out) == 6 and all(0 <= t < 256 for t in out)


@pytest.mark.parametrize(
    "name,quant,kv",
    [("llama", None, "auto"), ("qwen3", None, "auto"), ("qwen3", "int4", "auto"), ("qwen3", "int8", "auto"),
     ("llama", None, "int8"), ("qwen3", "int4", "int8")],
)  # fmt: skip
def test_decode_loop_equals_the_module_path(tiny_model_dir, name, quant, kv):
    """bf16 decode batches run all layers in one C call (kernel/cpu/decode_loop.c, the
    `CpuDecodeLoop` step runner): the same kernels in the same order as the module path's ops
    on the CPU, so logits and the K/V written are bitwise equal (llama: q/k/v/o biases; qwen3:
    q/k norms, a tied head; int4/int8 codes for up to 4 rows, the dense weight past them). Each
    batch size the loop takes is compared (on a CPU without AMX up to 4 rows), and prefills of
    a few tokens per request, which the loop runs as decode rows with their own key counts."""
    from minisgl.engine.cpu_decode import CpuDecodeLoop
    from minisgl.kernel.cpu import cpu_kernels

    kern = cpu_kernels()
    if kern is None or not kern.has_gemv:
        pytest.skip("no C compiler or no AVX512-BF16 here")
    prompts = [[3, 17, 42, 9, 100, 7], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 200], [1, 2, 3]]
    prompts += [[p + 1 for p in q] for q in prompts]  # 6 rows: past the quantized rows, dense on AMX
    sizes = (1, 3, 6)
    with running_engine(tiny_model_dir(name), max_running_req=8, dtype=torch.bfloat16, quantization=quant,
                        kv_cache_dtype=kv) as engine:  # fmt: skip
        loop = engine.cpu_runner
        assert isinstance(loop, CpuDecodeLoop) and loop in engine.runners, "the decode loop was not built"
        pool_state = lambda: (engine.kv_cache.buffer.clone(), None if kv == "auto" else engine.kv_cache.scales.clone())  # noqa: E731
        outs = _generate(engine, prompts, 4)
        results = {}
        pool = pool_state()
        compared = []
        # decode batches of each size; and prefills of a few tokens per request (a verify step's
        # shape: each row's last token and its drafts), their every row's hidden state too
        cases = [(size, (1,) * size) for size in sizes] + [(-1, (1, 3)), (-2, (2, 1, 1))]
        for size, extends in cases:
            reqs = [make_req(p + o[:-1], row, output_len=2, cached_len=len(p) + 3 - e) for row, (p, o, e) in
                    enumerate(zip(prompts, outs, extends))]  # fmt: skip
            batch = prepare_batch(engine, reqs, "decode" if size > 0 else "prefill")
            if size < 0:
                batch.prompt_logprob_rows = torch.arange(sum(extends))
            if not loop.can_run(batch):
                continue
            compared.append(size)
            for fused in (True, False):
                with torch.inference_mode(), engine.ctx.forward_batch(batch):
                    got = loop.run(batch) if fused else engine.model.forward()
                    hidden = batch.prompt_hidden.clone() if size < 0 else None
                results[fused, size] = (got.clone(), *pool_state(), hidden)
                engine.kv_cache.buffer.copy_(pool[0])
                if pool[1] is not None:
                    engine.kv_cache.scales.copy_(pool[1])
    assert 1 in compared and (loop.rows < 4 or -1 in compared)
    for size in compared:
        assert torch.equal(results[True, size][0], results[False, size][0]), f"logits, {size} rows"
        assert torch.equal(results[True, size][1], results[False, size][1]), f"K/V, {size} rows"
        if kv != "auto":
            assert torch.equal(results[True, size][2], results[False, size][2]), f"K/V scales, {size} rows"
        if size < 0:
            assert torch.equal(results[True, size][3], results[False, size][3]), f"every fed row's hidden state, case {size}"


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_prefill_gate_up_silu_in_one_pass_changes_no_bits(tiny_model_dir, name):
    """A bf16 engine keeps its projections in VNNI tiles and runs gate_up and SiLU as one pass
    (`_Linear.forward_silu_and_mul` on its bound `QuantLinear`) for prefills and decode batches on
    AMX: the logits are bitwise those of the two-step MLP on the same tiles."""
    from minisgl.kernel.cpu import cpu_kernels

    kern = cpu_kernels()
    if kern is None or not kern.has_amx:
        pytest.skip("no C compiler or no AMX here")
    prompts = [[(7 * i + 3) % 250 + 1 for i in range(90)], [(11 * i + 5) % 250 + 1 for i in range(40)]]
    with running_engine(tiny_model_dir(name), max_running_req=2, dtype=torch.bfloat16) as engine:
        gate_ups = [layer.mlp.gate_up_proj.cpu_gemm for layer in engine.model.model.layers]
        assert all(g is not None and g.vnni and g.amx_silu is not None for g in gate_ups)
        fused = gate_ups[0].amx_silu
        calls: List[int] = []
        results = {}
        reqs = allocated_reqs(engine, prompts, 1)
        for on in (True, False):
            for g in gate_ups:
                g.amx_silu = (lambda *a: calls.append(a[2]) or fused(*a)) if on else None
            batch = prepare_batch(engine, reqs, "prefill")
            with torch.inference_mode(), engine.ctx.forward_batch(batch):
                results[on] = engine.model.forward().clone()
        for g in gate_ups:
            g.amx_silu = fused
    assert calls == [130] * len(gate_ups), calls  # every layer's 130 rows
    assert torch.equal(results[True], results[False])


def test_module_path_reads_vnni_weights(tiny_model_dir, monkeypatch, request):
    """Prompt logprobs take the module path, whose linear layers cannot read the VNNI tiles
    themselves: they multiply through the bound C GEMMs (`_Linear.cpu_gemm`). Against the float32
    engine's logprobs they are as close as a bf16 engine on plain weights and torch's GEMMs
    (MINISGL_CPU_KERNELS=0) is."""
    from sched_helpers import greedy, running_llm

    from minisgl.kernel.cpu import cpu_kernels

    kern = cpu_kernels()
    if kern is None or not kern.has_amx:
        pytest.skip("no C compiler or no AMX here")
    request.addfinalizer(cpu_kernels.cache_clear)
    prompt = [(13 * i + 1) % 250 + 1 for i in range(70)]
    got = {}
    for label, dtype, kernels in (("vnni", "bfloat16", "1"), ("plain", "bfloat16", "0"), ("fp32", "float32", "1")):
        monkeypatch.setenv("MINISGL_CPU_KERNELS", kernels)
        cpu_kernels.cache_clear()
        with running_llm(tiny_model_dir("qwen3"), dtype=dtype) as llm:
            proj = llm.scheduler.engine.model.model.layers[0].mlp.gate_up_proj
            assert (proj.weight.dim() == 5) == (label == "vnni") and (proj.cpu_gemm is not None) == (label == "vnni")
            (res,) = llm.generate([prompt], greedy(4, prompt_logprobs=1))
            got[label] = torch.tensor([lp for _, lp, _ in res.prompt_logprobs])
    err = {k: (got[k] - got["fp32"]).abs() for k in ("vnni", "plain")}
    assert err["vnni"].mean() <= 1.5 * err["plain"].mean() + 1e-3, (err["vnni"].mean(), err["plain"].mean())
    assert err["vnni"].max() <= 2 * err["plain"].max() + 1e-2


# ---- the embedded model ------------------------------------------------------------------------
@functools.cache  # four tests read the same bf16 oracle: load it once
def _hf(model_dir: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()


@torch.inference_mode()
def test_embedded_fp32_gguf_int4_is_exact(embedded_model_dir, embedded_oracle, embedded_tokenizer):
    """fp32 activations on the GGUF's own int4 codes compute with exactly the weights HF
    dequantized: greedy decoding stays token-exact (tie-aware) against HF fp32."""
    ids = _chat_ids(embedded_tokenizer, QUESTIONS[0])
    with running_engine(embedded_model_dir, max_running_req=1, max_seq_len=96, quantization="gguf") as engine:
        assert any(g.quant is not None for g in bound_gemms(engine.model))
        ours = _generate(engine, [ids], 10)[0]
    ref, ref_logits = embedded_oracle.greedy(ids, 10)
    assert assert_greedy_match(ours, ref, ref_logits, eos_ids=[EOS], label="fp32 int4") >= 8


def _teacher_forced_ties(hf, ids: List[int], ours: List[int], label: str) -> Tuple[int, int]:
    """Our bf16 greedy tokens against HF float32 run on them (teacher-forced, so one tie does not
    end the comparison): each must be HF's argmax at its position or within BF16_TIE_EPS of it (a
    tie at bf16's precision, where summation order alone decides); returns (how many are HF's exact argmax, how many
    were compared: up to EOS)."""
    end = ours.index(EOS) + 1 if EOS in ours else len(ours)
    ours = ours[:end]
    with torch.inference_mode():
        logits = hf(input_ids=torch.tensor([ids + ours])).logits[0, len(ids) - 1 : len(ids) - 1 + len(ours)].float()
    best = logits.max(dim=-1).values
    for j, t in enumerate(ours):
        gap = float(best[j] - logits[j, t])
        assert gap < BF16_TIE_EPS, f"{label}: token {j} ({t}) is {gap:.3g} below HF's best {int(logits[j].argmax())}: {ours}"
    return sum(int(logits[j, t] == best[j]) for j, t in enumerate(ours)), len(ours)


def test_embedded_bf16_agrees_with_hf(embedded_model_dir, embedded_tokenizer):
    """bf16 with the dequantized weights against HF float32 on our tokens: every greedy token HF's
    argmax or a bf16 tie (the France question's first token is one: 25.33 vs 25.24), most exact."""
    hf = _hf(embedded_model_dir, torch.float32)
    prompts = [_chat_ids(embedded_tokenizer, q) for q in QUESTIONS]
    with running_engine(embedded_model_dir, max_running_req=2, max_seq_len=128, dtype=torch.bfloat16, quantization="none") as engine:
        assert not any(g.quant is not None for g in bound_gemms(engine.model))  # none: the dequantized weights
        model = engine.model  # the runner moved the weights onto huge pages: the head stays tied
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
        outs = _generate(engine, prompts, 24)
    counts = [_teacher_forced_ties(hf, ids, ours, f"bf16 prompt {i}") for i, (ids, ours) in enumerate(zip(prompts, outs))]
    assert sum(c[0] for c in counts) >= 0.75 * sum(c[1] for c in counts), (counts, outs)


@pytest.mark.parametrize("method,kv", [("auto", "auto"), ("int8", "auto"), ("none", "int8")])
def test_embedded_bf16_quantized_top5(embedded_model_dir, embedded_tokenizer, method, kv):
    """Quantized decode (auto: the file's own Q4_1 codes, a GGUF's default in bf16; int8: its weights rounded to Q8_0 blocks;
    or bf16 weights over the int8 KV cache) vs HF bf16 on the dequantized weights, teacher-forced
    on our own tokens: each of our tokens is in HF's top 5 at its position (until EOS)."""
    hf = _hf(embedded_model_dir, torch.bfloat16)
    prompts = [_chat_ids(embedded_tokenizer, q) for q in QUESTIONS]
    n = 32
    with running_engine(embedded_model_dir, max_running_req=2, max_seq_len=128, dtype=torch.bfloat16,
                        quantization=method, kv_cache_dtype=kv) as engine:  # fmt: skip
        from minisgl.layers.quant import Int4Weight

        quantized = any(g.quant is not None for g in bound_gemms(engine.model))
        # auto on a GGUF in bf16: its own codes, where the C int4 kernel runs them
        assert quantized == (method == "int8" or (method == "auto" and Int4Weight.c_kernel_available())), method
        outs = _generate(engine, prompts, n)
    differ = total = 0
    for ids, ours in zip(prompts, outs):
        end = ours.index(EOS) + 1 if EOS in ours else len(ours)
        ours = ours[:end]
        with torch.inference_mode():
            logits = hf(input_ids=torch.tensor([ids + ours])).logits[0, len(ids) - 1 : len(ids) - 1 + len(ours)]
        top5 = logits.topk(5, dim=-1).indices
        for j, t in enumerate(ours):
            assert t in top5[j].tolist(), f"token {j} ({t}) not in HF's top 5 {top5[j].tolist()}: {ours}"
        differ += sum(int(t != int(top5[j, 0])) for j, t in enumerate(ours))
        total += len(ours)
    rate = differ / total
    print(f"\n{method}, KV {kv} vs HF bf16: {differ}/{total} tokens differ from HF's argmax ({rate:.1%})")
    assert rate <= 0.25
    # (not "Paris" for the France question: its first token is a tie at bf16's precision)
    assert sum(c in embedded_tokenizer.decode(outs[1]).lower() for c in ("red", "blue", "yellow", "green")) >= 2


@pytest.mark.parametrize("m,n,k", [(100, 3072, 576), (300, 576, 1536), (33, 1008, 576), (600, 576, 576)])
def test_amx_gemm_both_layouts(m, n, k):
    """amx.c multiplies few rows as y^T = w x^T (x packed, w read in place) and many rows as
    y = x w^T (w packed per 32 columns): both within one bf16 rounding of the fp32 reference,
    with bias, tails of rows and an odd number of 16-column tiles."""
    from minisgl.kernel.cpu import cpu_kernels

    kern = cpu_kernels()
    if kern is None or not kern.has_amx:
        pytest.skip("no C compiler or no AMX here")
    torch.manual_seed(1)
    w = (torch.randn(n, k) * 0.05).to(torch.bfloat16)
    bias = torch.randn(n).to(torch.bfloat16)
    x = torch.randn(m, k).to(torch.bfloat16)
    for b in (None, bias):
        for threads in (1, 2):
            lin = QuantLinear(w, None, b, gemm=kern.lib.gemm_amx_bf16, nthreads=threads)
            ref = x.float() @ w.float().t() + (b.float() if b is not None else 0)
            ours = lin(x)
            assert ((ours.float() - ref).abs() <= 1.01 * (ref.abs() * 2**-8 + 1e-6)).all()


@pytest.mark.parametrize(
    "m,n,k", [(1, 960, 576), (3, 80, 64), (9, 48, 64), (64, 3072, 576), (500, 576, 1536), (700, 1008, 96), (2100, 80, 64)]
)
def test_vnni_gemms_match_fp32_reference(m, n, k):
    """The GEMMs on weights in VNNI tiles (layers/quant.py vnni_pack; gemv.c's skinny one, amx.c's
    for any row count): within one bf16 rounding of the fp32 reference, as torch's bf16 linear is,
    with bias, strided rows, row tails, an odd number of 16-row blocks, several 1024-row groups
    and 1 or 2 threads."""
    from minisgl.kernel.cpu import cpu_kernels
    from minisgl.layers.quant import vnni_pack, vnni_unpack

    kern = cpu_kernels()
    if kern is None or not kern.has_amx:
        pytest.skip("no C compiler or no AMX here")
    torch.manual_seed(m + n)
    w = (torch.randn(n, k) * 0.05).to(torch.bfloat16)
    packed = vnni_pack(w)
    assert torch.equal(vnni_unpack(packed), w)
    assert packed[1, 0, 3, 5, 1] == w[16 + 5, 2 * 3 + 1]  # [block, 32-column block, pair, row, half]
    bias = torch.randn(n).to(torch.bfloat16)
    wide = torch.randn(m, k + 32).to(torch.bfloat16)
    kernels = [kern.lib.gemm_amx_vnni_bf16] + ([kern.lib.gemv_vnni_bf16] if m <= 4 else [])
    for fn in kernels:
        for b, x in ((None, wide[:, :k].contiguous()), (bias, wide[:, :k])):
            for threads in (1, 2):
                lin = QuantLinear(packed, None, b, gemv=fn, gemv_max_rows=m, nthreads=threads, gemm=fn)
                ref = x.float() @ w.float().t() + (b.float() if b is not None else 0)
                ours = lin(x)
                assert ours.dtype == torch.bfloat16 and ours.shape == (m, n)
                assert ((ours.float() - ref).abs() <= 1.01 * (ref.abs() * 2**-8 + 1e-6)).all(), (fn, threads)
                torch_err = (torch.nn.functional.linear(x, w, b).float() - ref).abs().mean()
                assert (ours.float() - ref).abs().mean() <= 1.5 * torch_err + 1e-6


@pytest.mark.parametrize("m,inter,k", [(500, 1536, 576), (2, 32, 64), (40, 32, 64), (77, 96, 128), (700, 64, 96), (2100, 32, 64)])
def test_vnni_gate_up_silu_is_bitwise_the_two_steps(m, inter, k):
    """gemm_amx_vnni_silu_bf16 (the MLP's gate_up GEMM with SiLU in its store, kernel/cpu/amx.c)
    gives the bits of the same GEMM followed by silu_mul, for 1 and 2 threads, strided rows and
    row tails; shapes it does not tile (inter % 32) are declined, not computed wrongly."""
    from minisgl.kernel.cpu import cpu_kernels
    from minisgl.layers.quant import vnni_pack

    kern = cpu_kernels()
    if kern is None or not kern.has_amx:
        pytest.skip("no C compiler or no AMX here")
    torch.manual_seed(m)
    w = vnni_pack((torch.randn(2 * inter, k) * 0.05).to(torch.bfloat16))
    wide = (torch.randn(m, k + 32) * 2).to(torch.bfloat16)
    lib = kern.lib
    for x in (wide[:, :k].contiguous(), wide[:, :k]):
        for threads in (1, 2):
            gu = torch.empty(m, 2 * inter, dtype=torch.bfloat16)
            assert lib.gemm_amx_vnni_bf16(x.data_ptr(), x.stride(0), m, w.data_ptr(), 2 * inter, k, None, gu.data_ptr(), threads)
            want = torch.empty(m, inter, dtype=torch.bfloat16)
            kern.get("silu_mul", torch.bfloat16)(gu.data_ptr(), want.data_ptr(), m, inter)
            got = torch.full((m, inter), float("nan"), dtype=torch.bfloat16)
            assert lib.gemm_amx_vnni_silu_bf16(x.data_ptr(), x.stride(0), m, w.data_ptr(), inter, k, got.data_ptr(), threads)
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (threads, x.stride(0))
    w16 = vnni_pack((torch.randn(2 * inter - 32, k) * 0.05).to(torch.bfloat16))  # inter - 16: off 32
    out = torch.empty(m, inter, dtype=torch.bfloat16)
    assert not lib.gemm_amx_vnni_silu_bf16(wide.data_ptr(), k + 32, m, w16.data_ptr(), inter - 16, k, out.data_ptr(), 2)


@pytest.mark.parametrize("n", [1, 17, 100, 333])
@pytest.mark.parametrize("hq,hk,d", [(9, 3, 64), (4, 4, 128), (2, 1, 32)])
@pytest.mark.parametrize("kernel", ["amx", "avx2"])
def test_prefill_attention_kernel_matches_sdpa(n, hq, hk, d, kernel):
    """kernel/cpu/attn_amx.c (causal prefill attention on AMX tiles) and attn_avx2.c (the same on
    AVX2 FMAs, where the CPU has no AVX512-BF16), q/k/v read in place from the fused qkv rows,
    GQA: no further from the fp32 reference than torch's bf16 SDPA, plus a bf16 step; lengths
    off the 32-query, 6-query and 16/32-key blocks."""
    from minisgl.kernel.cpu import cpu_kernels

    kern = cpu_kernels()
    if kern is None or not (kern.has_amx if kernel == "amx" else kern.has_avx2_gemm):
        pytest.skip(f"no C compiler or no {kernel} kernel on this CPU")
    torch.manual_seed(n)
    qs, ks = hq * d, hk * d
    qkv = (torch.randn(n, qs + 2 * ks) * 2).to(torch.bfloat16)

    def sdpa(t: torch.Tensor) -> torch.Tensor:
        q = t[:, :qs].view(n, hq, d).transpose(0, 1).unsqueeze(0)
        k = t[:, qs : qs + ks].view(n, hk, d).transpose(0, 1).unsqueeze(0)
        v = t[:, qs + ks :].view(n, hk, d).transpose(0, 1).unsqueeze(0)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return o[0].transpose(0, 1).reshape(n, qs)

    out = torch.full((n, qs + 8), 7.0, dtype=torch.bfloat16)  # a strided output: padding untouched
    fn = getattr(kern.lib, f"prefill_attention_{kernel}_bf16")
    ok = fn(qkv.data_ptr(), qkv.stride(0), n, hq, hk, d, d**-0.5, out.data_ptr(), out.stride(0), 2)
    assert ok
    ref = sdpa(qkv.float())
    ours_err = (out[:, :qs].float() - ref).abs()
    torch_err = (sdpa(qkv).float() - ref).abs()
    assert ours_err.mean() <= 1.5 * torch_err.mean() + 1e-4
    assert ours_err.max() <= torch_err.max() + ref.abs().max() * 2**-7
    assert (out[:, qs:] == 7.0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [49152, 1000, 7])  # 7: under one 16-lane vector
def test_argmax_kernel_equals_torch_argmax(dtype, n):
    """Greedy sampling's C argmax (kernel/cpu/argmax.c) against torch.argmax: random rows, rows
    of ties (the first index wins), a NaN (the first NaN wins), all -inf, a strided view."""
    from minisgl.kernel.cpu import argmax_rows

    if argmax_rows(torch.zeros(1, 4)) is None:
        pytest.skip("no C compiler here")
    torch.manual_seed(0)
    x = torch.randn(70, n + 3).to(dtype)[:, :n]  # rows ld = n + 3 apart
    x[1] = 0.5  # all tied
    x[2, n // 2], x[2, n - 1] = 100, 100  # a tie of two maxima
    x[3, n // 3], x[3, n - 2] = float("nan"), float("nan")
    x[4] = float("-inf")
    x[5, -1] = 1e4  # the max in the tail
    x[6] = x[6].round()  # many equal values
    got = argmax_rows(x)
    assert torch.equal(got, torch.argmax(x.float(), dim=-1)), (got[:8], torch.argmax(x.float(), dim=-1)[:8])
