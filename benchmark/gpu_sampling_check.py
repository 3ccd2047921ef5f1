"""GPU check and timing of the Gumbel-max sampling kernel (minisgl/kernel/triton_sampling.py).

  PYTHONPATH=. python3 benchmark/gpu_sampling_check.py [--out DIR] [--sweep]
  TRITON_INTERPRET=1 python3 benchmark/gpu_sampling_check.py --quick      # tiny shapes, CPU ok

dist:    bf16 logits at V=151936 whose softmax is known: one launch of many copies of a row, each
         with its own seed; the frequencies of the top tokens (and of the rest, pooled) against
         softmax(logits / T) in float64, bounded by a correct sampler's spread (mean + 6 sd of
         the total variation distance).
greedy:  rows at T = 1e-6 (mixed with sampled rows, with planted ties and -inf rows) equal
         torch.argmax exactly.
seeds:   same seeds, same tokens; a row's draw does not change with the batch around it, the
         launch split or the row stride; a one-finite-entry row always draws that entry.
sampler: Sampler.sample on CUDA takes the kernel for temperature-only batches: seeded rows keep
         their draw when a neighbour asks for top-p; the draw replays inside a CUDA graph.
timing:  B in 1, 64, 256: gumbel_sample (kernel only), the sampler's path (seed generation +
         kernel) and the torch path it replaces (logits.float() + sample_torch: softmax, cumsum,
         searchsorted). "device": median of 50 CUDA-event timings of a graph replay (after
         warm-up), per call: GPU time. "eager": 50 calls issued back to back, per call: what an
         eager caller pays, host launch cost included. --sweep also times every launch split.

Exit status 1 when any check failed or a part raised. --out DIR writes gpu_sampling_check.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import traceback
from typing import Any, Callable, Dict, List

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from minisgl.engine.sample import MIN_T, BatchSamplingArgs, Sampler, sample_torch  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
RESULTS: Dict[str, Any] = {"checks": [], "timings": [], "errors": []}
FAILED: List[str] = []


def log(msg: str) -> None:
    print(msg, flush=True)


def check(name: str, ok: bool, detail: str = "") -> None:
    log(f"{'ok  ' if ok else 'FAIL'} {name:58s} {detail}")
    RESULTS["checks"].append({"name": name, "ok": bool(ok), "detail": detail})
    if not ok:
        FAILED.append(name)


def seeds(n: int) -> torch.Tensor:
    return torch.randint(0, 2**62, (n,), dtype=torch.int64, device=DEV)


def sync() -> None:
    if DEV.type == "cuda":
        torch.cuda.synchronize()


def tv_bound(p: torch.Tensor, n: int) -> tuple[float, float]:
    """Mean and mean + 6 sd of the total variation distance of n correct draws from p (buckets)."""
    pq = p * (1 - p)
    mean = 0.5 * torch.sqrt(2 * pq / (math.pi * n)).sum().item()
    sd = 0.5 * math.sqrt((1 - 2 / math.pi) * pq.sum().item() / n)
    return mean, mean + 6 * sd


# ---- checks --------------------------------------------------------------------------------------


def part_dist(gumbel_sample: Callable, vocab: int, copies: int, launches: int) -> None:
    """A realistic shape: a few strong tokens, then a long tail holding a sizeable share."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(vocab, generator=gen) * 1.5
    strong = torch.randperm(vocab, generator=gen)[:12]
    logits[strong] += torch.linspace(11.0, 6.0, 12)
    logits = logits.to(torch.bfloat16)
    top = 20
    for t in (0.6, 1.0, 1.5):
        p = torch.softmax(logits.double() / t, dim=-1)
        order = p.argsort(descending=True)[:top]
        buckets = torch.cat([p[order], (1 - p[order].sum()).reshape(1)])
        counts = torch.zeros(vocab, dtype=torch.float64)
        rows = logits.to(DEV).expand(copies, vocab)  # stride 0 rows: one row read `copies` times
        temps = torch.full((copies,), t, device=DEV)
        for _ in range(launches):
            counts += torch.bincount(gumbel_sample(rows, temps, seeds(copies)).cpu(), minlength=vocab).double()
        n = copies * launches
        freq = counts / n
        got = torch.cat([freq[order], (1 - freq[order].sum()).reshape(1)])
        tv = 0.5 * (got - buckets).abs().sum().item()
        mean, bound = tv_bound(buckets, n)
        detail = f"TV {tv:.4f} (expected {mean:.4f}, bound {bound:.4f}); tail mass {buckets[-1]:.3f} got {got[-1]:.3f}"
        check(f"dist T={t} V={vocab} top-{top} + tail, {n} draws", tv < bound, detail)


