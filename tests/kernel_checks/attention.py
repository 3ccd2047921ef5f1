"""Checks of the paged attention backends and of an Engine over them, shared by the GPU tests
(tests/test_attention_cuda.py, MINISGL_TEST_DEVICE=cuda) and Triton's interpreter on the CPU
(tests/test_triton_attention_interpret.py runs `TRITON_INTERPRET=1 python -m kernel_checks.attention`).

kernels: each GPU backend against the torch backend on random paged inputs (decode with contexts up
         to 9k, split-K, extend over a cached prefix, mixed decode rows + chunks, page_size 1 and 16,
         GQA and MHA, bf16 and fp32; every element written, no NaN); on CUDA also graph replay ==
         eager for decode and for mixed steps, bit for bit.
engine:  an Engine on a tiny random Qwen3 (head_dim 128): greedy tokens with CUDA graphs == eager ==
         HF generate (float32), page_size 1 and 16, a batch that shrinks (several graph sizes replay
         with padding), and mixed batches (requests arrive one at a time, prompts in chunks).
tiles, fp8 (interpreter only): the extend kernel's long-chunk tile and both block orders, and the
         fp8_e4m3 pool through the store, decode (every fp8 kernel) and extend kernels, against torch
         references. The interpreter's bf16 tl.dot is broken: every interpreter case is float32.
"""

from __future__ import annotations

import math
import os
import sys
import tempfile
from dataclasses import dataclass
from typing import Any, Dict, List, Tuple

import torch

from minisgl.attention import ATTN_BACKENDS
from minisgl.core import Batch, Context, Req, SamplingParams, clear_global_ctx, set_global_ctx
from minisgl.kvcache.pool import KVCachePool
from minisgl.layers.rotary import RotaryConfig
from minisgl.models.config import ModelConfig


def gpu_backends(device: torch.device) -> List[str]:
    """The GPU backends importable here: triton, and flashinfer on CUDA."""
    import importlib.util

    names = ["triton"] if importlib.util.find_spec("triton") is not None else []
    if device.type == "cuda" and importlib.util.find_spec("flashinfer") is not None:
        names.append("flashinfer")
    return names


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


def attention_config(Hq: int, Hk: int, D: int) -> ModelConfig:
    """The ModelConfig a backend reads: heads and head size (plain causal attention), the rest
    placeholders."""
    return ModelConfig(
        architecture="LlamaForCausalLM", model_type="llama", num_layers=1, num_qo_heads=Hq, num_kv_heads=Hk,
        head_dim=D, hidden_size=Hq * D, intermediate_size=1, vocab_size=1, rms_norm_eps=1e-6, hidden_act="silu",
        tie_word_embeddings=False, attention_bias=False, rotary_config=RotaryConfig(D, D, 1, 10000.0),
    )  # fmt: skip


