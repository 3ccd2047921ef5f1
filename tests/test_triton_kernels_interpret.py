"""The Triton kernels (minisgl/kernel/triton_ops.py, minisgl/moe/triton_moe.py) on a CPU machine.

1. Against their torch references through Triton's interpreter (TRITON_INTERPRET=1). The
   interpreter must be switched on before triton is first imported, so the checks run in a
   subprocess; it is made to round float32 -> bfloat16 to nearest like the GPU (it truncates).
2. Compiled ahead of time for an H100/H200 (sm_90) with the specialisations a launch would get
   (unit strides constant, 16-byte aligned pointers): the interpreter runs numpy, so it accepts
   code the GPU compiler rejects (a scalar where a tensor is needed, for one); this catches that
   without a GPU. The MoE GEMM must also be software-pipelined (async copies) at decode tiles.

Skipped when triton is not installed (CI does not install it); on a CUDA machine
benchmark/gpu_kernels_check.py runs the comparisons on the GPU at real shapes.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

CHECKS = textwrap.dedent(
    r"""
    import os, sys
    assert os.environ.get("TRITON_INTERPRET") == "1"
    import torch
    from minisgl.kernel.interpreter import patch_interpreter

    patch_interpreter()  # bf16 rounds to nearest like the GPU; numpy-2 scalar conversion

    from minisgl.kernel import triton_ops as K
    from minisgl.layers.activation import silu_and_mul_torch
    from minisgl.layers.norm import rms_norm_torch
    from minisgl.layers.rotary import RotaryConfig, RotaryEmbedding
    from minisgl.moe import triton_moe as M
    from minisgl.moe.torch_moe import TorchMoeBackend

    torch.manual_seed(0)
    failures = []

    def check(name, got, ref, dtype, loose=False):
        got, ref = got.float(), ref.float()
        if dtype == torch.float32:
            atol, rtol = 1e-5, 1e-5
        elif not loose:  # elementwise ops round where torch rounds: at most one bf16 ulp apart
            atol, rtol = 1e-5, 2.0**-7
        else:  # MoE: torch adds the k expert outputs one by one in bf16, we sum then round
            atol, rtol = 2e-2, 1.6e-2
        ok = got.shape == ref.shape and torch.allclose(got, ref, atol=atol, rtol=rtol)
        err = (got - ref).abs().max().item() if got.shape == ref.shape else float("nan")
        same = float((got == ref).float().mean()) if got.shape == ref.shape else 0.0
        print(f"{'ok  ' if ok else 'FAIL'} {name:48s} {str(dtype):15s} max|err| {err:.3g} identical {same:.3f}")
        if not ok:
            failures.append(name)

    for dtype in (torch.float32, torch.bfloat16):
        # RMSNorm on rows, and per head on a strided [T, H, D] view (q split out of qkv)
        for hidden, rows in ((96, 5), (1024, 3)):
            x = torch.randn(rows, hidden, dtype=dtype) * 3
            w = (torch.rand(hidden) + 0.5).to(dtype)
            check(f"rms_norm h={hidden}", K.rms_norm(x, w, 1e-6), rms_norm_torch(x, w, 1e-6), dtype)
            r = torch.randn(rows, hidden, dtype=dtype)
            out, res = K.fused_add_rms_norm(x, r, w, 1e-6)
            s = x + r
            check(f"add_rms_norm h={hidden} (residual)", res, s, dtype)
            check(f"add_rms_norm h={hidden} (normed)", out, rms_norm_torch(s, w, 1e-6), dtype)
            assert torch.equal(x, x.clone()) and res.data_ptr() != r.data_ptr()
        qkv = torch.randn(7, (4 + 2 + 2) * 32, dtype=dtype)
        q = qkv[:, : 4 * 32].view(7, 4, 32)
        w = (torch.rand(32) + 0.5).to(dtype)
        check("rms_norm per head, strided view", K.rms_norm(q, w, 1e-6), rms_norm_torch(q, w, 1e-6), dtype)

        # SiLU and mul (one block and several blocks per row)
        for inter in (48, 1500):
            x = torch.randn(6, 2 * inter, dtype=dtype) * 2
            check(f"silu_and_mul I={inter}", K.silu_and_mul(x), silu_and_mul_torch(x), dtype)
        x = torch.randn(2, 3, 64, dtype=dtype)
        check("silu_and_mul 3-d", K.silu_and_mul(x), silu_and_mul_torch(x), dtype)

        # rotary: full and partial rotary dim, strided q/k views, int32 and int64 positions
        for head_dim, rot, hq, hk in ((32, 32, 4, 2), (64, 32, 3, 1), (16, 16, 20, 4)):
            rope = RotaryEmbedding(RotaryConfig(head_dim, rot, 128, 10000.0))
            t = 9
            qkv = torch.randn(t, (hq + 2 * hk) * head_dim, dtype=dtype)
            q = qkv[:, : hq * head_dim].view(t, hq, head_dim)
            k = qkv[:, hq * head_dim : (hq + hk) * head_dim].view(t, hk, head_dim)
            for pdt in (torch.int32,) if head_dim == 32 else (torch.int64,):
                pos = torch.randint(0, 128, (t,), dtype=pdt)
                gq, gk = K.apply_rotary(pos, q, k, rope.cos, rope.sin, rot)
                rq, rk = rope.forward_torch(pos, q, k)
                check(f"rotary D={head_dim} rot={rot} Hq={hq} Hk={hk} {pdt}".replace("torch.", ""), torch.cat([gq.flatten(), gk.flatten()]), torch.cat([rq.flatten(), rk.flatten()]), dtype)

        # attention prologue: q/k norm + rotary + K/V store in one kernel vs the torch ops
        for head_dim, hq, hk, norm in ((32, 4, 2, True), (16, 20, 4, False), (64, 2, 2, True)):
            rope = RotaryEmbedding(RotaryConfig(head_dim, head_dim, 128, 10000.0))
            t, slots = 6, 20
            wide = torch.randn(t, (hq + 2 * hk) * head_dim + 8, dtype=dtype)
            qkv = wide[:, : (hq + 2 * hk) * head_dim]  # a strided row, as a sliced projection output
            qw = (torch.rand(head_dim) + 0.5).to(dtype) if norm else None
            kw = (torch.rand(head_dim) + 0.5).to(dtype) if norm else None
            pos = torch.randint(0, 128, (t,), dtype=torch.int32)
            loc = torch.randperm(slots)[:t].to(torch.int32)
            kc, vc = torch.zeros(slots, hk, head_dim, dtype=dtype), torch.zeros(slots, hk, head_dim, dtype=dtype)
            got_q = K.attention_prologue(qkv, pos, qw, kw, 1e-6, rope.cos, rope.sin, kc, vc, loc, hq, hk, head_dim)
            q, k, v = qkv.split([hq * head_dim, hk * head_dim, hk * head_dim], dim=-1)
            q, k, v = q.reshape(t, hq, head_dim), k.reshape(t, hk, head_dim), v.reshape(t, hk, head_dim)
            if norm:
                q, k = rms_norm_torch(q, qw, 1e-6), rms_norm_torch(k, kw, 1e-6)
            rq, rk = rope.forward_torch(pos, q, k)
            rkc, rvc = torch.zeros_like(kc), torch.zeros_like(vc)
            rkc[loc.long()], rvc[loc.long()] = rk, v
            name = f"attention prologue D={head_dim} Hq={hq} Hk={hk} norm={norm}"
            check(name + " (q)", got_q, rq, dtype)
            check(name + " (k cache)", kc, rkc, dtype)
            check(name + " (v cache)", vc, rvc, dtype)
            # an fp8 pool: the kernel stores the pool's reference fp8 store of what it stores above
            # (v scaled past e4m3's range, so saturation is exercised)
            big = torch.cat([qkv[:, : (hq + hk) * head_dim], qkv[:, (hq + hk) * head_dim :] * 300], dim=1)
            kc, vc = torch.zeros_like(kc), torch.zeros_like(vc)
            K.attention_prologue(big, pos, qw, kw, 1e-6, rope.cos, rope.sin, kc, vc, loc, hq, hk, head_dim)
            kc8, vc8 = (torch.zeros(slots, hk, head_dim, dtype=torch.float8_e4m3fn) for _ in range(2))
            got_q8 = K.attention_prologue(big, pos, qw, kw, 1e-6, rope.cos, rope.sin, kc8, vc8, loc, hq, hk, head_dim)
            for got8, wide in ((kc8, kc), (vc8, vc)):
                want8 = wide.float().clamp(-448, 448).to(torch.float8_e4m3fn)
                same = torch.equal(got8.view(torch.uint8), want8.view(torch.uint8))
                print(f"{'ok  ' if same else 'FAIL'} {name} fp8 cache bytes == the pool's reference store")
                if not same:
                    failures.append(name + " fp8")

        # MoE: every routing layout the align step must handle
        ref = TorchMoeBackend()
        for tokens, hidden, inter, experts, top_k, label in (
            (5, 64, 32, 8, 2, "few tokens"),
            (40, 64, 48, 6, 3, "many pairs per expert, I not a power of 2"),
            (1, 32, 16, 16, 4, "one token (decode)"),
            (12, 48, 32, 4, 1, "top-1, H not a power of 2"),
        ):
            x = torch.randn(tokens, hidden, dtype=dtype)
            w13 = (torch.randn(experts, 2 * inter, hidden) / hidden**0.5).to(dtype)
            w2 = (torch.randn(experts, hidden, inter) / inter**0.5).to(dtype)
            probs = torch.softmax(torch.randn(tokens, experts), dim=-1)
            tw, ti = torch.topk(probs, top_k, dim=-1)
            tw = (tw / tw.sum(-1, keepdim=True)).to(dtype)
            want = ref.forward(x, w13, w2, tw, ti)
            got = M.TritonMoeBackend().forward(x, w13, w2, tw, ti)
            check(f"moe T={tokens} E={experts} k={top_k} ({label})", got, want, dtype, loose=True)
            for cfg in (M.MoeConfig(16, 16, 16, 1),) if tokens > 1 else ():
                got = M.fused_moe(x, w13, w2, tw, ti, cfg)
                check(f"moe T={tokens} tiles {cfg.block_m}/{cfg.block_n}/{cfg.block_k}", got, want, dtype, loose=True)

    # the align layout: every pair exactly once, in a block of its own expert, padding = sentinel
    for tokens, experts, top_k, bm in ((7, 8, 2, 16), (50, 5, 3, 16), (1, 64, 8, 32)):
        ids = torch.topk(torch.rand(tokens, experts), top_k, dim=-1).indices
        n = ids.numel()
        for fn in (M.moe_align, M.moe_align_torch):
            sorted_ids, block_expert, total = fn(ids, experts, bm)
            tot = int(total.item())
            flat = ids.flatten()
            real = sorted_ids[:tot]
            valid = real[real < n].long()
            ok = sorted(valid.tolist()) == list(range(n)) and bool((sorted_ids[tot:] == n).all())
            blk = torch.arange(tot) // bm
            ok = ok and bool((flat[valid] == block_expert[blk[real < n]].long()).all())
            counts = torch.bincount(flat, minlength=experts)
            ok = ok and tot == int(((counts + bm - 1) // bm * bm).sum())
            print(f"{'ok  ' if ok else 'FAIL'} align {fn.__name__} T={tokens} E={experts} k={top_k} bm={bm}")
            if not ok:
                failures.append(f"align {fn.__name__}")

    print("FAILURES:", failures)
    sys.exit(1 if failures else 0)
    """
)


def test_triton_kernels_in_interpreter() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", CHECKS], env=env, capture_output=True, text=True, timeout=300)
    print(proc.stdout)
    assert proc.returncode == 0, f"kernel checks failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"


COMPILE = textwrap.dedent(
    r"""
    import sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from minisgl.kernel import triton_ops as K
    from minisgl.moe import triton_moe as M

    UNIT = {"stride_ak": 1, "stride_wk": 1, "stride_on": 1}  # what a launch specialises to 1
    failures = []

    def build(fn, sig, consts, num_warps=4, num_stages=3):
        full, consts, attrs = {}, dict(consts), {}
        for i, name in enumerate(fn.arg_names):
            if UNIT.get(name) == 1:
                full[name], consts[name] = "constexpr", 1
                continue
            full[name] = sig.get(name, "constexpr")
            if name in sig and (sig[name].startswith("*") or name.startswith("stride")):
                attrs[(i,)] = [["tt.divisibility", 16]]
        try:
            k = triton.compile(ASTSource(fn=fn, signature=full, constexprs=consts, attrs=attrs),
                               target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": num_stages})
            print("ok  ", fn.__name__, consts, "smem", k.metadata.shared)
            return k
        except Exception as e:
            print("FAIL", fn.__name__, consts, type(e).__name__, str(e)[:2000])
            failures.append(fn.__name__)

    i32 = lambda *names: {n: "i32" for n in names}
    for dt, res, rows, block in (("bf16", True, 2, 1024), ("fp32", False, 16, 128), ("bf16", False, 1, 8192)):
        sig = {"X": f"*{dt}", "R": f"*{dt}", "W": f"*{dt}", "Out": f"*{dt}", "ResOut": f"*{dt}", "eps": "fp32",
               **i32("n_rows", "n_inner", "N", "sx0", "sx1", "sr0", "sr1", "so0", "so1", "sro0", "sro1")}
        build(K._rmsnorm_kernel, sig, {"HAS_RES": res, "ROWS": rows, "BLOCK": block}, K._num_warps(rows * block))
    build(K._silu_and_mul_kernel, {"X": "*bf16", "Out": "*bf16", **i32("n_rows", "I", "sx", "so")}, {"BLOCK": 1024})
    sig = {"Pos": "*i32", "Q": "*bf16", "K": "*bf16", "Cos": "*fp32", "Sin": "*fp32", "QO": "*bf16", "KO": "*bf16",
           **i32("n_q_heads", "n_k_heads", "sqt", "sqh", "skt", "skh", "sqot", "sqoh", "skot", "skoh", "s_cos")}
    build(K._rope_kernel, sig, dict(HALF=64, ROT=128, HEAD_DIM=128, BLOCK_H=16, BLOCK_HALF=64, BLOCK_REST=0), 8)
    build(K._rope_kernel, sig, dict(HALF=32, ROT=64, HEAD_DIM=128, BLOCK_H=8, BLOCK_HALF=32, BLOCK_REST=64))
    sig = {"QKV": "*bf16", "Pos": "*i32", "QW": "*bf16", "KW": "*bf16", "Cos": "*fp32", "Sin": "*fp32", "QOut": "*bf16",
           "KCache": "*bf16", "VCache": "*bf16", "Loc": "*i32", "eps": "fp32",
           **i32("n_q_heads", "n_kv_heads", "s_qkv", "s_qo", "s_kc", "s_vc", "s_cos")}
    for norm in (True, False):
        build(K._attn_prologue_kernel, sig, dict(HALF=64, HEAD_DIM=128, HAS_NORM=norm, BLOCK_H=16, BLOCK_HALF=64,
                                                  USE_PDL=norm), 8)
    # an fp8_e4m3 KV pool: the prologue's and the store kernel's saturating cast, the decode
    # kernel's fp16 dots over widened fp8 tiles (must keep its tensor-core dots)
    build(K._attn_prologue_kernel, {**sig, "KCache": "*fp8e4nv", "VCache": "*fp8e4nv"},
          dict(HALF=64, HEAD_DIM=128, HAS_NORM=True, BLOCK_H=16, BLOCK_HALF=64, USE_PDL=True), 8)
    from minisgl.kernel import triton_attention as A
    build(A._store_kv_kernel, {"K": "*bf16", "V": "*bf16", "KCache": "*fp8e4nv", "VCache": "*fp8e4nv", "Loc": "*i32",
                               **i32("stride_kt", "stride_vt", "stride_kcs", "stride_vcs")}, dict(N=1024, BLOCK=1024))
    dec = {n: "i32" for n in A._decode_partial_kernel.arg_names if n.startswith("stride")}
    dec.update({"Q": "*bf16", "K": "*fp8e4nv", "V": "*fp8e4nv", "PageTable": "*i32", "Rows": "*i64", "SeqLens": "*i64",
                "NumSplits": "*i64", "Order": "*i64", "MidO": "*fp32", "MidLse": "*fp32", "qk_scale": "fp32"})
    for bn, direct in ((128, False), (64, True)):
        kern = build(A._decode_partial_kernel, dec, dict(GROUP=2, HEAD_DIM=128, BLOCK_H=16, BLOCK_N=bn, BLOCK_D=128,
                     PRECISION="tf32", DIRECT=direct, HAS_ORDER=True, USE_PDL=False, F16_DOT=True), 4, 3)
        if kern is not None and "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" not in kern.asm["ptx"]:
            print("FAIL fp8 decode does not run fp16 tensor-core dots")
            failures.append("fp8 decode mma")
    # the CUDA-core fp8 decode (int32 words of the pool, inline-PTX widening): the loop must keep
    # the load layout (no layout conversion, no shared memory) and widen with the packed cvt
    cc = {n: "i32" for n in A._decode_cc_kernel.arg_names if n.startswith("stride")}
    cc.update({**dec, "K": "*i32", "V": "*i32", "MidO": "*bf16"})
    for keys, warps, direct in ((4, 4, True), (2, 4, False)):
        kern = build(A._decode_cc_kernel, cc, dict(GROUP=2, HEAD_DIM=128, BLOCK_H=2, KEYS=keys, STREAMS=4 * warps,
                     BLOCK_W=32, DIRECT=direct, HAS_ORDER=True, USE_PDL=False, PREFETCH=2, ASM=True), warps, 1)
        if kern is None:
            continue
        loop = kern.asm["ttgir"].split("scf.for")[1].split("scf.yield")[0]
        if "convert_layout" in loop or "local_" in loop or "cvt.rn.f16x2.e4m3x2" not in kern.asm["ptx"]:
            print("FAIL cc decode: a layout change or shared memory in its loop, or no packed e4m3 cvt")
            failures.append("cc decode loop")
    build(M._count_kernel, {"Ids": "*i64", "Counts": "*i32", "SortedIds": "*i32", **i32("num_pairs", "max_rows")}, {"BLOCK": 1024})
    build(M._segment_kernel, {"Counts": "*i32", "Total": "*i32", **i32("num_experts")}, {"BLOCK_M": 16, "BLOCK_E": 128})
    build(M._scatter_kernel, {"Ids": "*i64", "Cursor": "*i32", "SortedIds": "*i32", "BlockExpert": "*i32", **i32("num_pairs")},
          {"BLOCK_M": 16, "BLOCK": 1024})
    for dt, cfg, gated in (("bf16", M.MoeConfig(16, 64, 128, 1, 4, 3), True), ("bf16", M.MoeConfig(64, 128, 64, 8, 8, 3), False),
                           ("fp32", M.MoeConfig(16, 64, 32, 1, 4, 2), True)):
        sig = {"A": f"*{dt}", "W": f"*{dt}", "Out": f"*{dt}", "SortedIds": "*i32", "BlockExpert": "*i32", "Total": "*i32",
               "TopkW": f"*{dt}", **i32("num_pairs", "num_m_blocks", "stride_am", "stride_ak", "stride_we", "stride_wn",
                                        "stride_wk", "stride_om", "stride_on")}
        n, k = (768, 2048) if gated else (2048, 768)
        kern = build(M._moe_gemm_kernel, sig, dict(N=n, K=k, A_ROW_DIV=8 if gated else 1, GATED=gated, MUL_WEIGHT=not gated,
                     BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, EVEN_K=True,
                     PRECISION="ieee" if dt == "fp32" else "tf32", UPCAST=False), cfg.num_warps, cfg.num_stages)
        if kern is not None and dt == "bf16" and "async_copy_global_to_local" not in kern.asm["ttgir"]:
            print("FAIL moe gemm is not pipelined (no async copies)", cfg)
            failures.append("pipelining")
    print("FAILURES:", failures)
    sys.exit(1 if failures else 0)
    """
)


def test_triton_kernels_compile_for_sm90() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", COMPILE], env=env, capture_output=True, text=True, timeout=300)
    print(proc.stdout)
    assert proc.returncode == 0, f"sm_90 compilation failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-4000:]}"
