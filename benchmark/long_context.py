"""Long context on CUDA: decode steps at 8k / 32k tokens of context and the prefill of one 32k
prompt, each against its roofline.

    PYTHONPATH=. python benchmark/long_context.py --model benchmark/models/qwen3-0.6b --dummy-weights \
        --attention-backend triton --kernels --out long_context_triton.json

1. Decode: for each --contexts x --batch-sizes case that fits the KV pool (every request on its
   own slots), one decode step as latency.py drives it (graph replay), against the memory floor
   (weights + batch x context x KV bytes per token) / measured copy bandwidth; and one layer's
   attention call alone against its KV bytes.
2. Prefill: one --prefill-len prompt of random tokens through the scheduler (chunked by
   --max-extend-tokens, as served), first token out; against the compute floor: 2 x (weights
   the tokens multiply) x tokens + causal attention FLOPs over the chunks, / measured bf16
   matmul rate.
3. --kernels (triton backend): the split-K decode kernel over split bounds and tiles, and the
   extend kernel over tiles and block order, per layer on the chunked 32k prompt, next to torch's
   flash SDPA on the same dense causal problem.

The KV pool is filled with random values first (zeros would time faster than real data).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from typing import Any, Callable, Dict, List

import torch
from latency import copy_bandwidth, decode_batch, decode_step_time, kv_bytes_per_token, weight_bytes

from minisgl.core import SamplingParams
from minisgl.distributed import DistributedInfo
from minisgl.engine import Engine
from minisgl.scheduler import Scheduler, SchedulerConfig, UserRequest
from minisgl.utils.misc import div_ceil


def bench_ms(fn: Callable[[], Any], warmup: int = 10, rep: int = 40) -> float:
    """Median ms of fn (events around each call, L2 flushed between calls): for launches long
    enough that the host's launch time hides behind them."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def graph_ms(fn: Callable[[int], Any], layers: int = 8) -> float:
    """Median ms of fn(layer), replayed from a CUDA graph (no launch gaps) over `layers` layers'
    KV in turn, so that a case smaller than L2 still streams from HBM."""
    import triton.testing

    def all_layers() -> None:
        for layer in range(layers):
            fn(layer)

    return float(triton.testing.do_bench_cudagraph(all_layers, rep=30, return_mode="median")) / layers


def matmul_flops(device: torch.device, n: int = 8192) -> float:
    """Dense bf16 matmul FLOP/s on random inputs (the compute ceiling)."""
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    return 2 * n**3 / (bench_ms(lambda: a @ b) * 1e-3)


def fill_random(engine: Engine) -> None:
    buf = engine.kv_cache.buffer.view(-1)
    step = 1 << 28
    for i in range(0, buf.numel(), step):
        buf[i : i + step].normal_()


def attention_flops(model: Any, chunks: List[tuple[int, int]]) -> float:
    """QK^T and PV of causal attention, all layers: (cached, new) per chunk."""
    per_pair = 4 * model.num_qo_heads * model.head_dim * model.num_layers
    return float(sum(per_pair * (n * c + n * (n + 1) / 2) for c, n in chunks))


def linear_params(engine: Engine) -> int:
    """Weights every prompt token multiplies: all matrices but the embedding table (a tied LM
    head shares it; the LM head runs for one row per chunk, counted apart)."""
    emb = {p.data_ptr() for n, p in engine.model.named_parameters() if "embed" in n}
    seen = {p.data_ptr(): p.numel() for p in engine.model.parameters() if p.dim() >= 2 and p.data_ptr() not in emb}
    return sum(seen.values())


def decode_attention_ms(engine: Engine, batch_size: int, context: int) -> float:
    """One layer's attention call (backend.attend: the step's kernels and metadata), graph-timed."""
    be = engine.attn_backend
    batch, _ = decode_batch(engine, batch_size, context, 16)
    mc = engine.config.model_config
    q = torch.randn(batch.padded_size, mc.num_qo_heads, mc.head_dim, dtype=engine.kv_cache.buffer.dtype, device=engine.device)
    return graph_ms(lambda layer: be.attend(q, layer, batch))


def prefill_time(sched: Scheduler, n: int, vocab: int, seed: int) -> float:
    rng = random.Random(seed)
    ids = [rng.randrange(min(vocab, 100000)) for _ in range(n)]
    torch.cuda.synchronize()
    start = time.perf_counter()
    sched.add_request(UserRequest(10**9 + seed, ids, SamplingParams(max_tokens=1, ignore_eos=True)))
    first = None
    while sched.has_work():
        for out in sched.step():
            if out.token_id is not None and first is None:
                first = time.perf_counter()
    assert first is not None
    return first - start


