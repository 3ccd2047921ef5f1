"""The Triton kernels compiled ahead of time for an H100/H200 (sm_90), with the specialisations a
launch gets (unit strides constant, 16-byte aligned pointers): the interpreter runs numpy, so it
accepts code the GPU compiler rejects; this catches that without a GPU, and checks properties of the
compiled code (tensor-core dots, software pipelining, no layout change in a loop, no spills).

    python -m kernel_checks.sm90 ops|sampling|gemv|fp8|int4       (TRITON_INTERPRET unset)
"""

from __future__ import annotations

import sys


def ops() -> int:
    """The fused ops, the attention kernels (bf16 and fp8 pools) and the MoE kernels."""
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
            k = triton.compile(
                ASTSource(fn=fn, signature=full, constexprs=consts, attrs=attrs),
                target=GPUTarget("cuda", 90, 32),
                options={"num_warps": num_warps, "num_stages": num_stages},
            )
            print("ok  ", fn.__name__, consts, "smem", k.metadata.shared)
            return k
        except Exception as e:
            print("FAIL", fn.__name__, consts, type(e).__name__, str(e)[:2000])
            failures.append(fn.__name__)

    def i32(*names):
        return {n: "i32" for n in names}

    for dt, res, rows, block in (("bf16", True, 2, 1024), ("fp32", False, 16, 128), ("bf16", False, 1, 8192)):
        sig = {
            "X": f"*{dt}",
            "R": f"*{dt}",
            "W": f"*{dt}",
            "Out": f"*{dt}",
            "ResOut": f"*{dt}",
            "eps": "fp32",
            **i32("n_rows", "n_inner", "N", "sx0", "sx1", "sr0", "sr1", "so0", "so1", "sro0", "sro1"),
        }
        build(K._rmsnorm_kernel, sig, {"HAS_RES": res, "ROWS": rows, "BLOCK": block}, K._num_warps(rows * block))
    build(K._silu_and_mul_kernel, {"X": "*bf16", "Out": "*bf16", **i32("n_rows", "I", "sx", "so")}, {"BLOCK": 1024})
    sig = {
        "Pos": "*i32",
        "Q": "*bf16",
        "K": "*bf16",
        "Cos": "*fp32",
        "Sin": "*fp32",
        "QO": "*bf16",
        "KO": "*bf16",
        **i32("n_q_heads", "n_k_heads", "sqt", "sqh", "skt", "skh", "sqot", "sqoh", "skot", "skoh", "s_cos"),
    }
    build(K._rope_kernel, sig, dict(HALF=64, ROT=128, HEAD_DIM=128, BLOCK_H=16, BLOCK_HALF=64, BLOCK_REST=0), 8)
    build(K._rope_kernel, sig, dict(HALF=32, ROT=64, HEAD_DIM=128, BLOCK_H=8, BLOCK_HALF=32, BLOCK_REST=64))
    sig = {
        "QKV": "*bf16",
        "Pos": "*i32",
        "QW": "*bf16",
        "KW": "*bf16",
        "Cos": "*fp32",
        "Sin": "*fp32",
        "QOut": "*bf16",
        "KCache": "*bf16",
        "VCache": "*bf16",
        "Loc": "*i32",
        "eps": "fp32",
        **i32("n_q_heads", "n_kv_heads", "s_qkv", "s_qo", "s_kc", "s_vc", "s_cos"),
    }
    for norm in (True, False):
        build(K._attn_prologue_kernel, sig, dict(HALF=64, HEAD_DIM=128, HAS_NORM=norm, BLOCK_H=16, BLOCK_HALF=64, USE_PDL=norm), 8)
    # an fp8_e4m3 KV pool: the prologue's and the store kernel's saturating cast, the decode
    # kernel's fp16 dots over widened fp8 tiles (must keep its tensor-core dots)
    build(
        K._attn_prologue_kernel,
        {**sig, "KCache": "*fp8e4nv", "VCache": "*fp8e4nv"},
        dict(HALF=64, HEAD_DIM=128, HAS_NORM=True, BLOCK_H=16, BLOCK_HALF=64, USE_PDL=True),
        8,
    )
    from minisgl.kernel import triton_attention as A

    build(
        A._store_kv_kernel,
        {
            "K": "*bf16",
            "V": "*bf16",
            "KCache": "*fp8e4nv",
            "VCache": "*fp8e4nv",
            "Loc": "*i32",
            **i32("stride_kt", "stride_vt", "stride_kcs", "stride_vcs"),
        },
        dict(N=1024, BLOCK=1024),
    )
    dec = {n: "i32" for n in A._decode_partial_kernel.arg_names if n.startswith("stride")}
    dec.update(
        {
            "Q": "*bf16",
            "K": "*fp8e4nv",
            "V": "*fp8e4nv",
            "PageTable": "*i32",
            "Rows": "*i64",
            "SeqLens": "*i64",
            "NumSplits": "*i64",
            "Order": "*i64",
            "MidO": "*fp32",
            "MidLse": "*fp32",
            "qk_scale": "fp32",
            "window": "i32",
        }
    )
    for bn, direct in ((128, False), (64, True)):
        kern = build(
            A._decode_partial_kernel,
            {**dec, "Sinks": "*fp32"},
            dict(
                GROUP=2,
                HEAD_DIM=128,
                BLOCK_H=16,
                BLOCK_N=bn,
                BLOCK_D=128,
                PRECISION="tf32",
                DIRECT=direct,
                HAS_ORDER=True,
                USE_PDL=False,
                F16_DOT=True,
                SOFTCAP=0.0,
                HAS_SINKS=direct,  # (GPT-OSS's sinks: the direct stage adds them)
            ),
            4,
            3,
        )
        if kern is not None and "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" not in kern.asm["ptx"]:
            print("FAIL fp8 decode does not run fp16 tensor-core dots")
            failures.append("fp8 decode mma")
    # Gemma's soft-capped scores (a sliding window is the runtime `window`): bf16 pool, and the
    # extend kernel with and without the cap
    build(
        A._decode_partial_kernel,
        {**dec, "K": "*bf16", "V": "*bf16", "Sinks": "*fp32"},
        dict(GROUP=2, HEAD_DIM=256, BLOCK_H=16, BLOCK_N=64, BLOCK_D=256, PRECISION="tf32", DIRECT=True,
             HAS_ORDER=True, USE_PDL=False, F16_DOT=False, SOFTCAP=50.0, HAS_SINKS=False),
        4,
        3,
    )  # fmt: skip
    ext = {n: "i32" for n in A._extend_kernel.arg_names if n.startswith("stride")}
    ext.update({"Q": "*bf16", "K": "*bf16", "V": "*bf16", "Out": "*bf16", "PageTable": "*i32", "Rows": "*i64",
                "QStart": "*i64", "CachedLens": "*i64", "ExtendLens": "*i64", "qk_scale": "fp32", "window": "i32",
                "Sinks": "*fp32"})  # fmt: skip
    for cap in (0.0, 50.0):
        build(
            A._extend_kernel,
            ext,
            dict(
                GROUP=2,
                HEAD_DIM=128,
                BLOCK_M=64,
                BLOCK_N=64,
                BLOCK_D=128,
                PRECISION="tf32",
                HEAVY_FIRST=True,
                SOFTCAP=cap,
                HAS_SINKS=cap == 0.0,
            ),
            4,
            3,
        )
    from minisgl.kernel import triton_deterministic as TD

    det = {n: "i32" for n in TD._deterministic_attention_kernel.arg_names if n.startswith("stride")}
    det.update({"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "o_ptr": "*bf16", "page_table_ptr": "*i32",
                "rows_ptr": "*i64", "positions_ptr": "*i64", "sm_scale": "fp32", "window": "i32"})  # fmt: skip
    for cap in (0.0, 50.0):
        build(TD._deterministic_attention_kernel, det, dict(GROUP=2, HEAD_DIM=256, BLOCK_D=256, BLOCK_N=64, SOFTCAP=cap))
    # the mode's batch-invariant GEMM: its one tile per weight, bf16 on wgmma (64 rows), fp32 exact
    from minisgl.kernel import triton_bi_matmul as BI

    for dt, block_n in (("bf16", 32), ("bf16", 64), ("fp32", 32)):
        bi = {
            "x_ptr": f"*{dt}",
            "w_ptr": f"*{dt}",
            "b_ptr": f"*{dt}",
            "y_ptr": f"*{dt}",
            **i32("M", "N", "K", "stride_xm", "stride_wn", "stride_ym"),
        }
        consts = dict(HAS_BIAS=True, IEEE=dt == "fp32", BLOCK_M=BI.BLOCK_M, BLOCK_N=block_n, BLOCK_K=BI.BLOCK_K, GROUP_M=BI.GROUP_M)
        kern = build(BI._bi_matmul_kernel, bi, {**consts, "stride_xk": 1}, 4, 4)
        if kern is not None and dt == "bf16" and "wgmma" not in kern.asm["ptx"]:
            print("FAIL _bi_matmul_kernel: no wgmma in the bf16 tile")
            failures.append("bi_matmul wgmma")
    # the CUDA-core fp8 decode (int32 words of the pool, inline-PTX widening): the loop must keep
    # the load layout (no layout conversion, no shared memory) and widen with the packed cvt
    cc = {n: "i32" for n in A._decode_cc_kernel.arg_names if n.startswith("stride")}
    cc.update({**dec, "K": "*i32", "V": "*i32", "MidO": "*bf16"})
    for keys, warps, direct in ((4, 4, True), (2, 4, False)):
        kern = build(
            A._decode_cc_kernel,
            cc,
            dict(
                GROUP=2,
                HEAD_DIM=128,
                BLOCK_H=2,
                KEYS=keys,
                STREAMS=4 * warps,
                BLOCK_W=32,
                DIRECT=direct,
                HAS_ORDER=True,
                USE_PDL=False,
                PREFETCH=2,
                ASM=True,
                SOFTCAP=0.0,
            ),
            warps,
            1,
        )
        if kern is None:
            continue
        loop = kern.asm["ttgir"].split("scf.for")[1].split("scf.yield")[0]
        if "convert_layout" in loop or "local_" in loop or "cvt.rn.f16x2.e4m3x2" not in kern.asm["ptx"]:
            print("FAIL cc decode: a layout change or shared memory in its loop, or no packed e4m3 cvt")
            failures.append("cc decode loop")
    build(M._count_kernel, {"Ids": "*i64", "Counts": "*i32", "SortedIds": "*i32", **i32("num_pairs", "max_rows")}, {"BLOCK": 1024})
    build(M._segment_kernel, {"Counts": "*i32", "Total": "*i32", **i32("num_experts")}, {"BLOCK_M": 16, "BLOCK_E": 128})
    build(
        M._scatter_kernel,
        {"Ids": "*i64", "Cursor": "*i32", "SortedIds": "*i32", "BlockExpert": "*i32", **i32("num_pairs")},
        {"BLOCK_M": 16, "BLOCK": 1024},
    )
    for dt, cfg, gated in (
        ("bf16", M.MoeConfig(16, 64, 128, 1, 4, 3), True),
        ("bf16", M.MoeConfig(64, 128, 64, 8, 8, 3), False),
        ("fp32", M.MoeConfig(16, 64, 32, 1, 4, 2), True),
    ):
        sig = {
            "A": f"*{dt}",
            "W": f"*{dt}",
            "Out": f"*{dt}",
            "SortedIds": "*i32",
            "BlockExpert": "*i32",
            "Total": "*i32",
            "TopkW": f"*{dt}",
            "Bias": f"*{dt}",
            **i32(
                "num_pairs",
                "num_m_blocks",
                "stride_am",
                "stride_ak",
                "stride_we",
                "stride_wn",
                "stride_wk",
                "stride_om",
                "stride_on",
                "stride_be",
            ),
        }
        n, k = (768, 2048) if gated else (2048, 768)
        kern = build(
            M._moe_gemm_kernel,
            sig,
            dict(
                N=n,
                K=k,
                A_ROW_DIV=8 if gated else 1,
                GATED=gated,
                MUL_WEIGHT=not gated,
                BLOCK_M=cfg.block_m,
                BLOCK_N=cfg.block_n,
                BLOCK_K=cfg.block_k,
                GROUP_M=cfg.group_m,
                EVEN_K=True,
                PRECISION="ieee" if dt == "fp32" else "tf32",
                UPCAST=False,
                HAS_BIAS=gated,  # (GPT-OSS's gate/up bias and clamped SwiGLU on the gated GEMM)
                SWIGLU=gated,
                SWIGLU_ALPHA=1.702 if gated else 0.0,
                SWIGLU_LIMIT=7.0 if gated else 0.0,
            ),
            cfg.num_warps,
            cfg.num_stages,
        )
        if kern is not None and dt == "bf16" and "async_copy_global_to_local" not in kern.asm["ttgir"]:
            print("FAIL moe gemm is not pipelined (no async copies)", cfg)
            failures.append("pipelining")
    print("FAILURES:", failures)
    return 1 if failures else 0


