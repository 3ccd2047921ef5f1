"""CPU serving benchmark on the embedded SmolLM2-135M, next to HF transformers from the same run.

    python benchmark/cpu.py                        # bf16, the GGUF's own codes for small batches
    python benchmark/cpu.py --quantization none    # the GGUF dequantized (the default runs its own Q4_1 codes)
    python benchmark/cpu.py --kv-cache-dtype int8  # K/V as int8 codes with per-head scales
    python benchmark/cpu.py --parts latency --plot docs/cpu_batch_scaling.png

Parts (comma-separated --parts, default all but the plot sweep):
- latency: batch-1 decode tok/s and TTFT for a --prompt-len (500) token prompt, through the real
  scheduler; HF `generate` on the same prompt, timed per token by a streamer. Both: min TTFT and
  median inter-token gap over --reps runs (robust to a neighbour's burst on a shared machine);
  llama.cpp when `llama_cpp` imports (llama-cpp-python 0.3.36 builds from source here; its AMX
  code crashes in this VM, so build it with -DGGML_NATIVE=OFF and AVX-512 on, AMX off: see
  docs/PERFORMANCE.md).
- offline: --num-requests (64) prompts of U[100, 300] random token ids, --max-tokens (128) new
  tokens each, EOS ignored, greedy; HF on the first --hf-requests of them in one static batch.
- spec: batch-1 output tok/s with `--speculative-algorithm ngram` off vs on (one process, greedy,
  --gen-len tokens): a chat asking to repeat a passage, and a random-id prompt; with the
  acceptance rate and mean accepted length.
- deterministic: `--deterministic` against the default mode in one process, both on the dense bf16
  weights (the mode refuses quantized GEMMs): one --det-prompt-len (150) token prompt + 8 new
  tokens (wall s), and --det-requests (16) mixed-length prompts (U[20, 300] tokens, 32 new tokens
  each, greedy and seeded T = 0.6 alternating): output tok/s and the mode's ratio to the default
  (each mode's best of --reps runs, the modes alternated).
- sweep: decode tok/s vs batch size (1..64, --sweep-context tokens of context) for minisgl
  (engine decode steps) and HF (generate), plotted to --plot when given.
Also printed: the memory roofline of batch-1 decode (weight bytes read per step / measured
copy bandwidth) and the load average at start and end, which says whether the machine was
quiet (docs/PERFORMANCE.md compares only runs of one process).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import sys
import time
from typing import Any, Dict, List, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from latency import copy_bandwidth, decode_step_time  # noqa: E402

from minisgl.core import SamplingParams  # noqa: E402
from minisgl.engine.cpu_decode import bound_gemms  # noqa: E402
from minisgl.scheduler import UserRequest  # noqa: E402
from minisgl.utils.hf import resolve_model_path  # noqa: E402


def loadavg() -> float:
    return os.getloadavg()[0]


def random_prompts(num: int, lo: int, hi: int, seed: int = 0) -> List[List[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10000) for _ in range(rng.randint(lo, hi))] for _ in range(num)]


def step_weight_bytes(engine: Any) -> Dict[str, int]:
    """Bytes of weights one batch-1 decode step reads: dense (each storage once, the tied LM head
    is the embedding) and, when quantized, with the quantized copies in place of the GEMMs'."""
    seen: Dict[int, int] = {}
    for p in engine.model.parameters():
        seen[p.data_ptr()] = p.numel() * p.element_size()
    dense = sum(seen.values())
    out = {"dense": dense}
    lins = bound_gemms(engine.model)
    if any(lin.quant is not None for lin in lins):
        gemm = {lin.dense.data_ptr() for lin in lins}
        emb = engine.model.model.embed_tokens.weight
        q = sum(v for ptr, v in seen.items() if ptr not in gemm and ptr != emb.data_ptr())  # norms
        q += emb.shape[1] * emb.element_size()  # the lookup reads one row
        for lin in lins:
            q += lin.quant.nbytes if lin.quant is not None else lin.dense.numel() * lin.dense.element_size()
        out["quantized"] = q
    return out


