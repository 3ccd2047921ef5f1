"""Latency: single-request TTFT and inter-token latency, and decode step time vs the roofline.

    python benchmark/latency.py                                   # CPU, embedded model
    python benchmark/latency.py --model benchmark/models/qwen3-0.6b --dummy-weights --dtype bfloat16
    (add --quantization int4 / fp8 on CUDA: the same run on online int4 W4A16 / FP8 W8A8 weights)

1. TTFT / ITL at batch 1 through the real scheduler (overlap on, CUDA graphs on CUDA): a prompt of
   --prompt-len random tokens, --gen-len output tokens, EOS ignored.
2. Decode step time at each --batch-sizes with --context tokens of KV per request, measured on the
   Engine directly (graph replay on CUDA), next to the memory roofline:
   (weight bytes + batch * K/V bytes read per request) / measured copy bandwidth; an MoE counts
   the experts a batch is expected to touch, a sliding layer the K/V inside its window.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from typing import Any, Dict, List, Tuple

import torch

from minisgl.core import Batch, Req, SamplingParams
from minisgl.distributed import DistributedInfo
from minisgl.engine import Engine
from minisgl.kvcache.pool import model_kv_bytes_per_slot
from minisgl.scheduler import Scheduler, SchedulerConfig, UserRequest
from minisgl.utils.device import synchronize
from minisgl.utils.hf import cached_load_hf_config, resolve_model_path
from minisgl.utils.torch_utils import auto_dtype, parse_dtype


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Bytes moved per second (read + write counted) by a large device-to-device copy."""
    if device.type != "cuda":
        nbytes = 256 << 20
    src = torch.empty(nbytes // 2, dtype=torch.float16, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    synchronize(device)
    iters = 20 if device.type == "cuda" else 5
    start = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    synchronize(device)
    return 2 * src.numel() * src.element_size() * iters / (time.perf_counter() - start)


def weight_bytes(engine: Engine, batch_size: int) -> float:
    """Bytes of weights a decode step of `batch_size` rows reads: each storage once (a tied LM
    head shares the embedding's), with the scales (and zeros) a quantized linear layer holds
    beside its weight; of an MoE layer's stacked experts only the expected share the rows route
    to, 1 - (1 - top_k / experts)^batch (uniform routing, as random weights give)."""
    cfg = engine.config.model_config
    seen: Dict[int, float] = {}
    for p in engine.model.parameters():
        nbytes = float(p.numel() * p.element_size())
        if cfg.is_moe and p.dim() == 3 and p.shape[0] == cfg.num_experts:
            nbytes *= 1 - (1 - cfg.num_experts_per_tok / cfg.num_experts) ** batch_size
        seen[p.data_ptr()] = nbytes
    for m in engine.model.modules():
        for t in (getattr(m, "weight_scale", None), getattr(m, "weight_zero", None)):
            if isinstance(t, torch.Tensor):
                seen[t.data_ptr()] = float(t.numel() * t.element_size())
    return sum(seen.values())


def kv_bytes_read(engine: Engine, context: int) -> float:
    """Bytes of K/V one request with `context` tokens reads per decode step: the pool's bytes per
    token and layer (a latent pool's compressed rows, fp8's one byte per element) times the tokens
    each layer attends to (a sliding layer only its window)."""
    cfg = engine.config.model_config
    per_layer = model_kv_bytes_per_slot(cfg, engine.config.kv_cache_dtype, engine.config.dtype, 1) / cfg.num_layers
    return per_layer * sum(min(context, cfg.window_of(i) or context) for i in range(cfg.num_layers))


def decode_step_time(engine: Engine, batch_size: int, context: int, iters: int) -> float:
    """Seconds per decode step for `batch_size` requests each holding `context` tokens of KV."""
    batch, args = decode_batch(engine, batch_size, context, iters)
    dev = engine.device
    for _ in range(3):
        engine.forward_batch(batch, args)
    synchronize(dev)
    start = time.perf_counter()
    for _ in range(iters):
        engine.forward_batch(batch, args)  # complete_one advances host counters only
    synchronize(dev)
    return (time.perf_counter() - start) / iters


def decode_batch(engine: Engine, batch_size: int, context: int, iters: int) -> Tuple[Batch, Any]:
    """A prepared decode batch (metadata and sampling args) of `batch_size` requests holding
    `context` tokens each, on their own pool slots while the pool has room."""
    page_table = engine.page_table
    reqs: List[Req] = []
    for row in range(batch_size):
        base = (row * context) % max(1, engine.num_pages * engine.config.page_size - context)
        page_table[row, :context] = torch.arange(base, base + context, dtype=torch.int32)
        req = Req(
            input_ids=torch.zeros(context, dtype=torch.int32),
            table_idx=row,
            cached_len=context - 1,
            output_len=iters + 16,
            uid=row,
            sampling_params=SamplingParams(),
            cache_handle=None,
        )
        reqs.append(req)
    batch = Batch(reqs=reqs, phase="decode")
    engine.graph_runner.pad_batch(batch)
    dev = engine.device
    batch.positions = torch.tensor([r.device_len - 1 for r in batch.padded_reqs], dtype=torch.int32, device=dev)
    batch.input_ids = torch.zeros(batch.padded_size, dtype=torch.int32, device=dev)
    batch.out_loc = page_table[[r.table_idx for r in batch.padded_reqs], batch.positions.long()]
    engine.attn_backend.prepare_metadata(batch)
    return batch, engine.sampler.prepare(batch)


def single_request_latency(sched: Scheduler, prompt_len: int, gen_len: int, vocab: int) -> Dict[str, float]:
    rng = random.Random(0)
    ids = [rng.randrange(min(vocab, 10000)) for _ in range(prompt_len)]
    params = SamplingParams(max_tokens=gen_len, ignore_eos=True)
    sched.add_request(UserRequest(10**9, ids[:8], SamplingParams(max_tokens=4, ignore_eos=True)))  # warm-up
    sched.run_until_idle()
    start = time.perf_counter()
    sched.add_request(UserRequest(10**9 + 1, ids, params))
    stamps: List[float] = []
    while sched.has_work():
        for out in sched.step():
            if out.token_id is not None:
                stamps.append(time.perf_counter())
    ttft = stamps[0] - start
    itl = (stamps[-1] - stamps[0]) / max(1, len(stamps) - 1)
    return {"ttft_ms": ttft * 1e3, "itl_ms": itl * 1e3, "tokens": len(stamps)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF folder, .gguf, or config-only folder with --dummy-weights")
    p.add_argument("--dummy-weights", action="store_true")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--batch-sizes", default="1,64,256")
    p.add_argument("--context", type=int, default=600)
    p.add_argument("--iters", type=int, default=0, help="decode steps timed per batch size (0: auto)")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--gen-len", type=int, default=128)
    p.add_argument("--kv-cache-dtype", default="auto", help="auto | fp8_e4m3 (CUDA) | int8 (CPU): what the KV pool stores")
    p.add_argument("--quantization", default="auto", help="the engine's --quantization: int4 / fp8 on CUDA (online, also with "
                   "--dummy-weights), auto (a 4-bit checkpoint's own codes), none")  # fmt: skip
    p.add_argument("--out", default=None, help="write the JSON summary here")
    a = p.parse_args()

    path = resolve_model_path(a.model)
    device = torch.device("cuda" if a.device == "auto" and torch.cuda.is_available() else ("cpu" if a.device == "auto" else a.device))
    dtype = auto_dtype(cached_load_hf_config(path), device) if a.dtype == "auto" else parse_dtype(a.dtype)
    sizes = [int(x) for x in a.batch_sizes.split(",")]
    on_cuda = device.type == "cuda"
    iters = a.iters or (200 if on_cuda else 5)
    cfg = SchedulerConfig(
        model_path=path,
        tp_info=DistributedInfo(0, 1),
        dtype=dtype,
        device=str(device),
        attention_backend=a.attention_backend,
        use_dummy_weight=a.dummy_weights,
        max_running_req=max(sizes),
        cuda_graph_max_bs=max(sizes),
        max_seq_len_override=max(a.context + iters + 64, a.prompt_len + a.gen_len + 8),
        num_page_override=None if on_cuda else max(sizes) * (a.context + iters + 64) + 4096,
        cpu_kv_cache_bytes=8 << 30,
        kv_cache_dtype=a.kv_cache_dtype,
        quantization=a.quantization,
    )
    sched = Scheduler(cfg)
    engine = sched.engine
    mcfg = engine.config.model_config
    bw = copy_bandwidth(device)
    summary: Dict[str, object] = {
        "device": torch.cuda.get_device_name(device) if on_cuda else "cpu",
        "model": mcfg.architecture,
        "dtype": str(dtype),
        "kv_cache_dtype": a.kv_cache_dtype,
        "quantization": a.quantization,
        "attention_backend": engine.config.attention_backend,
        "cuda_graph_sizes": engine.graph_runner.batch_sizes,
        "copy_bandwidth_GBps": bw / 1e9,
        "weight_GB": weight_bytes(engine, 10**6) / 1e9,
    }
    lat = single_request_latency(sched, a.prompt_len, a.gen_len, mcfg.vocab_size)
    summary["batch1"] = lat
    print(f"batch 1: TTFT {lat['ttft_ms']:.2f} ms (prompt {a.prompt_len}), inter-token {lat['itl_ms']:.3f} ms")
    steps = []
    print(f"{'batch':>6} {'step ms':>9} {'roofline ms':>12} {'ratio':>6} {'tok/s':>10}")
    for bs in sizes:
        t = decode_step_time(engine, bs, a.context, iters)
        floor = (weight_bytes(engine, bs) + bs * kv_bytes_read(engine, a.context)) / bw
        steps.append({"batch": bs, "step_ms": t * 1e3, "roofline_ms": floor * 1e3, "ratio": t / floor})
        print(f"{bs:>6} {t * 1e3:>9.3f} {floor * 1e3:>12.3f} {t / floor:>6.2f} {bs / t:>10.0f}")
    summary["decode_steps"] = steps
    print(json.dumps(summary))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(summary, f, indent=2)
    sched.shutdown()


if __name__ == "__main__":
    main()