def sampling() -> int:
    """The Gumbel-max sampling kernels."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from minisgl.kernel import triton_sampling as K

    failures = []
    DIV16 = {"n_cols", "stride_row"}  # V = 151936 and its row stride are multiples of 16

    def build(fn, sig, consts, num_warps):
        full, attrs = {}, {}
        for i, name in enumerate(fn.arg_names):
            full[name] = sig.get(name, "constexpr")
            if name in sig and (sig[name].startswith("*") or name in DIV16):
                attrs[(i,)] = [["tt.divisibility", 16]]
        try:
            k = triton.compile(
                ASTSource(fn=fn, signature=full, constexprs=consts, attrs=attrs),
                target=GPUTarget("cuda", 90, 32),
                options={"num_warps": num_warps},
            )
            print("ok  ", fn.__name__, consts, "regs", k.n_regs if hasattr(k, "n_regs") else "?")
        except Exception as e:
            print("FAIL", fn.__name__, consts, type(e).__name__, str(e)[:2000])
            failures.append(fn.__name__)

    for dt, rows, tiles in (("bf16", 1, 1), ("bf16", 1, 8), ("bf16", 4, 2), ("fp16", 2, 1), ("fp32", 4, 8)):
        sig = {
            "Logits": f"*{dt}",
            "Temps": "*fp32",
            "Seeds": "*i64",
            "BestVal": "*fp32",
            "BestIdx": "*i32",
            "n_rows": "i32",
            "n_cols": "i32",
            "stride_row": "i32",
            "n_chunks": "i32",
        }
        consts = {"GREEDY": K.GREEDY_T, "QUARTER": K.QUARTER, "TILES": tiles, "ROWS": rows, "FAST": True}
        build(K._gumbel_chunk_kernel, sig, consts, K._CHUNK_WARPS)
    sig = {"BestVal": "*fp32", "BestIdx": "*i32", "Out": "*i64", "n_rows": "i32", "n_chunks": "i32"}
    for rows, block in ((1, 256), (64, 16), (8, 128)):
        build(K._argmax_chunks_kernel, sig, {"ROWS": rows, "BLOCK": block}, 1)
    print("FAILURES:", failures)
    return 1 if failures else 0


def gemv() -> int:
    """Every tile skinny.default_config picks: no shared-memory overrun, no register spill."""
    import os
    import re
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from minisgl.kernel import skinny
    from minisgl.kernel import triton_gemv as G

    # cuobjdump ships with triton's NVIDIA backend: the SASS shows register spills (LDL/STL)
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    failures = []
    fn = G._gemv_kernel
    sig = {
        "X": "*bf16",
        "R": "*bf16",
        "NW": "*bf16",
        "W": "*bf16",
        "Out": "*bf16",
        "ResOut": "*bf16",
        "M": "i32",
        "N": "i32",
        "K": "i32",
        "sx": "i32",
        "sr": "i32",
        "sw": "i32",
        "so": "i32",
        "sro": "i32",
        "eps": "fp32",
    }
    shapes = (
        ("norm", 4096, 1024),
        ("plain", 1024, 2048),
        ("gated", 6144, 1024),
        ("plain", 1024, 3072),  # 0.6B
        ("norm", 7168, 5120),
        ("gated", 34816, 5120),
        ("plain", 5120, 17408),
    )  # 14B
    seen = set()
    for m in skinny.BUCKETS:
        for kind, n_w, k in shapes:
            cfg = skinny.default_config(kind, n_w, k, m)
            if cfg is None or (kind, cfg) in seen:
                continue
            seen.add((kind, cfg))
            consts = dict(
                PRE_NORM=kind != "plain",
                HAS_RES=kind != "plain",
                GATED=kind == "gated",
                BLOCK_M=cfg.block_m,
                BLOCK_N=cfg.block_n,
                BLOCK_K=cfg.block_k,
                USE_PDL=True,
            )
            full = {name: sig.get(name, "constexpr") for name in fn.arg_names}
            attrs = {
                (i,): [["tt.divisibility", 16]]
                for i, name in enumerate(fn.arg_names)
                if name in sig and (sig[name].startswith("*") or name in ("K", "sx", "sr", "sw", "so", "sro"))
            }
            try:
                kern = triton.compile(
                    ASTSource(fn=fn, signature=full, constexprs=consts, attrs=attrs),
                    target=GPUTarget("cuda", 90, 32),
                    options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages, "launch_pdl": True},
                )
            except Exception as e:
                print("FAIL", kind, n_w, k, m, cfg, type(e).__name__, str(e)[:1500])
                failures.append(f"{kind} m={m}")
                continue
            spills: object = "?"
            if os.path.exists(cuobjdump):
                with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                    f.write(kern.asm["cubin"])
                    f.flush()
                    sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True).stdout
                spills = len(re.findall(r"\b(LDL|STL)\b", sass))
            ok = kern.metadata.shared <= 227 * 1024 and spills in (0, "?")
            print("ok  " if ok else "FAIL", kind, n_w, k, m, tuple(cfg), "smem", kern.metadata.shared, "spills", spills)
            if not ok:
                failures.append(f"{kind} {n_w}x{k} m={m}: smem {kern.metadata.shared} spills {spills}")
    print("FAILURES:", failures)
    return 1 if failures else 0


def fp8() -> int:
    """The FP8 kernels (kernel/triton_fp8.py) at every tile gemm_config picks, both scale layouts:
    tensor-core dots (wgmma on e4m3 operands; below 64 rows exact e4m3 -> fp16 into mma.sync),
    within the H200's shared memory, no register spills."""
    import os
    import re
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from minisgl.kernel import triton_fp8 as F8

    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    failures = []

    def compile_(fn, sig, consts, num_warps, num_stages, divisible):
        full = {name: sig.get(name, "constexpr") for name in fn.arg_names}
        attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names) if name in divisible}
        return triton.compile(
            ASTSource(fn=fn, signature=full, constexprs=consts, attrs=attrs),
            target=GPUTarget("cuda", 90, 32),
            options={"num_warps": num_warps, "num_stages": num_stages},
        )

    def spills(kern) -> object:
        if not os.path.exists(cuobjdump):
            return "?"
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(kern.asm["cubin"])
            f.flush()
            sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True).stdout
        return len(re.findall(r"\b(LDL|STL)\b", sass))

    sig = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "stride_xm": "i32", "stride_qm": "i32", "stride_sm": "i32"}
    try:
        compile_(F8._quant_groups_kernel, sig, {"GROUP_K": F8.GROUP, "EPS": F8._EPS, "QMAX": F8.FP8_MAX}, 4, 1,
                 ("x_ptr", "q_ptr", "s_ptr", "stride_xm", "stride_qm"))  # fmt: skip
        print("ok   _quant_groups_kernel")
    except Exception as e:
        print("FAIL _quant_groups_kernel", type(e).__name__, str(e)[:1500])
        failures.append("quant")
    fn = F8._fp8_gemm_kernel
    base = {"a_ptr": "*fp8e4nv", "as_ptr": "*fp32", "b_ptr": "*fp8e4nv", "bs_ptr": "*fp32", "c_ptr": "*bf16", "bias_ptr": "*bf16",
            "M": "i32", "N": "i32", "K": "i32", "stride_am": "i32", "stride_asm": "i32", "stride_bn": "i32", "stride_bsn": "i32",
            "stride_cm": "i32"}  # fmt: skip
    divisible = ("a_ptr", "as_ptr", "b_ptr", "bs_ptr", "c_ptr", "bias_ptr", "K", "stride_am", "stride_bn", "stride_cm")
    seen = set()
    for m in (1, 16, 64, 256, 4096):
        for n in (1024, 34816):
            for scale_bn, bsk_one in ((128, True), (1, False), (1, True)):
                cfg = F8.gemm_config(m, n, scale_bn)
                if (cfg, scale_bn, bsk_one) in seen:
                    continue
                seen.add((cfg, scale_bn, bsk_one))
                bm, bn, gm, warps, stages = cfg
                sig = dict(base) if bsk_one else {**base, "stride_bsk": "i32"}
                consts = {"SCALE_BN": scale_bn, "HAS_BIAS": not bsk_one, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": F8.GROUP,
                          "GROUP_M": gm, **({"stride_bsk": 1} if bsk_one else {})}  # fmt: skip
                what = f"tile {cfg} scale rows {scale_bn} stride_bsk {'1' if bsk_one else 'runtime'}"
                try:
                    kern = compile_(fn, sig, consts, warps, stages, divisible)
                except Exception as e:
                    print("FAIL", what, type(e).__name__, str(e)[:1500])
                    failures.append(what)
                    continue
                ptx = kern.asm["ptx"]
                fp8_mma = bool(re.search(r"wgmma\.mma_async\S*e4m3", ptx))
                if bm < 64:  # below wgmma's M: exact e4m3 -> fp16 conversions into fp16 mma.sync
                    fp8_mma = "cvt.rn.f16x2.e4m3x2" in ptx and "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in ptx
                sp = spills(kern)
                ok = fp8_mma and kern.metadata.shared <= 227 * 1024 and sp in (0, "?")
                print("ok  " if ok else "FAIL", what, "fp8 mma", fp8_mma, "smem", kern.metadata.shared, "spills", sp)
                if not ok:
                    failures.append(what)
    print("FAILURES:", failures)
    return 1 if failures else 0