# ---- HF transformers ---------------------------------------------------------------------------
def hf_model(dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(resolve_model_path(None), dtype=dtype).eval()


def _median(xs: List[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else float("nan")


class _Stamps:
    """A transformers streamer that only records when each new token arrived."""

    def __init__(self) -> None:
        self.times: List[float] = []

    def put(self, value: Any) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def hf_generate(model: Any, prompts: List[List[int]], new_tokens: int, stamps: _Stamps | None = None) -> float:
    """Seconds for one static-batch greedy generate (left padding, EOS ignored)."""
    from transformers import GenerationConfig

    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    cfg = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0, max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens)  # fmt: skip
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg, streamer=stamps)
    assert out.shape[1] - width == new_tokens
    return time.perf_counter() - t0


def llama_cpp_latency(prompt: List[int], gen_len: int, threads: int) -> Dict[str, float] | None:
    try:
        from llama_cpp import Llama  # type: ignore[import-not-found]
    except Exception:  # not installed, or its native library fails to load
        return None
    from minisgl.models.gguf_quant import gguf_source

    llm = Llama(model_path=gguf_source(None), n_ctx=2048, n_threads=threads, verbose=False)
    llm.eval(prompt[:8])  # warm-up: first-call allocations out of the timings
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(prompt)  # the prompt's prefill (TTFT without the first sampling)
    ttft = time.perf_counter() - t0
    # then gen_len greedy tokens, each one decode step (generate() feeds its last sample back)
    made = 0
    t0 = time.perf_counter()
    for _tok in llm.generate(prompt[-1:], temp=0.0, reset=False):
        made += 1
        if made == gen_len:
            break
    return {"ttft_ms": ttft * 1e3, "decode_tok_s": made / (time.perf_counter() - t0)}


# ---- parts ---------------------------------------------------------------------------------------
def make_llm(a: argparse.Namespace, max_running: int, max_seq: int) -> Any:
    from minisgl.llm import LLM

    return LLM(None, dtype=a.dtype, quantization=a.quantization, kv_cache_dtype=a.kv_cache_dtype,
               max_running_req=max_running, max_seq_len_override=max_seq, cpu_kv_cache_bytes=4 << 30)  # fmt: skip


def minisgl_latency(sched: Any, prompt: List[int], gen_len: int, reps: int) -> Dict[str, float]:
    """Through the real scheduler: TTFT (min of `reps` runs, prefix cache reset between them) and
    the median inter-token gap, which intermittent load on a shared machine moves least."""
    sched.add_request(UserRequest(10**9, prompt[:8], SamplingParams(max_tokens=4, ignore_eos=True)))
    sched.run_until_idle()
    ttfts, gaps = [], []
    for rep in range(reps):
        sched.reset_prefix_cache()
        start = time.perf_counter()
        sched.add_request(UserRequest(10**9 + 1 + rep, prompt, SamplingParams(max_tokens=gen_len, ignore_eos=True)))
        stamps: List[float] = []
        while sched.has_work():
            for o in sched.step():
                if o.token_id is not None:
                    stamps.append(time.perf_counter())
        ttfts.append(stamps[0] - start)
        gaps += [b - a for a, b in zip(stamps, stamps[1:])]
    itl = _median(gaps)
    return {"ttft_ms": min(ttfts) * 1e3, "itl_ms": itl * 1e3, "decode_tok_s": 1 / itl}


def hf_latency(hf: Any, prompt: List[int], gen_len: int, reps: int) -> Dict[str, float]:
    hf_generate(hf, [prompt[:16]], 2)  # warm-up
    ttfts, gaps = [], []
    for _ in range(reps):
        st = _Stamps()
        t0 = time.perf_counter()
        hf_generate(hf, [prompt], gen_len, st)
        # put() is called with the prompt first, then once per new token
        ttfts.append(st.times[1] - t0)
        gaps += [b - a for a, b in zip(st.times[1:], st.times[2:])]
    itl = _median(gaps)
    return {"ttft_ms": min(ttfts) * 1e3, "itl_ms": itl * 1e3, "decode_tok_s": 1 / itl}


def part_latency(a: argparse.Namespace, hf: Any, out: Dict[str, Any]) -> None:
    llm = make_llm(a, 4, a.prompt_len + a.gen_len + 64)
    engine = llm.scheduler.engine
    vocab = engine.config.model_config.vocab_size
    bw = copy_bandwidth(engine.device)
    wb = step_weight_bytes(engine)
    roof = {k: bw / v for k, v in wb.items()}
    out["roofline"] = {"copy_GBps": bw / 1e9, "weight_MB": {k: v / 1e6 for k, v in wb.items()}, "tok_s": roof}
    print(f"memory roofline, batch-1 decode: copy {bw / 1e9:.1f} GB/s; "
          + ", ".join(f"{k} {wb[k] / 1e6:.0f} MB/step -> {roof[k]:.0f} tok/s" for k in wb))  # fmt: skip
    rng = random.Random(0)
    prompt = [rng.randrange(min(vocab, 10000)) for _ in range(a.prompt_len)]
    ours = minisgl_latency(llm.scheduler, prompt, a.gen_len, a.reps)
    llm.shutdown()
    out["latency"] = {"minisgl": ours}
    line = f"batch 1, {a.prompt_len}-token prompt: minisgl TTFT {ours['ttft_ms']:.0f} ms, decode {ours['decode_tok_s']:.1f} tok/s"
    if hf is not None:
        h = hf_latency(hf, prompt, a.gen_len, a.reps)
        out["latency"]["hf"] = h
        line += (f" | HF TTFT {h['ttft_ms']:.0f} ms, decode {h['decode_tok_s']:.1f} tok/s"
                 f" | TTFT ratio {ours['ttft_ms'] / h['ttft_ms']:.2f}, decode ratio {ours['decode_tok_s'] / h['decode_tok_s']:.2f}x")  # fmt: skip
    print(line)
    lc = llama_cpp_latency(prompt, a.gen_len, torch.get_num_threads())
    out["latency"]["llama_cpp"] = lc
    if lc is None:
        print("llama.cpp: not importable")
    else:
        print(f"llama.cpp (the same GGUF, Q4_1): TTFT {lc['ttft_ms']:.0f} ms, decode {lc['decode_tok_s']:.1f} tok/s"
              f" | minisgl / llama.cpp: decode {ours['decode_tok_s'] / lc['decode_tok_s']:.2f}x,"
              f" TTFT {ours['ttft_ms'] / lc['ttft_ms']:.2f}")  # fmt: skip


def part_offline(a: argparse.Namespace, hf: Any, out: Dict[str, Any]) -> None:
    prompts = random_prompts(a.num_requests, 100, 300)
    llm = make_llm(a, a.num_requests, 300 + a.max_tokens + 8)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=a.max_tokens)
    llm.generate([prompts[0][:32]], SamplingParams(ignore_eos=True, max_tokens=4))  # warm-up
    llm.scheduler.reset_prefix_cache()
    t0, c0 = time.perf_counter(), time.process_time()
    res = llm.generate(prompts, params)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    llm.shutdown()
    n = sum(r.completion_tokens for r in res)
    assert n == a.num_requests * a.max_tokens
    ours = {"tok_s": n / wall, "wall_s": wall, "cpu_s": cpu, "output_tokens": n}
    out["offline"] = {"minisgl": ours}
    line = f"offline, {a.num_requests} requests x {a.max_tokens} tokens: minisgl {ours['tok_s']:.0f} tok/s ({wall:.1f} s wall, {cpu:.0f} s CPU)"
    if hf is not None and a.hf_requests > 0:
        sub = prompts[: a.hf_requests]
        hf_generate(hf, [sub[0][:16]], 2)
        t = hf_generate(hf, sub, a.max_tokens)
        h = {"tok_s": len(sub) * a.max_tokens / t, "wall_s": t, "requests": len(sub)}
        out["offline"]["hf"] = h
        line += f" | HF static batch of {len(sub)}: {h['tok_s']:.0f} tok/s | ratio {ours['tok_s'] / h['tok_s']:.2f}x"
    print(line)


