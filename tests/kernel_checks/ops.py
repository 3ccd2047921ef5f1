"""The fused Triton ops (minisgl/kernel/triton_ops.py) and the Triton MoE backend against their torch
references, through Triton's interpreter: `TRITON_INTERPRET=1 python -m kernel_checks.ops` (from tests/,
with the repo root on PYTHONPATH; tests/test_triton_kernels_interpret.py runs it). The interpreter
runs numpy, so float32 and bfloat16 only, at small shapes; tests/test_triton_ops_cuda.py checks the
same ops on the GPU at real shapes."""

from __future__ import annotations

import sys


def main() -> int:
    """Every comparison printed; 1 when any failed."""
    import os

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
                check(
                    f"rotary D={head_dim} rot={rot} Hq={hq} Hk={hk} {pdt}".replace("torch.", ""),
                    torch.cat([gq.flatten(), gk.flatten()]),
                    torch.cat([rq.flatten(), rk.flatten()]),
                    dtype,
                )

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
            if qw is not None and kw is not None:
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
            K.attention_prologue(big, pos, qw, kw, 1e-6, rope.cos, rope.sin, kc8, vc8, loc, hq, hk, head_dim)
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

    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