def part_greedy(gumbel_sample: Callable, vocab: int, rows: int) -> None:
    x = torch.randn(rows, vocab, device=DEV).to(torch.bfloat16)
    m = x.float().max().item() + 1
    x[0, [7, vocab // 2, vocab - 1]] = m  # ties across chunks
    x[1, [1029, 700]] = m  # a later lane holding an earlier column
    x[2] = 0.25  # all equal
    x[3] = float("-inf")
    x[3, vocab - 3] = 1.0
    x[4] = float("-inf")  # nothing finite: torch.argmax says 0
    want = torch.argmax(x, dim=-1)
    greedy_t = torch.full((rows,), MIN_T, device=DEV)
    for split in (None, (1, 1), (4, 8)):
        got = gumbel_sample(x, greedy_t, seeds(rows), split=split)
        differ = int((got != want).sum())
        check(f"greedy == torch.argmax, split {split}", torch.equal(got, want), f"{differ} rows differ")
    mixed_t = torch.where(torch.arange(rows, device=DEV) % 2 == 0, MIN_T, 1.0).float()
    got = gumbel_sample(x, mixed_t, seeds(rows))
    check("greedy rows in a mixed batch", torch.equal(got[::2], want[::2]))


def part_seeds(gumbel_sample: Callable, vocab: int, rows: int) -> None:
    wide = torch.randn(rows, vocab + 64, device=DEV).to(torch.bfloat16)
    x = wide[:, 32 : 32 + vocab]  # row stride vocab + 64
    t = torch.rand(rows, device=DEV) + 0.5
    s = seeds(rows)
    ref = gumbel_sample(x.contiguous(), t, s)
    check("same seeds, same tokens", torch.equal(gumbel_sample(x.contiguous(), t, s), ref))
    check("strided rows == contiguous", torch.equal(gumbel_sample(x, t, s), ref))
    for split in ((1, 1), (2, 4), (4, 8)):
        check(f"split {split} gives the same draws", torch.equal(gumbel_sample(x, t, s, split=split), ref))
    pick = torch.randperm(rows, device=DEV)[: rows // 2]
    check("a subset, permuted, gives the same draws", torch.equal(gumbel_sample(x[pick], t[pick], s[pick]), ref[pick]))
    check("one row alone gives the same draw", torch.equal(gumbel_sample(x[5:6], t[5:6], s[5:6]), ref[5:6]))
    differ = int((gumbel_sample(x, t, seeds(rows)) != ref).sum())
    check("other seeds give other draws", differ > rows // 2, f"{differ}/{rows} differ")
    one = torch.full((8, vocab), float("-inf"), device=DEV, dtype=torch.bfloat16)
    cols = torch.randint(0, vocab, (8,), device=DEV)
    one[torch.arange(8, device=DEV), cols] = 0.0
    hits = all(torch.equal(gumbel_sample(one, torch.full((8,), 2.0, device=DEV), seeds(8)), cols) for _ in range(20))
    check("a single finite entry is always drawn", hits)


def part_sampler(vocab: int) -> None:
    sampler = Sampler(DEV, vocab_size=vocab)
    rows = 16
    logits = torch.randn(rows, vocab, device=DEV).to(torch.bfloat16)
    t = torch.rand(rows, device=DEV) + 0.5
    seeded = [(0, 123), (5, 456)]
    plain = sampler.sample(logits, BatchSamplingArgs(temperatures=t, seeded_rows=seeded))
    top_p = torch.ones(rows, device=DEV)
    top_p[3] = 0.9  # a neighbour filters: the batch takes the filtered path
    filt = sampler.sample(logits, BatchSamplingArgs(temperatures=t, top_p=top_p, seeded_rows=seeded))
    check("seeded rows keep their draw when a neighbour filters", torch.equal(plain[[0, 5]], filt[[0, 5]]))
    alone = sampler.sample(logits[5:6], BatchSamplingArgs(temperatures=t[5:6], seeded_rows=[(0, 456)]))
    check("a seeded row alone draws the same", torch.equal(alone, plain[5:6]))
    if DEV.type != "cuda":
        return
    from minisgl.kernel.triton_sampling import gumbel_sample

    s = seeds(rows)
    gumbel_sample(logits, t, s)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gumbel_sample(logits, t, s)
    ok = True
    for _ in range(3):
        logits.copy_(torch.randn(rows, vocab, device=DEV))
        s.copy_(seeds(rows))
        graph.replay()
        ok &= torch.equal(out, gumbel_sample(logits, t, s))
    check("CUDA graph replay == eager, new inputs", ok)
    # the sampler's whole draw, seed generation included, captured: each replay draws anew
    from minisgl.engine.sample import _gumbel_draw

    flat = torch.zeros(rows, vocab, device=DEV)  # uniform rows: draws vary with the seeds
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        drawn = _gumbel_draw(flat, t, None)
    replays = []
    for _ in range(2):
        graph.replay()
        replays.append(drawn.clone())
    fresh = int((replays[0] != replays[1]).sum())
    check("captured sampler draw: fresh seeds each replay", fresh > rows // 2, f"{fresh}/{rows} rows differ")


# ---- timing --------------------------------------------------------------------------------------


def time_us(fn: Callable[[], Any], iters: int, per_graph: int = 10) -> Dict[str, float]:
    """Per call: "device", the median over `iters` replays of a CUDA graph holding `per_graph`
    calls (GPU time without the host's launch cost); "eager", `iters` calls issued back to back
    (what the engine pays, as it samples outside its graphs; host-bound for small work)."""
    fn()  # compile and warm up
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    eager = (time.perf_counter() - t0) * 1e6 / iters
    if DEV.type != "cuda":
        return {"device": float("nan"), "eager": eager}
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(per_graph):
            fn()
    graph.replay()
    sync()
    samples = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / per_graph)
    del graph
    return {"device": statistics.median(samples), "eager": eager}


def part_timing(gumbel_sample: Callable, vocab: int, batches: List[int], iters: int, sweep: bool) -> None:
    from minisgl.engine.sample import _gumbel_draw
    from minisgl.kernel.triton_sampling import TILE, _launch_split

    log("device: CUDA-graph replay (GPU time); eager: calls issued back to back (host launch included)")
    log(f"{'B':>5} {'split':>8} | {'kernel':>7} {'sampler':>8} {'torch':>7} {'speedup':>7} | "
        f"{'kernel':>7} {'sampler':>8} {'torch':>7} {'speedup':>7}   (us; device | eager)")  # fmt: skip
    for b in batches:
        logits = (torch.randn(b, vocab, device=DEV) * 2).to(torch.bfloat16)
        t = torch.full((b,), 0.8, device=DEV)
        s = seeds(b)
        kernel = time_us(lambda: gumbel_sample(logits, t, s), iters)
        path = time_us(lambda: _gumbel_draw(logits, t, None), iters)
        ref = time_us(lambda: sample_torch(logits.float(), t, None, None), iters)
        argmax = time_us(lambda: torch.argmax(logits, dim=-1), iters)  # one read of the logits, no noise
        split = _launch_split(b, -(-vocab // TILE))
        cols = [f"{kernel[k]:7.1f} {path[k]:8.1f} {ref[k]:7.1f} {ref[k] / path[k]:6.2f}x" for k in ("device", "eager")]
        log(f"{b:5d} {str(split):>8} | {cols[0]} | {cols[1]}   torch.argmax {argmax['device']:.1f}")
        RESULTS["timings"].append(
            {"batch": b, "vocab": vocab, "split": split, "kernel_us": kernel, "sampler_us": path, "torch_us": ref,
             "argmax_us": argmax}
        )  # fmt: skip
        if sweep:
            for rows in (1, 2, 4, 8):
                line = []
                for tiles in (1, 2, 4, 8, 16):
                    us = time_us(lambda: gumbel_sample(logits, t, s, split=(rows, tiles)), iters)["device"]
                    line.append(f"{tiles}:{us:6.1f}")
                    RESULTS["timings"].append({"batch": b, "vocab": vocab, "split": (rows, tiles), "kernel_us": us})
                log(f"      sweep rows={rows} tiles:device us  " + "  ".join(line))


# ---- main ----------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes and few draws (CPU interpreter ok)")
    ap.add_argument("--sweep", action="store_true", help="also time every (rows, tiles) launch split")
    ap.add_argument("--out", default=None, help="write gpu_sampling_check.json here")
    args = ap.parse_args()
    if DEV.type != "cuda" and not (INTERPRET and args.quick):
        log("no CUDA device: run on a GPU, or TRITON_INTERPRET=1 with --quick")
        return 2
    from minisgl.kernel.triton_sampling import gumbel_sample

    torch.manual_seed(0)
    vocab = 3000 if args.quick else 151936
    RESULTS["device"] = torch.cuda.get_device_name() if DEV.type == "cuda" else "cpu (triton interpreter)"
    log(f"device: {RESULTS['device']}  vocab {vocab}  bf16 logits")
    parts = [
        ("dist", lambda: part_dist(gumbel_sample, vocab, 64 if args.quick else 4096, 1 if args.quick else 16)),
        ("greedy", lambda: part_greedy(gumbel_sample, vocab, 8 if args.quick else 64)),
        ("seeds", lambda: part_seeds(gumbel_sample, vocab, 8 if args.quick else 256)),
        ("sampler", lambda: part_sampler(vocab)),
        ("timing", lambda: part_timing(gumbel_sample, vocab, [1, 4] if args.quick else [1, 64, 256],
                                       3 if args.quick else 50, args.sweep)),
    ]  # fmt: skip
    for name, fn in parts:
        t0 = time.time()
        try:
            fn()
        except Exception as e:  # report and go on: one broken part must not hide the others
            traceback.print_exc()
            RESULTS["errors"].append(f"{name}: {type(e).__name__}: {e}")
            FAILED.append(name)
        log(f"--- {name} done in {time.time() - t0:.1f}s")
    RESULTS["failed"] = FAILED
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "gpu_sampling_check.json"), "w") as f:
            json.dump(RESULTS, f, indent=1)
    log(f"FAILED: {FAILED}" if FAILED else "all checks passed")
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