def _det_run(a: argparse.Namespace, det: bool, prompt: List[int], mixed: List[List[int]], params: List[SamplingParams]) -> Dict[str, float]:
    from minisgl.llm import LLM

    llm = LLM(None, dtype=a.dtype, quantization="none", deterministic=det, max_running_req=a.det_requests,
              max_seq_len_override=400, cpu_kv_cache_bytes=1 << 30)  # fmt: skip
    try:
        llm.generate([prompt[:16]], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
        llm.scheduler.reset_prefix_cache()
        t0 = time.perf_counter()
        llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        one = time.perf_counter() - t0
        llm.scheduler.reset_prefix_cache()
        t0 = time.perf_counter()
        outs = llm.generate(mixed, params)
        wall = time.perf_counter() - t0
    finally:
        llm.shutdown()
    return {"prompt_plus_8_s": one, "mixed_tok_s": sum(r.completion_tokens for r in outs) / wall, "mixed_wall_s": wall}


def part_deterministic(a: argparse.Namespace, hf: Any, out: Dict[str, Any]) -> None:
    prompt = random_prompts(1, a.det_prompt_len, a.det_prompt_len, seed=3)[0]
    mixed = random_prompts(a.det_requests, 20, 300, seed=4)
    params = [SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True) if i % 2 == 0 else
              SamplingParams(temperature=0.6, seed=i, max_tokens=32, ignore_eos=True) for i in range(len(mixed))]  # fmt: skip
    runs: Dict[str, List[Dict[str, float]]] = {"default": [], "deterministic": []}
    for _ in range(a.reps):  # the two modes alternated, so a neighbour's burst hits both alike
        for det in (False, True):
            runs["deterministic" if det else "default"].append(_det_run(a, det, prompt, mixed, params))
    res: Dict[str, Any] = {"runs": runs}
    for mode, rs in runs.items():  # each mode's best run: a neighbour's burst only slows a run down
        res[mode] = {key: (max if key.endswith("tok_s") else min)(r[key] for r in rs) for key in rs[0]}
    res["mixed_ratio"] = res["deterministic"]["mixed_tok_s"] / res["default"]["mixed_tok_s"]
    res["prompt_ratio"] = res["deterministic"]["prompt_plus_8_s"] / res["default"]["prompt_plus_8_s"]
    out["deterministic"] = res
    d, m = res["default"], res["deterministic"]
    print(
        f"deterministic (best of {a.reps}): {a.det_prompt_len}-token prompt + 8: {m['prompt_plus_8_s']:.2f} s (default "
        f"{d['prompt_plus_8_s']:.2f} s: {res['prompt_ratio']:.2f}x); {a.det_requests} mixed requests: {m['mixed_tok_s']:.1f} tok/s "
        f"(default {d['mixed_tok_s']:.1f}): {res['mixed_ratio']:.2f}x"
    )


