"""GPU checks for the attention backends and CUDA graphs, in one process (one device call).

  PYTHONPATH=. python3 benchmark/gpu_check.py [--parts kernels,engine,timing] [--out DIR]

kernels: the triton (and flashinfer, when importable) backend against the torch backend on random
         paged inputs: decode with contexts up to 9k (split-K), extend over a cached prefix,
         page_size 1 and 16, GQA and MHA, bf16 and fp32; every element written, no NaN. Also a
         decode step replayed from a CUDA graph with changing lengths equals the eager call.
engine:  an Engine on a tiny random Qwen3 (float32): greedy tokens with CUDA graphs == without
         graphs == HF generate, for each GPU backend, page_size 1 and 16, a batch that shrinks
         (so several graph sizes replay with padding).
timing:  decode step (graph replay) of Qwen3-0.6B-shaped dummy weights (bf16) at batch 1, 64,
         256 with context 600, next to the memory roofline; and the attention kernel alone.

On a machine without CUDA the kernels and engine parts run the triton kernels in Triton's
interpreter (TRITON_INTERPRET=1, slow, small sizes: `--quick`) to check the logic.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
import traceback
from types import SimpleNamespace
from typing import Any, Dict, List, Tuple

import torch

from minisgl.attention import ATTN_BACKENDS
from minisgl.core import Batch, Context, Req, SamplingParams, clear_global_ctx, set_global_ctx
from minisgl.kvcache.pool import KVCachePool

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS: Dict[str, Any] = {"kernels": [], "engine": [], "timing": [], "errors": []}


def log(msg: str) -> None:
    print(msg, flush=True)


def gpu_backends(device: torch.device) -> List[str]:
    names = []
    try:
        import triton  # noqa: F401

        names.append("triton")
    except ImportError:
        pass
    if device.type == "cuda":
        try:
            import flashinfer  # noqa: F401

            names.append("flashinfer")
        except ImportError:
            pass
    return names


# ---------------------------------------------------------------------------------------------
# kernels: backends against the torch reference on random paged inputs
# ---------------------------------------------------------------------------------------------
def _alloc_rows(lens: List[int], page_size: int, gen: torch.Generator) -> Tuple[List[torch.Tensor], int]:
    """Random, non-contiguous pages for each request; returns per-request slot lists."""
    pages_per = [math.ceil(n / page_size) for n in lens]
    num_pages = sum(pages_per) + 3
    perm = torch.randperm(num_pages, generator=gen)
    out, at = [], 0
    for n, p in zip(lens, pages_per):
        pages = perm[at : at + p]
        at += p
        slots = (pages[:, None] * page_size + torch.arange(page_size)[None, :]).reshape(-1)[:n]
        out.append(slots)
    return out, num_pages * page_size


def _make_backends(
    names: List[str], slots_total: int, Hq: int, Hk: int, D: int, page_size: int, dtype: torch.dtype,
    device: torch.device, table: torch.Tensor, kv_values: Tuple[torch.Tensor, torch.Tensor],
) -> Dict[str, Any]:  # fmt: skip
    cfg = SimpleNamespace(num_qo_heads=Hq, num_kv_heads=Hk, head_dim=D)
    out = {}
    for name, dt in [(n, dtype) for n in names] + [("ref", torch.float32)]:
        ctx = Context(page_size)
        ctx.kv_cache = KVCachePool(1, slots_total + page_size, Hk, D, device, dt)
        ctx.kv_cache.buffer[0, 0].copy_(kv_values[0])
        ctx.kv_cache.buffer[1, 0].copy_(kv_values[1])
        ctx.page_table = table
        set_global_ctx(ctx)
        try:
            out[name] = ATTN_BACKENDS.get("torch" if name == "ref" else name)(cfg)  # type: ignore[arg-type]
        finally:
            clear_global_ctx()
    return out


def _rel(a: torch.Tensor, ref: torch.Tensor) -> Tuple[float, float]:
    a, ref = a.double(), ref.double()
    norm_rel = ((a - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    max_rel = ((a - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
    return norm_rel, max_rel


def _poisoned_empty_cache(device: torch.device, like: torch.Tensor) -> None:
    """Leave NaN in the allocator's recently freed block so an unwritten output shows up."""
    if device.type == "cuda":
        junk = torch.full(like.shape, float("nan"), dtype=like.dtype, device=device)
        del junk


def flashinfer_case(dtype: torch.dtype, D: int, group: int, decode: bool) -> bool:
    """FlashInfer has no float32 kernels, and each new (dtype, head_dim, kernel) JIT-compiles for
    minutes on the device: check it on the shapes the benchmarks use (bf16, D=128, GQA group < 4
    for decode, which runs FlashInfer's CUDA-core decode kernel)."""
    return dtype in (torch.bfloat16, torch.float16) and D == 128 and (group < 4 or not decode)


