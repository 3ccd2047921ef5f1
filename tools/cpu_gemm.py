"""bf16 GEMM micro-benchmark on the CPU: the C AMX kernel (kernel/cpu/amx.c) against oneDNN
(`F.linear`) on the embedded SmolLM2-135M's GEMM shapes, in one process, interleaved.

    taskset -c 1 python tools/cpu_gemm.py --threads 1 --rows 500,64
    python tools/cpu_gemm.py --threads 2 --rows 500,64 --kernel old=/tmp/amx_old.c

y = x W^T with W [N, K] row-major bf16 (the module's own weight). Each figure is the min over
--reps interleaved rounds of one call (weights warm, as within a layer at prefill sizes), and a
"model" row: all 30 layers' 4 GEMMs in order on distinct weights (cold, as in one forward).
`--kernel name=path.c` adds another amx.c build (compiled with the runner's flags) for A/B in
the same process. Where a kernel declines (amx.c above 640 rows) its column is oneDNN's, as in
QuantLinear. Prints GFLOP/s and the load average at start and end.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import tempfile
import time
from typing import Callable, Dict, List, Tuple

import torch

from minisgl.kernel.cpu import _FLAGS, cpu_kernels

SHAPES: List[Tuple[str, int, int]] = [("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536)]
LAYERS = 30
_P, _L, _I = ctypes.c_void_p, ctypes.c_long, ctypes.c_int

Gemm = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def build(path: str) -> ctypes.CDLL:
    out = os.path.join(tempfile.mkdtemp(), "amx.so")
    subprocess.run(["cc", *_FLAGS, "-o", out, path, "-lm"], check=True)
    return ctypes.CDLL(out)


def c_gemm(lib: ctypes.CDLL, nthreads: int) -> Gemm:
    fn = lib.gemm_amx_bf16
    fn.argtypes, fn.restype = [_P, _L, _L, _P, _L, _L, _P, _P, _I], ctypes.c_int

    def run(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        y = x.new_empty(x.shape[0], w.shape[0])
        ok = fn(x.data_ptr(), x.stride(0), x.shape[0], w.data_ptr(), w.shape[0], w.shape[1], None, y.data_ptr(), nthreads)
        return y if ok else torch.nn.functional.linear(x, w)  # declined: what QuantLinear runs

    return run


def timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="500,64")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--kernel", action="append", default=[], help="name=path/to/amx.c for A/B")
    ap.add_argument("--no-model", action="store_true", help="skip the 30-layer cold row")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kern = cpu_kernels()
    assert kern is not None and kern.has_amx, "no AMX kernel here"
    gemms: Dict[str, Gemm] = {"onednn": lambda x, w: torch.nn.functional.linear(x, w)}
    gemms["amx"] = c_gemm(kern.lib, args.threads)
    for spec in args.kernel:
        name, path = spec.split("=", 1)
        gemms[name] = c_gemm(build(path), args.threads)
    print(f"threads {args.threads}, load average {os.getloadavg()[0]:.2f}")
    torch.manual_seed(0)
    weights = {s: [(torch.randn(n, k) * 0.05).to(torch.bfloat16) for _ in range(LAYERS)] for s, n, k in SHAPES}
    print(f"{'shape':>8} {'M':>5} " + " ".join(f"{g:>12}" for g in gemms) + "   GFLOP/s (min of reps)")
    for m in map(int, args.rows.split(",")):
        xs = {k: torch.randn(m, k).to(torch.bfloat16) for k in {k for _, _, k in SHAPES}}
        for s, n, k in SHAPES:
            w, x = weights[s][0], xs[k]
            ref = x.float() @ w.float().t()
            best = {g: float("inf") for g in gemms}
            for g, f in gemms.items():  # warm up, and check against fp32
                err = (f(x, w).float() - ref).abs().max().item()
                assert err <= ref.abs().max().item() * 2**-6, f"{g} {s}: error {err}"
            for _ in range(args.reps):
                for g, f in gemms.items():
                    best[g] = min(best[g], timed(lambda: f(x, w)))
            flop = 2.0 * m * n * k
            print(f"{s:>8} {m:>5} " + " ".join(f"{flop / best[g] / 1e9:>12.0f}" for g in gemms))
        if args.no_model:
            continue
        best = {g: float("inf") for g in gemms}
        for _ in range(max(2, args.reps // 3)):
            for g, f in gemms.items():

                def forward(f: Gemm = f) -> None:
                    for i in range(LAYERS):
                        for s, _, k in SHAPES:
                            f(xs[k], weights[s][i])

                best[g] = min(best[g], timed(forward))
        flop = 2.0 * m * LAYERS * sum(n * k for _, n, k in SHAPES)
        print(
            f"{'model':>8} {m:>5} "
            + " ".join(f"{flop / best[g] / 1e9:>12.0f}" for g in gemms)
            + "   ("
            + ", ".join(f"{g} {best[g] * 1e3:.1f} ms" for g in gemms)
            + ")"
        )
    print(f"load average at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