def mla() -> int:
    """The MLA decode kernel (kernel/triton_mla.py) at DeepSeek's latent (512 + 64) with the tiles
    mla_decode launches (bf16 over a bf16 or fp8 pool, fp32): tensor-core dots in bf16, within the H200's shared memory,
    and the register spills (printed; 0 expected)."""
    import os
    import re
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from minisgl.kernel import triton_mla as M

    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    fn = M._mla_decode_kernel
    failures = []
    for dt, kv_dt, block_n, warps in (("bf16", "bf16", 32, 8), ("bf16", "fp8e4nv", 32, 8), ("fp32", "fp32", 32, 8)):
        sig = {"Q": f"*{dt}", "KV": f"*{kv_dt}", "PageTable": "*i32", "Rows": "*i64", "SeqLens": "*i64", "MidO": "*fp32",
               "MidLse": "*fp32", "qk_scale": "fp32", "n_split": "i32",
               **{n: "i32" for n in fn.arg_names if n.startswith("stride")}}  # fmt: skip
        consts = {"NUM_HEADS": 16, "LAT": 512, "ROPE": 64, "BLOCK_H": 16, "BLOCK_N": block_n, "BLOCK_L": 512, "BLOCK_R": 64,
                  "PRECISION": "ieee" if dt == "fp32" else "tf32"}  # fmt: skip
        full = {name: sig.get(name, "constexpr") for name in fn.arg_names}
        divisible = [i for i, name in enumerate(fn.arg_names) if name in sig and (sig[name].startswith("*") or name.startswith("stride"))]
        what = f"{dt} pool {kv_dt} BLOCK_N={block_n} warps={warps}"
        try:
            kern = triton.compile(
                ASTSource(fn=fn, signature=full, constexprs=consts, attrs={(i,): [["tt.divisibility", 16]] for i in divisible}),
                target=GPUTarget("cuda", 90, 32),
                options={"num_warps": warps, "num_stages": 2},
            )
        except Exception as e:
            print("FAIL", what, type(e).__name__, str(e)[:1500])
            failures.append(what)
            continue
        sp: object = "?"
        if os.path.exists(cuobjdump):
            with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                f.write(kern.asm["cubin"])
                f.flush()
                sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True).stdout
            sp = len(re.findall(r"\b(LDL|STL)\b", sass))
        mma = dt == "fp32" or bool(re.search(r"(wgmma|mma)\S*bf16", kern.asm["ptx"]))
        ok = mma and kern.metadata.shared <= 227 * 1024
        print("ok  " if ok else "FAIL", what, "mma", mma, "smem", kern.metadata.shared, "spills", sp)
        if not ok:
            failures.append(what)
    print("FAILURES:", failures)
    return 1 if failures else 0