def check_attention_case(
    name: str, backends: List[str], Hq: int, Hk: int, D: int, page_size: int,
    reqs_spec: List[Tuple[int, int]], dtype: torch.dtype, device: torch.device, seed: int, num_decode: int = 0,
) -> None:  # fmt: skip
    """reqs_spec: (cached_len, extend_len) per request; all extend_len == 1 and cached >= 0 -> decode.
    num_decode > 0: a mixed prefill batch whose first num_decode requests are decode rows."""
    gen = torch.Generator().manual_seed(seed)
    decode = all(e == 1 for _, e in reqs_spec)
    lens = [c + e for c, e in reqs_spec]
    slots, slots_total = _alloc_rows(lens, page_size, gen)
    width = ((max(lens) + 31) // 32) * 32
    table = torch.zeros((len(reqs_spec) + 1, width), dtype=torch.int32)
    for i, s in enumerate(slots):
        table[i, : len(s)] = s.int()
    table[-1] = slots_total  # the dummy row
    table = table.to(device)
    num_slots = slots_total + page_size
    kv = (
        torch.randn(num_slots, Hk, D, generator=gen).to(dtype).to(device),
        torch.randn(num_slots, Hk, D, generator=gen).to(dtype).to(device),
    )
    T = sum(e for _, e in reqs_spec)
    q = torch.randn(T, Hq, D, generator=gen).to(dtype).to(device)
    k = torch.randn(T, Hk, D, generator=gen).to(dtype).to(device)
    v = torch.randn(T, Hk, D, generator=gen).to(dtype).to(device)
    reqs = []
    for i, (c, e) in enumerate(reqs_spec):
        ids = torch.zeros(c + e, dtype=torch.int32)
        reqs.append(Req(input_ids=ids, table_idx=i, cached_len=c, output_len=1, uid=i,
                        sampling_params=SamplingParams(), cache_handle=None))  # fmt: skip
    batch = Batch(reqs=reqs, phase="decode" if decode else "prefill")
    batch.num_decode_rows = num_decode
    batch.out_loc = torch.cat([table[i, c : c + e] for i, (c, e) in enumerate(reqs_spec)])
    backends = [b for b in backends if b != "flashinfer" or flashinfer_case(dtype, D, Hq // Hk, decode)]
    bks = _make_backends(backends, slots_total, Hq, Hk, D, page_size, dtype, device, table, kv)

    def run(bk: Any, dt: torch.dtype) -> torch.Tensor:
        bk.prepare_metadata(batch)
        _poisoned_empty_cache(device, q)
        o = bk.forward(q.to(dt), k.to(dt), v.to(dt), 0, batch)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return o

    ref = run(bks["ref"], torch.float32)
    torch_out = run(bks["torch"], dtype) if "torch" in bks else None
    if torch_out is None:
        bks_t = _make_backends(["torch"], slots_total, Hq, Hk, D, page_size, dtype, device, table, kv)
        torch_out = run(bks_t["torch"], dtype)
    t_norm, t_max = _rel(torch_out, ref)
    tol = 2e-2 if dtype != torch.float32 else 2e-4
    for bname in backends:
        out = run(bks[bname], dtype)
        nan = bool(torch.isnan(out).any().item())
        n_ref, m_ref = _rel(out, ref)
        n_t, m_t = _rel(out, torch_out)
        ok = (not nan) and m_ref <= max(tol, 2 * t_max) and m_t <= 2 * tol
        row = dict(case=name, backend=bname, dtype=str(dtype).replace("torch.", ""), page_size=page_size,
                   heads=f"{Hq}/{Hk}x{D}", max_len=max(lens), nan=nan, max_rel_vs_torch=m_t,
                   norm_rel_vs_torch=n_t, max_rel_vs_fp32=m_ref, torch_max_rel_vs_fp32=t_max, ok=ok)  # fmt: skip
        RESULTS["kernels"].append(row)
        log(f"  [{'ok' if ok else 'FAIL'}] {name:<34} {bname:<10} {row['dtype']:<8} ps={page_size:<2} "
            f"max_rel vs torch {m_t:.2e} (norm {n_t:.1e})  vs fp32 {m_ref:.2e} (torch's own {t_max:.2e})"
            f"{'  NaN!' if nan else ''}")  # fmt: skip
        assert ok, f"{bname} {name}: error too large or NaN"


def check_graph_decode(backend: str, device: torch.device, dtype: torch.dtype) -> None:
    """Capture one decode attention call per graph, replay with new lengths/rows: == eager."""
    Hq, Hk, D, ps = 16, 8, 128, 1
    gen = torch.Generator().manual_seed(7)
    max_len, nreq = 6000, 9
    bs_list = [4, 8]
    lens_all = [max_len] * nreq
    slots, slots_total = _alloc_rows(lens_all, ps, gen)
    table = torch.zeros((nreq + 1, max_len + 32), dtype=torch.int32)
    for i, s in enumerate(slots):
        table[i, : len(s)] = s.int()
    table[-1] = slots_total
    table = table.to(device)
    kv = (
        torch.randn(slots_total + ps, Hk, D, generator=gen).to(dtype).to(device),
        torch.randn(slots_total + ps, Hk, D, generator=gen).to(dtype).to(device),
    )
    bk = _make_backends([backend], slots_total, Hq, Hk, D, ps, dtype, device, table, kv)[backend]
    dummy = Req(input_ids=torch.zeros(1, dtype=torch.int32), table_idx=nreq, cached_len=0, output_len=1, uid=-1,
                sampling_params=SamplingParams(), cache_handle=None)  # fmt: skip
    bk.init_capture_graph(max_len + 32, bs_list)
    graphs, outs, qbuf = {}, {}, torch.zeros(max(bs_list), Hq, D, dtype=dtype, device=device)
    kbuf = torch.zeros(max(bs_list), Hk, D, dtype=dtype, device=device)
    locbuf = torch.full((max(bs_list),), slots_total, dtype=torch.int32, device=device)
    stream = torch.cuda.Stream()
    for bs in reversed(bs_list):
        batch = Batch(reqs=[dummy] * bs, phase="decode")
        batch.out_loc = locbuf[:bs]
        bk.prepare_for_capture(batch)
        with torch.cuda.stream(stream):
            bk.forward(qbuf[:bs], kbuf[:bs], kbuf[:bs], 0, batch)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=stream):
                outs[bs] = bk.forward(qbuf[:bs], kbuf[:bs], kbuf[:bs], 0, batch)
        graphs[bs] = g
    torch.cuda.synchronize()
    worst = 0.0
    for trial, (n, bs) in enumerate([(3, 4), (4, 4), (7, 8), (5, 8)]):
        lens = torch.randint(1, max_len, (n,), generator=gen).tolist()
        lens[0] = max_len - 1 if trial % 2 == 0 else 1
        rows = torch.randperm(nreq, generator=gen)[:n].tolist()
        reqs = [Req(input_ids=torch.zeros(L, dtype=torch.int32), table_idx=r, cached_len=L - 1, output_len=1, uid=j,
                    sampling_params=SamplingParams(), cache_handle=None) for j, (L, r) in enumerate(zip(lens, rows))]  # fmt: skip
        batch = Batch(reqs=reqs, phase="decode")
        batch.padded_reqs = reqs + [dummy] * (bs - n)
        batch.out_loc = locbuf[:bs]  # the graph stores this step's k/v at the dummy slot only
        qn = torch.randn(bs, Hq, D, generator=gen).to(dtype).to(device)
        bk.prepare_metadata(batch)
        eager = bk.forward(qn, kbuf[:bs], kbuf[:bs], 0, batch).clone()
        qbuf[:bs].copy_(qn)
        bk.prepare_for_replay(batch)
        graphs[bs].replay()
        torch.cuda.synchronize()
        diff = (outs[bs][:n].float() - eager[:n].float()).abs().max().item()
        nan = bool(torch.isnan(outs[bs]).any().item())
        worst = max(worst, diff)
        assert not nan and diff == 0.0, f"{backend}: graph replay differs from eager by {diff} (nan={nan})"
    RESULTS["kernels"].append(dict(case="graph replay == eager (decode, ctx<=6000)", backend=backend, max_abs_diff=worst, ok=True))
    log(f"  [ok] graph replay == eager (decode attention, bs 4/8 padded, ctx <= 6000)  {backend}: max abs diff {worst}")


def check_graph_mixed(device: torch.device, dtype: torch.dtype) -> None:
    """Capture the triton backend's prefill attention (decode rows + chunks) once for a token
    bound, replay it with other mixes of decode rows and chunks: == the eager call, bit for bit."""
    Hq, Hk, D, ps = 16, 8, 128, 1
    gen = torch.Generator().manual_seed(8)
    max_len, nreq, T, n_dec_cap, n_ext_cap = 3000, 20, 512, 12, 4
    slots, slots_total = _alloc_rows([max_len] * nreq, ps, gen)
    table = torch.zeros((nreq + 1, max_len + 32), dtype=torch.int32)
    for i, s_ in enumerate(slots):
        table[i, : len(s_)] = s_.int()
    table[-1] = slots_total
    table = table.to(device)
    kv = tuple(torch.randn(slots_total + ps, Hk, D, generator=gen).to(dtype).to(device) for _ in range(2))
    bk = _make_backends(["triton"], slots_total, Hq, Hk, D, ps, dtype, device, table, kv)["triton"]  # type: ignore[arg-type]
    dummy = Req(input_ids=torch.zeros(1, dtype=torch.int32), table_idx=nreq, cached_len=0, output_len=1, uid=-1,
                sampling_params=SamplingParams(), cache_handle=None)  # fmt: skip
    bk.init_mixed_graph(n_dec_cap + n_ext_cap)
    qbuf = torch.zeros(T, Hq, D, dtype=dtype, device=device)
    kbuf = torch.zeros(T, Hk, D, dtype=dtype, device=device)
    locbuf = torch.full((T,), slots_total, dtype=torch.int32, device=device)
    batch = Batch(reqs=[dummy], phase="prefill")
    batch.out_loc = locbuf
    bk.prepare_for_mixed_capture(batch, n_dec_cap, n_ext_cap, T)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        bk.forward(qbuf, kbuf, kbuf, 0, batch)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=stream):
            gout = bk.forward(qbuf, kbuf, kbuf, 0, batch)
    torch.cuda.synchronize()
    worst = 0.0
    for trial, (n_dec, chunks) in enumerate([(3, [200]), (12, [1, 300, 7]), (0, [500]), (5, [64, 64, 64, 64])]):
        rows = torch.randperm(nreq, generator=gen)[: n_dec + len(chunks)].tolist()
        reqs = []
        for j, r in enumerate(rows):
            if j < n_dec:
                L = int(torch.randint(1, max_len, (1,), generator=gen))
                reqs.append(Req(input_ids=torch.zeros(L, dtype=torch.int32), table_idx=r, cached_len=L - 1, output_len=1,
                                uid=j, sampling_params=SamplingParams(), cache_handle=None))  # fmt: skip
            else:
                c, e = int(torch.randint(0, 2000, (1,), generator=gen)), chunks[j - n_dec]
                reqs.append(Req(input_ids=torch.zeros(c + e, dtype=torch.int32), table_idx=r, cached_len=c, output_len=1,
                                uid=j, sampling_params=SamplingParams(), cache_handle=None))  # fmt: skip
        n = n_dec + sum(chunks)
        mb = Batch(reqs=reqs, phase="prefill")
        mb.num_decode_rows = n_dec
        mb.out_loc = locbuf[:n]  # this step's k/v go to the dummy slot: the pool stays as drawn
        qn = torch.randn(n, Hq, D, generator=gen).to(dtype).to(device)
        bk.prepare_metadata(mb)
        eager = bk.forward(qn, kbuf[:n], kbuf[:n], 0, mb).clone()
        qbuf[:n].copy_(qn)
        bk.prepare_for_mixed_replay(mb)
        g.replay()
        torch.cuda.synchronize()
        diff = (gout[:n].float() - eager.float()).abs().max().item()
        nan = bool(torch.isnan(eager).any().item())
        worst = max(worst, diff)
        assert not nan and diff == 0.0, f"mixed graph replay differs from eager by {diff} (nan={nan}, trial {trial})"
    RESULTS["kernels"].append(
        dict(case="graph replay == eager (mixed: decode rows + chunks)", backend="triton", max_abs_diff=worst, ok=True)
    )
    log(f"  [ok] graph replay == eager (mixed attention, T<=512, <=12 decode rows + <=4 chunks)  triton: max abs diff {worst}")


def part_kernels(device: torch.device, backends: List[str], quick: bool) -> None:
    log("== kernels: backends vs the torch backend (random paged inputs)")
    bf16 = torch.bfloat16
    long = [1, 17, 600, 4097, 9000, 33, 2048, 64] if not quick else [1, 17, 130, 65]
    mixed_spec = [(599, 1), (4000, 1), (0, 1), (70, 1), (0, 300), (37, 64), (5, 1)]
    cases: List[Tuple[str, int, int, int, int, List[Tuple[int, int]], torch.dtype]] = [
        ("decode GQA16/8 D128 ctx<=9000", 16, 8, 128, 1, [(n - 1, 1) for n in long], bf16),
        ("decode GQA16/8 D128 ctx<=9000", 16, 8, 128, 16, [(n - 1, 1) for n in long], bf16),
        ("decode GQA32/4 D128", 32, 4, 128, 16, [(n - 1, 1) for n in ([5000, 3, 777, 16, 17] if not quick else [70, 3])], bf16),
        ("decode MHA4/4 D64", 4, 4, 64, 1, [(n - 1, 1) for n in [1, 200, 4500]], bf16),
        ("decode bs256 ctx600", 16, 8, 128, 1, [(599, 1)] * (256 if not quick else 4), bf16),
        ("decode GQA16/8 D128 fp32", 16, 8, 128, 1, [(n - 1, 1) for n in long[:6]], torch.float32),
        ("extend GQA16/8 D128 prefix", 16, 8, 128, 1, [(0, 100), (37, 64), (500, 3), (0, 1), (1000, 257), (5, 700)], bf16),
        ("extend GQA16/8 D128 prefix", 16, 8, 128, 16, [(0, 100), (37, 64), (500, 3), (0, 1), (1000, 257), (5, 700)], bf16),
        ("extend GQA32/4 D128 prefix", 32, 4, 128, 16, [(4096, 129), (0, 2000), (16, 16)], bf16),
        ("extend long chunks GQA16/8 D128", 16, 8, 128, 1, [(1000, 3000), (0, 2100), (5, 7)], bf16),  # 128-row tiles
        ("extend MHA4/4 D64 prefix", 4, 4, 64, 1, [(0, 33), (100, 90)], bf16),
        ("extend GQA16/8 D128 fp32", 16, 8, 128, 1, [(0, 100), (37, 64), (500, 3), (0, 1), (100, 65)], torch.float32),
        ("mixed 4 decode rows + chunks", 16, 8, 128, 16, mixed_spec, bf16),
        ("mixed 4 decode rows + chunks fp32", 16, 8, 128, 1, mixed_spec, torch.float32),
    ]
    if quick:
        cases = [c for c in cases if "extend GQA32/4" not in c[0] and "long chunks" not in c[0]]
        cases = [(n, a, b, c, d, [(min(x, 70), min(y, 40)) for x, y in spec], dt) for n, a, b, c, d, spec, dt in cases]
    if device.type != "cuda":  # Triton's interpreter: its bf16 tl.dot is broken, so every case in float32
        cases = [(n if dt == torch.float32 else f"{n} (fp32)", a, b, c, d, spec, torch.float32)
                 for n, a, b, c, d, spec, dt in cases]  # fmt: skip
    for i, (name, Hq, Hk, D, ps, spec, dt) in enumerate(cases):
        try:
            nd = 4 if name.startswith("mixed") else 0
            check_attention_case(name, backends, Hq, Hk, D, ps, spec, dt, device, seed=1000 + i, num_decode=nd)
        except Exception as e:  # keep going: report every case
            RESULTS["errors"].append(f"kernels {name} ps={ps}: {e!r}")
            log(f"  [FAIL] {name} ps={ps}: {e!r}")
            traceback.print_exc()
    if device.type == "cuda":
        try:
            check_graph_mixed(device, bf16)
        except Exception as e:
            RESULTS["errors"].append(f"graph mixed triton: {e!r}")
            log(f"  [FAIL] graph mixed triton: {e!r}")
            traceback.print_exc()
        for b in backends:
            try:
                check_graph_decode(b, device, bf16)
            except Exception as e:
                RESULTS["errors"].append(f"graph decode {b}: {e!r}")
                log(f"  [FAIL] graph decode {b}: {e!r}")
                traceback.print_exc()


# ---------------------------------------------------------------------------------------------
# engine: tiny random Qwen3, graphs == eager == HF
# ---------------------------------------------------------------------------------------------
def build_tiny_qwen3(path: str) -> None:
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = Qwen3Config(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=128, max_position_embeddings=1024, initializer_range=0.2,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(path)


def run_engine(path: str, device: torch.device, backend: str, page_size: int, graphs: bool, dtype: torch.dtype,
               prompts: List[List[int]], n_new: List[int], mixed: bool = False) -> Tuple[List[List[int]], Dict[str, Any]]:  # fmt: skip
    """mixed: requests arrive one at a time, each prompt in chunks of MIXED_CHUNK tokens that ride
    along with the running requests' decode rows (mixed batches, as the scheduler builds them);
    else all prompts prefill in one batch, then decode."""
    from minisgl.distributed import DistributedInfo
    from minisgl.engine import Engine, EngineConfig

    max_seq = 512
    cfg = EngineConfig(
        model_path=path, tp_info=DistributedInfo(0, 1), dtype=dtype, device=str(device),
        max_running_req=8, attention_backend=backend, page_size=page_size,
        cuda_graph_bs=None if graphs else [], num_page_override=(8 * max_seq) // page_size + 8,
        max_seq_len_override=max_seq,
    )  # fmt: skip
    engine = Engine(cfg)
    info = dict(backend=engine.config.attention_backend, graph_sizes=list(engine.graph_runner.batch_sizes))
    try:
        gen = torch.Generator().manual_seed(5)
        pages = torch.randperm(engine.num_pages, generator=gen)  # scattered pages for every row
        per_row = max_seq // page_size
        for row in range(len(prompts)):
            p = pages[row * per_row : (row + 1) * per_row]
            engine.page_table[row, :max_seq] = (p[:, None] * page_size + torch.arange(page_size)).reshape(-1).int().to(device)
        reqs = [
            Req(input_ids=torch.tensor(p, dtype=torch.int32), table_idx=i, cached_len=0, output_len=n, uid=i,
                sampling_params=SamplingParams(max_tokens=n, ignore_eos=True), cache_handle=None)
            for i, (p, n) in enumerate(zip(prompts, n_new))
        ]  # fmt: skip
        outs: List[List[int]] = [[] for _ in reqs]
        waiting = list(reqs) if mixed else []
        running, chunking = ([] if mixed else list(reqs)), []
        replays, mixed_replays, mixed_steps, padded_seen, first = 0, 0, 0, set(), True
        while running or chunking or waiting:
            if mixed and not chunking and waiting:
                chunking.append(waiting.pop(0))
            for r in chunking:
                r.device_len = min(r.prompt_len, r.cached_len + MIXED_CHUNK)
            if chunking or first:
                batch = Batch(reqs=running + chunking, phase="prefill")
                batch.num_decode_rows = len(running) if mixed else 0
            else:
                batch = Batch(reqs=running, phase="decode")
            first = False
            engine.graph_runner.pad_batch(batch)
            fill_batch(engine, batch)
            engine.attn_backend.prepare_metadata(batch)
            use_graph = engine.graph_runner.can_use_cuda_graph(batch)
            replays += int(use_graph)
            if batch.is_prefill and batch.num_decode_rows > 0:
                mixed_steps += 1
                mixed_replays += int(use_graph)
            if batch.padded_size != batch.size:
                padded_seen.add((batch.size, batch.padded_size))
            out = engine.forward_batch(batch, engine.sampler.prepare(batch))
            out.copy_done_event.synchronize()
            for i, r in enumerate(batch.reqs):
                if r in chunking and r.cached_len < r.prompt_len:
                    r.device_len = r.cached_len  # mid-prompt chunk: its sample is not a token
                    continue
                r.append_host(out.next_tokens_cpu[i : i + 1])
                outs[r.uid].append(int(out.next_tokens_cpu[i]))
                if r in chunking:
                    chunking.remove(r)
                    running.append(r)
            running = [r for r in running if len(outs[r.uid]) < n_new[r.uid]]
        info.update(replays=replays, padded=sorted(padded_seen))
        if mixed:
            info.update(mixed_steps=mixed_steps, mixed_replays=mixed_replays)
        return outs, info
    finally:
        engine.shutdown()


MIXED_CHUNK = 96  # prompt tokens per mixed step in run_engine(mixed=True)


def fill_batch(engine: Any, batch: Batch) -> None:
    """input_ids / positions / out_loc over the padded requests (the dummy: its one slot), with one
    host-to-device copy each and one gather from the page table."""
    rows: List[int] = []
    pos: List[int] = []
    ids = []
    for r in batch.padded_reqs:
        rows += [r.table_idx] * (r.device_len - r.cached_len)
        pos += range(r.cached_len, r.device_len)
        ids.append(r.input_ids[r.cached_len : r.device_len])
    dev = engine.device
    positions = torch.tensor(pos, dtype=torch.int32)
    batch.input_ids = torch.cat(ids).to(dev, non_blocking=True)
    batch.positions = positions.to(dev, non_blocking=True)
    batch.out_loc = engine.page_table[torch.tensor(rows).to(dev, non_blocking=True), positions.long().to(dev, non_blocking=True)]


def hf_generate(path: str, device: torch.device, prompts: List[List[int]], n_new: List[int]) -> List[List[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    outs = []
    with torch.no_grad():
        for p, n in zip(prompts, n_new):
            ids = torch.tensor([p], device=device)
            g = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
            outs.append(g[0, len(p) :].tolist())
    del model
    return outs


def part_engine(device: torch.device, backends: List[str], quick: bool) -> None:
    log("== engine: tiny random Qwen3 (float32), CUDA graphs vs eager vs HF generate")
    gen = torch.Generator().manual_seed(11)
    lens = [7, 45, 130, 260, 400] if not quick else [5, 9, 70]
    n_new = [24, 10, 17, 24, 5] if not quick else [6, 3, 5]
    prompts = [torch.randint(1, 512, (n,), generator=gen).tolist() for n in lens]
    with tempfile.TemporaryDirectory() as d:
        build_tiny_qwen3(d)
        t0 = time.perf_counter()
        hf = hf_generate(d, device, prompts, n_new)
        log(f"  HF generate done ({time.perf_counter() - t0:.1f}s)")
        f32, bf16 = torch.float32, torch.bfloat16
        variants = [("torch", 1, False, f32, False)]
        for b in backends:
            if device.type != "cuda":
                variants += [(b, 1, False, f32, False), (b, 16, False, f32, False)]
                variants += [(b, 1, False, f32, True)] if b == "triton" else []
            elif b == "flashinfer":  # no float32 kernels: bf16, compared with triton in bf16
                variants += [(b, 1, True, bf16, False), (b, 1, False, bf16, False), (b, 16, True, bf16, False)]
            else:
                variants += [(b, 1, False, f32, False), (b, 1, True, f32, False), (b, 16, True, f32, False),
                             (b, 1, True, bf16, False), (b, 1, False, bf16, False)]  # fmt: skip
                # mixed batches (decode rows + prompt chunks): CUDA graphs of prefill steps vs eager
                variants += [(b, 1, True, f32, True), (b, 1, False, f32, True), (b, 16, True, f32, True),
                             (b, 1, True, bf16, True), (b, 1, False, bf16, True)]  # fmt: skip
        results: Dict[str, List[List[int]]] = {}
        total = sum(n_new)
        for b, ps, graphs, dt, mixed in variants:
            key = f"{b} ps={ps} {'graphs' if graphs else 'eager'} {str(dt).replace('torch.', '')}{' mixed' if mixed else ''}"
            try:
                t0 = time.perf_counter()
                outs, info = run_engine(d, device, b, ps, graphs, dt, prompts, n_new, mixed=mixed)
                results[key] = outs
                n_match = sum(x == y for o, h in zip(outs, hf) for x, y in zip(o, h))
                row = dict(variant=key, equals_hf=outs == hf, tokens_matching_hf=f"{n_match}/{total}", **info,
                           seconds=round(time.perf_counter() - t0, 1))  # fmt: skip
                RESULTS["engine"].append(row)
                if dt == f32:
                    log(f"  [{'ok' if outs == hf else 'DIFF'}] {key:<32} == HF fp32: {outs == hf} ({n_match}/{total}) {info}")
                    if outs != hf:
                        RESULTS["errors"].append(f"engine {key}: differs from HF generate")
                else:
                    log(f"  [info] {key:<32} vs HF fp32: {n_match}/{total} tokens {info}")
            except Exception as e:
                RESULTS["errors"].append(f"engine {key}: {e!r}")
                log(f"  [FAIL] engine {key}: {e!r}")
                traceback.print_exc()

        def compare(a: str, b_: str, must: bool) -> None:
            x, y = results.get(a), results.get(b_)
            if x is None or y is None:
                return
            n = sum(p == q for o1, o2 in zip(x, y) for p, q in zip(o1, o2))
            RESULTS["engine"].append(dict(variant=f"{a} == {b_}", equal=x == y, tokens=f"{n}/{total}"))
            log(f"  [{'ok' if x == y else ('DIFF' if must else 'info')}] {a} == {b_}: {x == y} ({n}/{total} tokens)")
            if must and x != y:
                RESULTS["errors"].append(f"{a} differs from {b_}")

        compare("triton ps=1 graphs float32", "triton ps=1 eager float32", True)
        compare("triton ps=1 graphs bfloat16", "triton ps=1 eager bfloat16", True)
        compare("triton ps=1 graphs float32 mixed", "triton ps=1 eager float32 mixed", True)
        compare("triton ps=1 graphs bfloat16 mixed", "triton ps=1 eager bfloat16 mixed", True)
        compare("flashinfer ps=1 graphs bfloat16", "flashinfer ps=1 eager bfloat16", False)
        compare("flashinfer ps=1 graphs bfloat16", "triton ps=1 graphs bfloat16", False)


# ---------------------------------------------------------------------------------------------
# timing: Qwen3-0.6B-shaped dummy weights, decode step at bs 1/64/256, ctx 600
# ---------------------------------------------------------------------------------------------
def measure_copy_bandwidth(device: torch.device) -> float:
    x = torch.empty(1 << 30, dtype=torch.uint8, device=device)  # 1 GiB
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(20):
        y.copy_(x)
    e.record()
    torch.cuda.synchronize()
    return 2 * x.numel() * 20 / (s.elapsed_time(e) / 1e3)  # bytes/s, read + write


def part_timing(device: torch.device, backend: str, bs_list: List[int], ctx_len: int, steps: int) -> None:
    from minisgl.distributed import DistributedInfo
    from minisgl.engine import Engine, EngineConfig

    log(f"== timing: Qwen3-0.6B shape, dummy bf16 weights, backend {backend}, ctx {ctx_len}")
    bw = measure_copy_bandwidth(device)
    path = os.path.join(HERE, "models", "qwen3-0.6b")
    width = ctx_len + steps + 64
    max_bs = max(bs_list)
    cfg = EngineConfig(
        model_path=path, tp_info=DistributedInfo(0, 1), dtype=torch.bfloat16, device=str(device),
        max_running_req=max_bs, attention_backend=backend, cuda_graph_bs=bs_list,
        num_page_override=max_bs * width + 16, max_seq_len_override=width, use_dummy_weight=True,
    )  # fmt: skip
    t0 = time.perf_counter()
    engine = Engine(cfg)
    log(f"  engine built with graphs {engine.graph_runner.batch_sizes} in {time.perf_counter() - t0:.1f}s")
    try:
        mc = engine.config.model_config
        # Bytes of weights read per decode step: every matrix once; the embedding lookup reads a few
        # rows, so the table counts only when the LM head is tied to it (then the head reads it).
        params = dict(engine.model.named_parameters())
        unique = {p.data_ptr(): p for p in params.values()}
        weight_bytes = sum(p.numel() * p.element_size() for p in unique.values())
        emb = params.get("model.embed_tokens.weight")
        head = params.get("lm_head.weight")
        if emb is not None and (head is None or head.data_ptr() != emb.data_ptr()):
            weight_bytes -= emb.numel() * emb.element_size()
        kv_per_token = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * 2
        engine.kv_cache.buffer.normal_()  # never time on zeros
        for row in range(max_bs):
            engine.page_table[row, :width] = torch.arange(row * width, (row + 1) * width, dtype=torch.int32, device=device)
        gen = torch.Generator().manual_seed(3)
        for bs in bs_list:
            reqs = [
                Req(input_ids=torch.randint(0, 10000, (ctx_len,), generator=gen, dtype=torch.int32), table_idx=i,
                    cached_len=ctx_len - 1, output_len=steps + 8, uid=i,
                    sampling_params=SamplingParams(ignore_eos=True), cache_handle=None)
                for i in range(bs)
            ]  # fmt: skip
            batch = Batch(reqs=reqs, phase="decode")
            engine.graph_runner.pad_batch(batch)
            fill_batch(engine, batch)
            engine.attn_backend.prepare_metadata(batch)
            assert engine.graph_runner.can_use_cuda_graph(batch)
            # (1) graph replay alone, device events
            with torch.inference_mode():
                for _ in range(5):
                    engine.graph_runner.replay(batch)
                torch.cuda.synchronize()
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                n = 50
                s.record()
                for _ in range(n):
                    engine.graph_runner.replay(batch)
                e.record()
                torch.cuda.synchronize()
                replay_ms = s.elapsed_time(e) / n
            # (2) a full step as a caller drives it: batch fields, metadata, forward_batch, wait
            times = []
            for _ in range(steps):
                torch.cuda.synchronize()
                t = time.perf_counter()
                batch = Batch(reqs=reqs, phase="decode")
                engine.graph_runner.pad_batch(batch)
                fill_batch(engine, batch)
                engine.attn_backend.prepare_metadata(batch)
                out = engine.forward_batch(batch, engine.sampler.prepare(batch))
                out.copy_done_event.synchronize()
                times.append(time.perf_counter() - t)
                for i, r in enumerate(reqs):
                    r.append_host(out.next_tokens_cpu[i : i + 1])
            times.sort()
            step_ms = times[len(times) // 2] * 1e3
            # (3) eager forward (no graph) for contrast, few iterations
            batch = Batch(reqs=reqs, phase="decode")
            batch.padded_reqs = list(reqs)
            fill_batch(engine, batch)
            engine.attn_backend.prepare_metadata(batch)
            with torch.inference_mode(), engine.ctx.forward_batch(batch):
                engine.model.forward()
                torch.cuda.synchronize()
                t = time.perf_counter()
                for _ in range(3):
                    engine.model.forward()
                torch.cuda.synchronize()
                eager_ms = (time.perf_counter() - t) / 3 * 1e3
            # (4) the attention kernel alone, one layer
            attn_us = time_attention_kernel(engine, batch)
            floor_ms = (weight_bytes + bs * ctx_len * kv_per_token) / bw * 1e3
            row = dict(backend=backend, bs=bs, ctx=ctx_len, weight_gb=weight_bytes / 1e9, replay_ms=replay_ms, step_ms=step_ms, eager_ms=eager_ms,
                       attn_layer_us=attn_us, roofline_ms=floor_ms, copy_bw_gbs=bw / 1e9,
                       tok_s=bs / step_ms * 1e3)  # fmt: skip
            RESULTS["timing"].append(row)
            log(f"  bs {bs:>3}: graph replay {replay_ms:.3f} ms | full step {step_ms:.3f} ms | eager {eager_ms:.1f} ms"
                f" | attention/layer {attn_us:.1f} us | roofline {floor_ms:.2f} ms ({replay_ms / floor_ms:.2f}x)")  # fmt: skip
        if max_bs > MIXED_TIMING_DECODE:
            time_mixed_step(engine, ctx_len, gen)
    finally:
        engine.shutdown()


MIXED_TIMING_DECODE, MIXED_TIMING_CHUNK = 64, 512


def time_mixed_step(engine: Any, ctx_len: int, gen: torch.Generator) -> None:
    """A mixed step as the scheduler drives it (64 decode rows at context ctx_len + one new
    512-token prompt): median wall time of the full step, graph replay vs eager."""
    dec = [
        Req(input_ids=torch.randint(0, 10000, (ctx_len,), generator=gen, dtype=torch.int32), table_idx=i,
            cached_len=ctx_len - 1, output_len=64, uid=i, sampling_params=SamplingParams(ignore_eos=True), cache_handle=None)
        for i in range(MIXED_TIMING_DECODE)
    ]  # fmt: skip
    new = Req(input_ids=torch.randint(0, 10000, (MIXED_TIMING_CHUNK,), generator=gen, dtype=torch.int32),
              table_idx=MIXED_TIMING_DECODE, cached_len=0, output_len=64, uid=MIXED_TIMING_DECODE,
              sampling_params=SamplingParams(ignore_eos=True), cache_handle=None)  # fmt: skip
    runner, row = engine.graph_runner, {}
    mixed = runner.mixed
    for mode in ("graph", "eager"):
        runner.mixed = mixed if mode == "graph" else None
        times = []
        for _ in range(15):
            for r in dec:
                r.cached_len, r.device_len = ctx_len - 1, ctx_len
            new.cached_len, new.device_len = 0, MIXED_TIMING_CHUNK
            torch.cuda.synchronize()
            t = time.perf_counter()
            batch = Batch(reqs=dec + [new], phase="prefill")
            batch.num_decode_rows = len(dec)
            runner.pad_batch(batch)
            fill_batch(engine, batch)
            engine.attn_backend.prepare_metadata(batch)
            assert runner.can_use_cuda_graph(batch) == (mode == "graph")
            out = engine.forward_batch(batch, engine.sampler.prepare(batch))
            out.copy_done_event.synchronize()
            times.append(time.perf_counter() - t)
        times.sort()
        row[f"{mode}_step_ms"] = times[len(times) // 2] * 1e3
    runner.mixed = mixed
    RESULTS["timing"].append(dict(case="mixed step", decode_rows=len(dec), chunk=MIXED_TIMING_CHUNK, ctx=ctx_len, **row))
    log(f"  mixed step ({len(dec)} decode rows at ctx {ctx_len} + a {MIXED_TIMING_CHUNK}-token prompt): full step "
        f"graph {row['graph_step_ms']:.3f} ms | eager {row['eager_step_ms']:.3f} ms")  # fmt: skip


def time_attention_kernel(engine: Any, batch: Batch) -> float:
    mc = engine.config.model_config
    bs = batch.padded_size
    q = torch.randn(bs, mc.num_qo_heads, mc.head_dim, dtype=torch.bfloat16, device=engine.device)
    k = torch.randn(bs, mc.num_kv_heads, mc.head_dim, dtype=torch.bfloat16, device=engine.device)
    bk = engine.attn_backend
    with torch.inference_mode():
        for _ in range(3):
            bk.forward(q, k, k, 0, batch)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()  # time the kernels, not the Python launches
        with torch.cuda.graph(g):
            for _ in range(20):
                bk.forward(q, k, k, 0, batch)
        g.replay()
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(5):
            g.replay()
        e.record()
        torch.cuda.synchronize()
    return s.elapsed_time(e) / 100 * 1e3


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":
        from minisgl.kernel.interpreter import patch_interpreter

        patch_interpreter()
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", default="kernels,engine,timing")
    ap.add_argument("--backends", default="auto", help="comma list of GPU backends to check; auto = importable ones")
    ap.add_argument("--timing-backends", default="triton")
    ap.add_argument("--bs", default="1,64,256")
    ap.add_argument("--ctx", type=int, default=600)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="small sizes (for Triton's interpreter on CPU)")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    backends = gpu_backends(device) if args.backends == "auto" else args.backends.split(",")
    log(f"device {device} ({torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}), torch {torch.__version__}, "
        f"backends under test: {backends}")  # fmt: skip
    RESULTS["env"] = dict(device=str(device), torch=torch.__version__, backends=backends, argv=sys.argv)
    parts = args.parts.split(",")
    t0 = time.perf_counter()
    if "kernels" in parts:
        part_kernels(device, backends, args.quick)
    if "engine" in parts:
        part_engine(device, backends, args.quick)
    if "timing" in parts and device.type == "cuda":
        for b in args.timing_backends.split(","):
            try:
                part_timing(device, b, [int(x) for x in args.bs.split(",")], args.ctx, args.steps)
            except Exception as e:
                RESULTS["errors"].append(f"timing {b}: {e!r}")
                log(f"  [FAIL] timing {b}: {e!r}")
                traceback.print_exc()
    RESULTS["seconds"] = time.perf_counter() - t0
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
            json.dump(RESULTS, f, indent=1, default=str)
    log("== summary")
    for r in RESULTS["timing"]:
        if r.get("case") == "mixed step":
            log(f"  mixed step: graph {r['graph_step_ms']:.3f} ms, eager {r['eager_step_ms']:.3f} ms")
            continue
        log(f"  {r['backend']:<10} bs {r['bs']:>3} ctx {r['ctx']}: replay {r['replay_ms']:.3f} ms, step {r['step_ms']:.3f} ms, "
            f"roofline {r['roofline_ms']:.2f} ms, attention {r['attn_layer_us']:.1f} us/layer")  # fmt: skip
    n_ok = sum(1 for r in RESULTS["kernels"] if r.get("ok"))
    log(f"  kernels: {n_ok}/{len(RESULTS['kernels'])} ok; engine rows: {len(RESULTS['engine'])}; errors: {len(RESULTS['errors'])}")
    for e in RESULTS["errors"]:
        log(f"  ERROR {e}")
    log(f"  total {RESULTS['seconds']:.0f}s")
    return 1 if RESULTS["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