def kernel_sweeps(engine: Engine, contexts: List[int], sizes: List[int], prefill_len: int, chunk: int) -> Dict[str, Any]:
    import torch.nn.functional as F

    from minisgl.kernel.triton_attention import decode_attention, extend_attention

    mc = engine.config.model_config
    dev, dt = engine.device, engine.kv_cache.buffer.dtype
    kv = engine.kv_cache
    k0, v0 = kv.k_cache(0), kv.v_cache(0)
    cap = k0.shape[0]
    pt = engine.page_table
    Hq, Hk, D = mc.num_qo_heads, engine.kv_cache.num_kv_heads, mc.head_dim
    scale = D**-0.5
    layer_kv = 2 * Hk * D * dt.itemsize
    res: Dict[str, Any] = {"decode": [], "extend": [], "sdpa": None}
    for ctx in contexts:
        for bs in sizes:
            if bs * ctx > cap:
                continue
            for r in range(bs):
                pt[r, :ctx] = torch.arange(r * ctx, (r + 1) * ctx, dtype=torch.int32, device=dev)
            rows = torch.arange(bs, device=dev)
            lens = torch.full((bs,), ctx, dtype=torch.int64, device=dev)
            q = torch.randn(bs, Hq, D, dtype=dt, device=dev)
            out = torch.empty_like(q)
            for S in (1, 2, 4, 8, 16, 32, 64):
                if bs * Hk * S > 8 * 264 or bs * Hk * S < 128:
                    continue
                splits = torch.full((bs,), min(S, div_ceil(ctx, 64)), dtype=torch.int64, device=dev)
                mid_o = torch.empty((bs, Hq, S, D), dtype=torch.float32, device=dev)
                mid_lse = torch.empty((bs, Hq, S), dtype=torch.float32, device=dev)
                for bn in (64, 128):
                    ms = graph_ms(
                        lambda layer: decode_attention(
                            q,
                            kv.k_cache(layer),
                            kv.v_cache(layer),
                            pt,
                            rows,
                            lens,
                            splits,
                            mid_o,
                            mid_lse,
                            out,
                            scale,
                            block_n=bn,
                            order=rows,
                        )  # fmt: skip
                    )
                    gbps = bs * ctx * layer_kv / (ms * 1e-3) / 1e9
                    res["decode"].append({"context": ctx, "batch": bs, "splits": S, "block_n": bn, "us": ms * 1e3, "GBps": gbps})
                    print(f"  decode kernel ctx {ctx} bs {bs} splits {S} block_n {bn}: {ms * 1e3:.1f} us, {gbps:.0f} GB/s", flush=True)
    n = min(prefill_len, cap)
    pt[0, :n] = torch.arange(n, dtype=torch.int32, device=dev)
    rows = torch.zeros(1, dtype=torch.int64, device=dev)
    chunks = [(c, min(chunk, n - c)) for c in range(0, n, chunk)]
    qs = {m: torch.randn(m, Hq, D, dtype=dt, device=dev) for m in {m for _, m in chunks}}
    for cfg in ((64, 64, 4, 3), (128, 64, 4, 3), (128, 64, 4, 2), (128, 64, 4, 4), (128, 32, 4, 3)):
        for heavy in (True,) if cfg != (128, 64, 4, 3) else (False, True):
            try:
                total = 0.0
                for c, m in chunks:
                    q, o = qs[m], torch.empty_like(qs[m])
                    meta = [torch.tensor([x], dtype=torch.int64, device=dev) for x in (0, c, m)]
                    total += bench_ms(
                        lambda: extend_attention(q, k0, v0, pt, rows, meta[0], meta[1], meta[2], m, o, scale, config=cfg, heavy_first=heavy)
                    )
            except Exception as e:  # a tile that overruns shared memory
                print(f"  extend {cfg} heavy_first={heavy}: failed ({type(e).__name__})", flush=True)
                continue
            fl = attention_flops(mc, chunks) / mc.num_layers
            res["extend"].append({"config": list(cfg), "heavy_first": heavy, "ms_per_layer": total, "TFLOPs": fl / (total * 1e-3) / 1e12})
            print(
                f"  extend {cfg} heavy_first={heavy}: {total:.2f} ms/layer over {len(chunks)} chunks, {fl / total / 1e9:.0f} TFLOP/s",
                flush=True,
            )
    try:
        qd = torch.randn(1, Hq, n, D, dtype=dt, device=dev)
        kd = torch.randn(1, Hq, n, D, dtype=dt, device=dev)
        ms = bench_ms(lambda: F.scaled_dot_product_attention(qd, kd, kd, is_causal=True))
        fl = attention_flops(mc, [(0, n)]) / mc.num_layers
        res["sdpa"] = {"ms_per_layer": ms, "TFLOPs": fl / (ms * 1e-3) / 1e12, "what": f"dense causal {n} tokens, {Hq} heads (K/V expanded)"}
        print(f"  torch SDPA dense causal {n}: {ms:.2f} ms/layer, {fl / ms / 1e9:.0f} TFLOP/s", flush=True)
    except Exception as e:
        print(f"  torch SDPA: failed ({e})")
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="benchmark/models/qwen3-0.6b")
    p.add_argument("--dummy-weights", action="store_true")
    p.add_argument("--attention-backend", default="triton")
    p.add_argument("--contexts", default="8192,32768")
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--prefill-len", type=int, default=32768)
    p.add_argument("--max-extend-tokens", type=int, default=None, help="prefill chunk (default: the scheduler's)")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--kernels", action="store_true", help="triton kernel sweeps (split-K decode, extend)")
    p.add_argument("--out", default=None)
    a = p.parse_args()

    contexts = [int(x) for x in a.contexts.split(",")]
    sizes = [int(x) for x in a.batch_sizes.split(",")]
    extra = {} if a.max_extend_tokens is None else {"max_extend_tokens": a.max_extend_tokens}
    cfg = SchedulerConfig(
        model_path=a.model,
        tp_info=DistributedInfo(0, 1),
        dtype=torch.bfloat16,
        device="cuda",
        attention_backend=a.attention_backend,
        use_dummy_weight=a.dummy_weights,
        max_running_req=max(sizes),
        cuda_graph_max_bs=max(sizes),
        max_seq_len_override=max(max(contexts) + a.iters + 64, a.prefill_len + 8),
        **extra,
    )
    sched = Scheduler(cfg)
    engine = sched.engine
    mc = engine.config.model_config
    dev = engine.device
    fill_random(engine)
    bw = copy_bandwidth(dev)
    flops = matmul_flops(dev)
    wbytes = weight_bytes(engine)
    kvt = kv_bytes_per_token(mc, torch.bfloat16)
    cap = engine.num_pages * engine.config.page_size
    chunk = sched.config.max_extend_tokens
    summary: Dict[str, Any] = {
        "device": torch.cuda.get_device_name(dev),
        "model": mc.architecture,
        "attention_backend": engine.config.attention_backend,
        "copy_bandwidth_GBps": bw / 1e9,
        "matmul_TFLOPs": flops / 1e12,
        "weight_GB": wbytes / 1e9,
        "kv_bytes_per_token": kvt,
        "kv_pool_tokens": cap,
        "max_extend_tokens": chunk,
    }
    print(f"copy {bw / 1e9:.0f} GB/s, bf16 matmul {flops / 1e12:.0f} TFLOP/s, KV pool {cap} tokens", flush=True)

    decode: List[Dict[str, Any]] = []
    for ctx in contexts:
        for bs in sizes:
            if bs * (ctx + a.iters + 16) > cap:
                decode.append({"context": ctx, "batch": bs, "fits": False})
                print(f"decode ctx {ctx} bs {bs}: does not fit ({bs * ctx} > {cap} tokens)", flush=True)
                continue
            t = decode_step_time(engine, bs, ctx, a.iters)
            attn = decode_attention_ms(engine, bs, ctx)
            floor = (wbytes + bs * ctx * kvt) / bw
            layer_kv = bs * ctx * kvt / mc.num_layers
            row = {
                "context": ctx, "batch": bs, "fits": True, "step_ms": t * 1e3, "roofline_ms": floor * 1e3,
                "ratio": t / floor, "tok_per_s": bs / t, "attn_layer_us": attn * 1e3,
                "attn_layer_floor_us": layer_kv / bw * 1e6, "attn_GBps": layer_kv / (attn * 1e-3) / 1e9,
            }  # fmt: skip
            decode.append(row)
            print(
                f"decode ctx {ctx} bs {bs}: step {t * 1e3:.3f} ms, roofline {floor * 1e3:.3f} ms ({t / floor:.2f}x); "
                f"attention {attn * 1e3:.1f} us/layer ({row['attn_GBps']:.0f} GB/s)",
                flush=True,
            )
    summary["decode"] = decode

    n = a.prefill_len
    chunks = [(c, min(chunk, n - c)) for c in range(0, n, chunk)]
    lin = linear_params(engine)
    attn_fl = attention_flops(mc, chunks)
    lin_fl = 2.0 * lin * n + 2.0 * mc.vocab_size * mc.hidden_size * len(chunks)
    prefill_time(sched, n, mc.vocab_size, seed=1)  # compiles every chunk's kernels
    times = [prefill_time(sched, n, mc.vocab_size, seed=s) for s in (2, 3)]
    t = min(times)
    floor = (attn_fl + lin_fl) / flops
    summary["prefill"] = {
        "tokens": n, "chunks": len(chunks), "ms": t * 1e3, "all_ms": [x * 1e3 for x in times],
        "roofline_ms": floor * 1e3, "ratio": t / floor, "attention_TFLOP": attn_fl / 1e12, "linear_TFLOP": lin_fl / 1e12,
        "achieved_TFLOPs": (attn_fl + lin_fl) / t / 1e12, "tok_per_s": n / t,
    }  # fmt: skip
    print(
        f"prefill {n} tokens ({len(chunks)} chunks): {t * 1e3:.1f} ms, roofline {floor * 1e3:.1f} ms ({t / floor:.2f}x); "
        f"attention {attn_fl / 1e12:.1f} + linear {lin_fl / 1e12:.1f} TFLOP",
        flush=True,
    )
    if a.kernels and engine.config.attention_backend == "triton":
        summary["kernels"] = kernel_sweeps(engine, contexts, sizes, n, chunk)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(summary, f, indent=2)
    print(json.dumps({k: v for k, v in summary.items() if k != "kernels"}))
    sched.shutdown()


if __name__ == "__main__":
    main()