def int4(sweep: bool = False) -> int:
    """The W4A16 kernels (kernel/triton_int4.py): tensor-core dots (mma.sync below 64 rows, wgmma
    from 64; the one-row GEMV: pipelined cp.async loads), within the H200's shared memory, no
    register spills; and the split-K reduce. By default (the CPU suite: each compile takes
    seconds) one kernel per family in bf16 at the Qwen3-14B shapes: the GEMV and the decode tile
    with split-K, 64 x 128 with bias, 128 x 128 (group 32);
    `int4_all`: every tile gemm_config picks for the Qwen3-0.6B and 14B projections (bf16, fp16
    and fp32 activations, each group size, split-K and not). Float32 (IEEE dots, the exactness
    tests' dtype, not a speed path) may spill: printed, not a failure."""
    import os
    import re
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from minisgl.kernel import triton_int4 as K

    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    failures = []

    def compile_(fn, sig, consts, num_warps, num_stages, divisible):
        full = {name: sig.get(name, "constexpr") for name in fn.arg_names}
        attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names) if name in divisible}
        return triton.compile(
            ASTSource(fn=fn, signature=full, constexprs=consts, attrs=attrs),
            target=GPUTarget("cuda", 90, 32),
            options={"num_warps": num_warps, "num_stages": num_stages},
        )

    def spills(kern) -> object:
        if not os.path.exists(cuobjdump):
            return "?"
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(kern.asm["cubin"])
            f.flush()
            sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True).stdout
        return len(re.findall(r"\b(LDL|STL)\b", sass))

    fn = K._w4a16_kernel
    divisible = ("x_ptr", "qw_ptr", "s_ptr", "z_ptr", "bias_ptr", "y_ptr", "K", "stride_xm", "stride_ym", "stride_ys")
    shapes = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (7168, 5120), (5120, 5120), (34816, 5120), (5120, 17408)]
    cases = [("bf16", 128, 1, 5120, 5120), ("bf16", 128, 4, 5120, 5120), ("bf16", 128, 200, 5120, 5120), ("bf16", 32, 2048, 5120, 5120)]
    if sweep:
        cases = [(dt, group, m, n, k) for dt, groups in (("bf16", (128, 64, 32)), ("fp16", (128,)), ("fp32", (128,)))
                 for group in groups for m in (1, 4, 64, 256, 2048) for n, k in shapes]  # fmt: skip
    seen = set()
    for dt, group, m, n, k in cases:
        cfg = K.gemm_config(m, n, k, group, fp32=dt == "fp32")
        key = (dt, group, cfg.block_m, cfg.block_n, cfg.split_k > 1, cfg.num_warps, cfg.num_stages)
        if key in seen:
            continue
        seen.add(key)
        out = "fp32" if cfg.split_k > 1 else dt
        sig = {"x_ptr": f"*{dt}", "qw_ptr": "*i32", "s_ptr": f"*{dt}", "z_ptr": f"*{dt}", "bias_ptr": f"*{dt}",
               "y_ptr": f"*{out}", "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_qn": "i32",
               "stride_sn": "i32", "stride_ym": "i32", "stride_ys": "i32"}  # fmt: skip
        consts = {"GROUP": group, "SPLIT_K": cfg.split_k, "HAS_BIAS": cfg.split_k == 1, "IEEE": dt == "fp32",
                  "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "GROUP_M": cfg.group_m}  # fmt: skip
        what = f"{dt} g{group} {tuple(cfg)}"
        kfn = fn
        if cfg.block_m == 1:  # one row: the GEMV kernel
            kfn = K._w4a16_gemv_kernel
            sig = {name: t for name, t in sig.items() if name not in ("M", "stride_xm", "stride_ym")}
            consts = {"GROUP": group, "SPLIT_K": cfg.split_k, "HAS_BIAS": cfg.split_k == 1, "BLOCK_N": cfg.block_n,
                      "NUM_STAGES": cfg.num_stages}  # fmt: skip
            what = "gemv " + what
        try:
            kern = compile_(kfn, sig, consts, cfg.num_warps, cfg.num_stages, divisible)
        except Exception as e:
            print("FAIL", what, type(e).__name__, str(e)[:1500])
            failures.append(what)
            continue
        ptx = kern.asm["ptx"]
        mma = dt == "fp32" or kfn is not fn or bool(re.search(r"(wgmma\.mma_async|mma\.sync)\S*(bf16|f16)", ptx))
        if kfn is not fn and "async_copy_global_to_local" not in kern.asm["ttgir"]:
            mma = False  # the GEMV must stream its words through the software pipeline (cp.async)
        sp = spills(kern)
        ok = mma and kern.metadata.shared <= 227 * 1024 and (sp in (0, "?") or dt == "fp32")
        print("ok  " if ok else "FAIL", what, "mma", mma, "wgmma", "wgmma" in ptx, "smem", kern.metadata.shared, "spills", sp)
        if not ok:
            failures.append(what)
    sig = {"ws_ptr": "*fp32", "bias_ptr": "*bf16", "y_ptr": "*bf16", "N": "i32", "stride_ws": "i32", "stride_wm": "i32",
           "stride_ym": "i32"}  # fmt: skip
    try:
        compile_(K._splitk_reduce_kernel, sig, {"SPLIT_K": 4, "HAS_BIAS": True, "BLOCK": 1024}, 4, 1,
                 ("ws_ptr", "bias_ptr", "y_ptr", "N", "stride_ws", "stride_wm", "stride_ym"))  # fmt: skip
        print("ok   _splitk_reduce_kernel")
    except Exception as e:
        print("FAIL _splitk_reduce_kernel", type(e).__name__, str(e)[:1500])
        failures.append("reduce")
    print("FAILURES:", failures)
    return 1 if failures else 0


CHECKS = {"ops": ops, "sampling": sampling, "gemv": gemv, "fp8": fp8, "mla": mla, "int4": int4, "int4_all": lambda: int4(sweep=True)}

if __name__ == "__main__":
    sys.exit(CHECKS[sys.argv[1]]())