PASSAGE = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a tin of oil and a "
    "cloth for the great lens. For thirty years he had watched the ships pass the rocks below, and he knew "
    "each captain by the rhythm of their horns. When the storm came in October, the power failed across the "
    "island, but the old lamp still burned, and the fishing boats found their way home one by one."
)


_SPEC_UIDS = itertools.count(3 * 10**9)  # (apart from the LLM's own request ids)


def _decode_timed(sched: Any, prompt: List[int], params: SamplingParams) -> Tuple[List[int], float]:
    """One request stepped on the scheduler: its tokens, and the seconds from its first token to
    its last (output tok/s is decode speed: the prompt's prefill is the same either way)."""
    from minisgl.scheduler import UserRequest

    uid = next(_SPEC_UIDS)
    sched.add_request(UserRequest(uid, list(prompt), params))
    tokens: List[int] = []
    first = last = 0.0
    while sched.has_work():
        for out in sched.step():
            if out.uid == uid and out.token_id is not None:
                last = time.perf_counter()
                first = first or last
                tokens.append(out.token_id)
    return tokens, last - first


def part_spec(a: argparse.Namespace, hf: Any, out: Dict[str, Any]) -> None:
    """Batch-1 output tok/s (first to last token) with n-gram speculation off vs on, one process, one engine (the
    scheduler's speculation toggled, as tests/test_spec_ngram.py does), off and on interleaved
    `--reps` times (a shared machine's load drifts; the medians and the median ratio are
    reported): a copy-heavy chat (repeat a passage) and a random-id prompt; acceptance and mean
    accepted length of the "on" runs."""
    import statistics

    from minisgl.llm import LLM

    llm = LLM(None, dtype=a.dtype, quantization=a.quantization, kv_cache_dtype=a.kv_cache_dtype, max_running_req=4,
              max_seq_len_override=1024, cpu_kv_cache_bytes=1 << 30, speculative_algorithm="ngram")  # fmt: skip
    sched = llm.scheduler
    tok = llm.tokenizer
    chat = tok.apply_chat_template([{"role": "user", "content": f"Repeat this passage word for word:\n\n{PASSAGE}"}],
                                   add_generation_prompt=True, tokenize=False)  # fmt: skip
    prompts = {"copy": [int(t) for t in tok.encode(chat, add_special_tokens=False)], "random": random_prompts(1, 200, 200, seed=3)[0]}
    params = SamplingParams(temperature=0.0, max_tokens=a.gen_len, ignore_eos=True)
    # warm-up at the measured lengths (the first long prefill and decode pay one-time costs)
    llm.generate(list(prompts.values()), SamplingParams(max_tokens=16, ignore_eos=True))
    runs: Dict[str, List[Dict[str, Any]]] = {}
    for _ in range(a.reps):
        for spec in (None, "ngram"):
            sched.speculative = spec
            for name, prompt in prompts.items():
                sched.reset_prefix_cache()
                before = sched.stats()
                tokens, decode_s = _decode_timed(sched, prompt, params)
                s = sched.stats()
                rows, acc = s.spec_verify_rows - before.spec_verify_rows, s.spec_accepted_tokens - before.spec_accepted_tokens
                prop = s.spec_proposed_tokens - before.spec_proposed_tokens
                assert len(tokens) == a.gen_len
                runs.setdefault(f"{name}_{spec or 'off'}", []).append({
                    "tok_s": (len(tokens) - 1) / decode_s, "tokens": tokens, "acceptance": acc / prop if prop else 0.0,
                    "mean_accepted_length": (acc + rows) / rows if rows else 0.0, "verify_rows": rows,
                })  # fmt: skip
    llm.shutdown()
    from minisgl.utils.hf import load_tokenizer

    llm_text = load_tokenizer(resolve_model_path(None)).decode
    out["spec"] = {}
    for name in ("copy", "random"):
        off, on = runs[f"{name}_off"], runs[f"{name}_ngram"]
        if name == "copy":
            print("copy output (off):", repr(llm_text(off[0]["tokens"])))
        same = all(r["tokens"] == off[0]["tokens"] for r in off + on)
        ratio = statistics.median(b["tok_s"] / x["tok_s"] for x, b in zip(off, on))
        off_s, on_s = statistics.median(r["tok_s"] for r in off), statistics.median(r["tok_s"] for r in on)
        out["spec"][name] = {"off_tok_s": off_s, "on_tok_s": on_s, "ratio": ratio, "acceptance": on[-1]["acceptance"],
                             "mean_accepted_length": on[-1]["mean_accepted_length"], "verify_rows": on[-1]["verify_rows"],
                             "same_tokens": same}  # fmt: skip
        print(f"speculation ({name} prompt of {len(prompts[name])} tokens, batch 1, {a.gen_len} tokens, {a.reps} interleaved runs): "
              f"off {off_s:.1f} tok/s, ngram {on_s:.1f} tok/s (median ratio {ratio:.2f}x), acceptance {on[-1]['acceptance']:.2f}, "
              f"mean accepted length {on[-1]['mean_accepted_length']:.2f}, verify rows {on[-1]['verify_rows']}, same tokens: {same}")  # fmt: skip