def _make_backends(
    names: List[str], slots_total: int, Hq: int, Hk: int, D: int, page_size: int, dtype: torch.dtype,
    device: torch.device, table: torch.Tensor, kv_values: Tuple[torch.Tensor, torch.Tensor],
) -> Dict[str, Any]:  # fmt: skip
    cfg = attention_config(Hq, Hk, D)
    out = {}
    for name, dt in [(n, dtype) for n in names] + [("ref", torch.float32)]:
        ctx = Context(page_size)
        ctx.kv_cache = KVCachePool(1, slots_total + page_size, Hk, D, device, dt)
        ctx.kv_cache.buffer[0, 0].copy_(kv_values[0])
        ctx.kv_cache.buffer[1, 0].copy_(kv_values[1])
        ctx.page_table = table
        set_global_ctx(ctx)
        try:
            out[name] = ATTN_BACKENDS.get("torch" if name == "ref" else name)(cfg)
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
        dt_name = str(dtype).replace("torch.", "")
        print(f"  [{'ok' if ok else 'FAIL'}] {name:<34} {bname:<10} {dt_name:<8} ps={page_size:<2} "
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
    print(f"  [ok] graph replay == eager (decode attention, bs 4/8 padded, ctx <= 6000)  {backend}: max abs diff {worst}")


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
    print(f"  [ok] graph replay == eager (mixed attention, T<=512, <=12 decode rows + <=4 chunks)  triton: max abs diff {worst}")


@dataclass
class AttentionCase:
    name: str
    Hq: int
    Hk: int
    D: int
    page_size: int
    spec: List[Tuple[int, int]]  # (cached_len, extend_len) per request
    dtype: torch.dtype
    seed: int

    @property
    def id(self) -> str:
        return f"{self.name} ps={self.page_size}".replace(" ", "_")


def attention_cases(device: torch.device, quick: bool) -> List[AttentionCase]:
    """The kernel cases: real sizes on CUDA; small ones (--quick) and float32 in the interpreter."""
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
    return [AttentionCase(n, a, b, c, d, spec, dt, seed=1000 + i) for i, (n, a, b, c, d, spec, dt) in enumerate(cases)]


def run_case(case: AttentionCase, backends: List[str], device: torch.device) -> None:
    check_attention_case(case.name, backends, case.Hq, case.Hk, case.D, case.page_size, case.spec, case.dtype, device,
                         seed=case.seed, num_decode=4 if case.name.startswith("mixed") else 0)  # fmt: skip


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
    info: Dict[str, Any] = dict(backend=engine.config.attention_backend, graph_sizes=list(engine.graph_runner.batch_sizes))
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
        running: List[Req] = [] if mixed else list(reqs)
        chunking: List[Req] = []
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

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()  # type: ignore[arg-type]
    outs = []
    with torch.no_grad():
        for p, n in zip(prompts, n_new):
            ids = torch.tensor([p], device=device)
            g = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
            outs.append(g[0, len(p) :].tolist())
    del model
    return outs


# (backend, page_size, graphs, dtype, mixed) per engine run; graphs == eager pairs that must agree
Variant = Tuple[str, int, bool, torch.dtype, bool]


def variant_key(v: Variant) -> str:
    b, ps, graphs, dt, mixed = v
    return f"{b} ps={ps} {'graphs' if graphs else 'eager'} {str(dt).replace('torch.', '')}{' mixed' if mixed else ''}"


def engine_variants(device: torch.device, backends: List[str]) -> List[Variant]:
    f32, bf16 = torch.float32, torch.bfloat16
    variants: List[Variant] = [("torch", 1, False, f32, False)]
    for b in backends:
        if device.type != "cuda":
            variants += [(b, 1, False, f32, False), (b, 16, False, f32, False)]
            variants += [(b, 1, False, f32, True)] if b == "triton" else []
        elif b == "flashinfer":  # no float32 kernels: bf16 only
            variants += [(b, 1, True, bf16, False), (b, 1, False, bf16, False), (b, 16, True, bf16, False)]
        else:
            variants += [(b, 1, False, f32, False), (b, 1, True, f32, False), (b, 16, True, f32, False),
                         (b, 1, True, bf16, False), (b, 1, False, bf16, False)]  # fmt: skip
            # mixed batches (decode rows + prompt chunks): CUDA graphs of prefill steps vs eager
            variants += [(b, 1, True, f32, True), (b, 1, False, f32, True), (b, 16, True, f32, True),
                         (b, 1, True, bf16, True), (b, 1, False, bf16, True)]  # fmt: skip
    return variants


# graph replay must give the eager tokens exactly (float32 and bf16, decode and mixed steps)
GRAPHS_EQUAL_EAGER = [
    ("triton ps=1 graphs float32", "triton ps=1 eager float32"),
    ("triton ps=1 graphs bfloat16", "triton ps=1 eager bfloat16"),
    ("triton ps=1 graphs float32 mixed", "triton ps=1 eager float32 mixed"),
    ("triton ps=1 graphs bfloat16 mixed", "triton ps=1 eager bfloat16 mixed"),
]


def engine_prompts(quick: bool) -> Tuple[List[List[int]], List[int]]:
    gen = torch.Generator().manual_seed(11)
    lens = [7, 45, 130, 260, 400] if not quick else [5, 9, 70]
    n_new = [24, 10, 17, 24, 5] if not quick else [6, 3, 5]
    return [torch.randint(1, 512, (n,), generator=gen).tolist() for n in lens], n_new


def check_extend_tiles() -> None:
    """The extend kernel's long-chunk tile (128 query rows) and both block orders, against a torch
    reference (causal over a cached prefix, scattered slots, NaN-poisoned output). Interpreter."""
    import torch

    from minisgl.kernel.interpreter import patch_interpreter

    patch_interpreter()
    from minisgl.kernel.triton_attention import extend_attention

    torch.manual_seed(0)
    Hq, Hk, D, slots = 4, 2, 64, 2048
    k, v = torch.randn(slots, Hk, D), torch.randn(slots, Hk, D)
    spec = [(200, 300), (0, 130), (37, 5)]  # (cached, new) per request
    pt = torch.zeros(len(spec), 1024, dtype=torch.int32)
    perm = torch.randperm(slots)
    q_start, pos = [], 0
    for i, (c, n) in enumerate(spec):
        pt[i, : c + n] = perm[i * 600 : i * 600 + c + n]
        q_start.append(pos)
        pos += n
    q = torch.randn(pos, Hq, D)
    ref = torch.empty_like(q)
    for i, (c, n) in enumerate(spec):
        keys = pt[i, : c + n].long()
        kk, vv = k[keys].repeat_interleave(Hq // Hk, 1), v[keys].repeat_interleave(Hq // Hk, 1)
        s = torch.einsum("qhd,khd->hqk", q[q_start[i] : q_start[i] + n], kk) / D**0.5
        s = s.masked_fill(torch.arange(c + n)[None, None, :] > (c + torch.arange(n))[None, :, None], float("-inf"))
        ref[q_start[i] : q_start[i] + n] = torch.einsum("hqk,khd->qhd", s.softmax(-1), vv)
    meta = [torch.tensor(x, dtype=torch.int64) for x in (list(range(len(spec))), q_start, [c for c, _ in spec], [n for _, n in spec])]
    for cfg in ((128, 64, 4, 3), (64, 64, 4, 3)):
        for heavy in (True, False):
            out = torch.full_like(q, float("nan"))
            rows, q_starts, cached, new = meta
            extend_attention(q, k, v, pt, rows, q_starts, cached, new, max(n for _, n in spec), out, D**-0.5, config=cfg, heavy_first=heavy)
            err = ((out - ref).abs().max() / ref.abs().max()).item()
            assert err < 1e-5, (cfg, heavy, err)
    print("tiles ok")


def check_fp8_kernels() -> None:
    """The fp8_e4m3 pool through the triton kernels: stored bytes == the pool's reference store,
    decode (every fp8 kernel, split and direct) and extend over fp8 keys/values against a float32
    reference. Interpreter: the CUDA-core kernel's int32 words are widened from their bits."""
    import torch

    from minisgl.kernel.interpreter import patch_interpreter

    patch_interpreter()
    from minisgl.kernel.triton_attention import decode_attention, extend_attention, store_kv
    from minisgl.kvcache.pool import KVCachePool

    torch.manual_seed(0)
    Hq, Hk, D, slots = 4, 2, 64, 1024
    fp8 = torch.float8_e4m3fn

    # the store kernel writes the pool's reference bytes (saturation, subnormals, round to nearest)
    for dt in (torch.float32, torch.bfloat16):
        k = (torch.randn(40, Hk, D) * 60).to(dt)
        k.view(-1)[:4] = torch.tensor([1000.0, -1000.0, float("inf"), 3e-3])
        v = (torch.randn(40, Hk, D) * 0.01).to(dt)
        loc = torch.randperm(slots)[:40]
        ref = KVCachePool(1, slots, Hk, D, torch.device("cpu"), dt, kv_cache_dtype="fp8_e4m3")
        ref.store_kv(k, v, loc, 0)
        kc, vc = torch.zeros(slots, Hk, D, dtype=fp8), torch.zeros(slots, Hk, D, dtype=fp8)
        store_kv(kc, vc, k, v, loc)
        assert torch.equal(kc.view(torch.uint8), ref.k_cache(0).view(torch.uint8)), dt
        assert torch.equal(vc.view(torch.uint8), ref.v_cache(0).view(torch.uint8)), dt

    # attention over an fp8 pool == attention over its values widened (decode: bf16 q, fp16 dots;
    # extend: float32), against a float32 reference
    k8 = (torch.randn(slots, Hk, D) * 2).to(fp8)
    v8 = torch.randn(slots, Hk, D).to(fp8)
    lens = [37, 130, 5]
    pt = torch.zeros(len(lens), 256, dtype=torch.int32)
    perm = torch.randperm(slots)
    for i, n in enumerate(lens):
        pt[i, :n] = perm[i * 300 : i * 300 + n]

    def reference(q, i, n, first):  # queries of request i at positions first.. attend causally
        kk = k8[pt[i, :n].long()].float().repeat_interleave(Hq // Hk, 1)
        vv = v8[pt[i, :n].long()].float().repeat_interleave(Hq // Hk, 1)
        s = torch.einsum("qhd,khd->hqk", q.float(), kk) / D**0.5
        s = s.masked_fill(torch.arange(n)[None, None, :] > (first + torch.arange(q.shape[0]))[None, :, None], float("-inf"))
        return torch.einsum("hqk,khd->qhd", s.softmax(-1), vv)

    import minisgl.kernel.triton_attention as TA

    # every e4m3 magnitude class: subnormals, the largest finite (+-448), zeros of both signs
    k8.view(-1)[:6] = torch.tensor([2.0**-9, -(2.0**-7), 448.0, -448.0, 0.0, -0.0]).to(fp8)
    q = torch.randn(len(lens), Hq, D).to(torch.bfloat16)
    want = torch.stack([reference(q[i : i + 1], i, n, n - 1)[0] for i, n in enumerate(lens)])
    # the tensor-core kernel (fp16 dots over fp8 bytes) and the CUDA-core kernel (1 to 4 keys per
    # thread per tile; its int32 words are widened from their bits here), direct and split
    for mode, tile, warps in (("dot", 32, 4), ("cc", 32, 4), ("cc", 64, 2), ("cc", 128, 4)):
        TA.FP8_DECODE, TA.CC_TILE = mode, (tile, warps)
        assert TA.use_cc_decode(q.dtype, fp8, Hq // Hk, D) == (mode == "cc")
        for S in (1, 4):
            out = torch.full_like(q, float("nan"))
            splits = torch.tensor([min(S, -(-n // 16)) for n in lens])
            mid_o, mid_lse = torch.full((len(lens), Hq, S, D), float("nan")), torch.full((len(lens), Hq, S), float("nan"))
            decode_attention(
                q,
                k8,
                v8,
                pt,
                torch.arange(len(lens)),
                torch.tensor(lens),
                splits,
                mid_o,
                mid_lse,
                out,
                D**-0.5,
                block_n=tile,
                num_warps=warps,
                num_stages=2,
            )
            err = ((out.float() - want).abs().max() / want.abs().max()).item()
            assert err < 8e-3, (mode, tile, S, err)  # the bf16 output's rounding
    TA.FP8_DECODE, TA.CC_TILE = "auto", (64, 4)
    spec = [(30, 7), (0, 130)]  # (cached, new)
    qe = torch.randn(sum(n for _, n in spec), Hq, D)
    meta = [torch.tensor(x) for x in ([0, 1], [0, 7], [c for c, _ in spec], [n for _, n in spec])]
    out = torch.full_like(qe, float("nan"))
    rows, q_starts, cached, new = meta
    extend_attention(qe, k8, v8, pt, rows, q_starts, cached, new, 130, out, D**-0.5)
    refe = torch.cat([reference(qe[:7], 0, 37, 30), reference(qe[7:], 1, 130, 0)])
    err = ((out - refe).abs().max() / refe.abs().max()).item()
    assert err < 1e-5, err
    print("fp8 ok")


def main(groups: List[str]) -> int:
    """Interpreter run of the groups (kernels, engine, tiles, fp8); prints what the CPU test greps."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "run under TRITON_INTERPRET=1"
    from minisgl.kernel.interpreter import patch_interpreter

    patch_interpreter()
    device = torch.device("cpu")
    backends = gpu_backends(device)
    errors: List[str] = []
    if "kernels" in groups:
        cases = attention_cases(device, quick=True)
        ok = 0
        for case in cases:
            try:
                run_case(case, backends, device)
                ok += 1
            except Exception as e:  # keep going: report every case
                errors.append(f"kernels {case.id}: {e!r}")
        print(f"kernels: {ok}/{len(cases)} ok")
    if "engine" in groups:
        prompts, n_new = engine_prompts(quick=True)
        with tempfile.TemporaryDirectory() as d:
            build_tiny_qwen3(d)
            hf = hf_generate(d, device, prompts, n_new)
            for v in engine_variants(device, backends):
                b, ps, graphs, dt, mixed = v
                outs, info = run_engine(d, device, b, ps, graphs, dt, prompts, n_new, mixed=mixed)
                print(f"  {variant_key(v):<32} == HF fp32: {outs == hf} {info}")
                if outs != hf:
                    errors.append(f"engine {variant_key(v)}: differs from HF generate")
    if "tiles" in groups:
        check_extend_tiles()
    if "fp8" in groups:
        check_fp8_kernels()
    for err in errors:
        print(f"ERROR {err}")
    print(f"errors: {len(errors)}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
