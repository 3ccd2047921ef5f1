"""The int4 W4A16 GEMM (minisgl/kernel/triton_int4.py) against bf16 F.linear, per projection shape.

    python benchmark/int4_gemm.py                       # Qwen3-14B projections, M in 1, 4, 16, 64, 512
    python benchmark/int4_gemm.py --model 0.6B --rows 1,8 --group 64

For each (N, K) and M: microseconds per call of each (CUDA graph replay of 20 calls, so launch
overhead is not measured), the bytes each reads (int4: codes + bf16 scales and zeros; bf16: the
weight) over the time as GB/s, the speedup, and the tile gemm_config picked (split-K). CUDA only.
"""

from __future__ import annotations

import argparse
from typing import Callable

import torch
import torch.nn.functional as F

SHAPES = {
    "0.6B": [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)],
    "14B": [(7168, 5120), (5120, 5120), (34816, 5120), (5120, 17408)],
}


def graph_time_us(fn: Callable[[], torch.Tensor], calls: int = 20, reps: int = 10) -> float:
    """Microseconds per call of `fn`, replayed from a CUDA graph of `calls` calls."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * calls)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="14B", choices=sorted(SHAPES))
    p.add_argument("--rows", default="1,4,16,64,512")
    p.add_argument("--group", type=int, default=128)
    a = p.parse_args()
    from minisgl.kernel.triton_int4 import _sm_count, gemm_config, w4a16_gemm
    from minisgl.layers.int4 import quantize_groups

    dev = torch.device("cuda")
    sms = _sm_count(dev)
    print(f"{torch.cuda.get_device_name(dev)}, {sms} SMs, group {a.group}")
    print(f"{'N':>6} {'K':>6} {'M':>5} {'int4 us':>9} {'bf16 us':>9} {'int4 GB/s':>10} {'bf16 GB/s':>10} {'speedup':>8}  tile")
    for n, k in SHAPES[a.model]:
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        q = quantize_groups(w, a.group).to(dev, torch.bfloat16)
        int4_bytes = q.qweight.numel() * 4 + 2 * q.scale.numel() * 2
        for m in (int(r) for r in a.rows.split(",")):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            t4 = graph_time_us(lambda: w4a16_gemm(x, q.qweight, q.scale, q.zero, q.group))
            t16 = graph_time_us(lambda: F.linear(x, w))
            cfg = gemm_config(m, n, k, a.group, sms)
            print(f"{n:>6} {k:>6} {m:>5} {t4:>9.1f} {t16:>9.1f} {int4_bytes / t4 / 1e3:>10.0f} {n * k * 2 / t16 / 1e3:>10.0f} "
                  f"{t16 / t4:>8.2f}  {tuple(cfg)}")  # fmt: skip


if __name__ == "__main__":
    main()