def part_sweep(a: argparse.Namespace, hf: Any, out: Dict[str, Any]) -> None:
    """Decode tok/s per batch size: ours = batch / (min over 3 runs of the mean of 5 engine decode
    steps); HF = batch / median gap between generated tokens of a 9-token generate (one gap is one
    batched decode step). Min and median keep a neighbour's burst out of the figure."""
    sizes = [int(x) for x in a.sweep_sizes.split(",")]
    ctx = a.sweep_context
    llm = make_llm(a, max(sizes), ctx + 64)
    engine = llm.scheduler.engine
    rows = []
    for bs in sizes:
        t = min(decode_step_time(engine, bs, ctx, 5) for _ in range(3))
        rows.append({"batch": bs, "minisgl_tok_s": bs / t})
    llm.shutdown()
    if hf is not None:
        for row in rows:
            bs = row["batch"]
            st = _Stamps()
            hf_generate(hf, random_prompts(bs, ctx, ctx, seed=bs), 9, st)
            row["hf_tok_s"] = bs / _median([b - t for t, b in zip(st.times[1:], st.times[2:])])
    out["sweep"] = {"context": ctx, "rows": rows, "label": f"minisgl ({a.dtype}, quantization={a.quantization})"}
    for row in rows:
        print(f"batch {row['batch']:>3}: minisgl {row['minisgl_tok_s']:>7.0f} tok/s"
              + (f", HF {row['hf_tok_s']:>6.0f} tok/s" if "hf_tok_s" in row else ""))  # fmt: skip


def plot_sweep(summary: Dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep = summary["sweep"]
    rows = sweep["rows"]
    fig, ax = plt.subplots(figsize=(6, 4))
    bss = [r["batch"] for r in rows]
    ax.plot(bss, [r["minisgl_tok_s"] for r in rows], "o-", label=sweep.get("label", "minisgl"))
    if all("hf_tok_s" in r for r in rows):
        ax.plot(bss, [r["hf_tok_s"] for r in rows], "s--", label=f"HF transformers generate ({summary['dtype']})")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(bss, [str(b) for b in bss])
    ax.set_xlabel("decode batch size")
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"SmolLM2-135M decode, 2-core CPU, context {sweep['context']}\n"
                 f"load average {summary['loadavg_start']:.1f} -> {summary['loadavg_end']:.1f}")  # fmt: skip
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default="latency,offline")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--quantization", default=None, help="auto (default: the GGUF's own codes) | none | gguf | int4 | int8")
    p.add_argument("--kv-cache-dtype", default="auto", help="auto | int8 (per-head scales)")
    p.add_argument("--prompt-len", type=int, default=500)
    p.add_argument("--gen-len", type=int, default=128)
    p.add_argument("--reps", type=int, default=3, help="latency repetitions (min TTFT, median inter-token gap)")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--hf-requests", type=int, default=16, help="offline requests HF runs (one static batch)")
    p.add_argument("--det-prompt-len", type=int, default=150)
    p.add_argument("--det-requests", type=int, default=16)
    p.add_argument("--sweep-sizes", default="1,2,4,8,16,32,64")
    p.add_argument("--sweep-context", type=int, default=200)
    p.add_argument("--no-hf", action="store_true")
    p.add_argument("--plot", default=None, help="plot the sweep to this file")
    p.add_argument("--plot-from", default=None, help="only plot the sweep of this JSON summary")
    p.add_argument("--out", default=None, help="write the JSON summary here")
    a = p.parse_args()
    if a.plot_from:
        with open(a.plot_from) as f:
            plot_sweep(json.load(f), a.plot or "docs/cpu_batch_scaling.png")
        return
    from minisgl.utils.torch_utils import parse_dtype

    dtype = parse_dtype(a.dtype)
    out: Dict[str, Any] = {"loadavg_start": loadavg(), "dtype": a.dtype, "quantization": a.quantization,
                           "kv_cache_dtype": a.kv_cache_dtype, "threads": torch.get_num_threads()}  # fmt: skip
    print(f"load average at start: {out['loadavg_start']:.2f}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    hf = None if a.no_hf else hf_model(dtype)
    for part in a.parts.split(","):
        parts = {"latency": part_latency, "offline": part_offline, "sweep": part_sweep, "spec": part_spec}
        parts["deterministic"] = part_deterministic
        parts[part](a, hf, out)
    out["loadavg_end"] = loadavg()
    print(f"load average at end: {out['loadavg_end']:.2f}")
    print(json.dumps(out))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=2)
    if a.plot and "sweep" in out:
        plot_sweep(out, a.plot)


if __name__ == "__main__":
    main()
