"""Offline throughput: the mini-sglang / nano-vllm recipe, with HF transformers on the same requests.

    python benchmark/offline.py                       # 2-core CPU: embedded SmolLM2-135M, bf16 where fast
    python benchmark/offline.py --num-requests 256 --max-input 1024 --max-output 1024 \\
        --model benchmark/models/qwen3-0.6b --dummy-weights --peer-subset 64      # the full GPU run
    (add --quantization fp8 on CUDA: the same run on per-channel FP8 weights, W8A8 FP8 GEMM;
     --quantization int4: on group-128 int4 weights, the W4A16 GEMM)
    python benchmark/offline.py --model benchmark/models/qwen3-0.6b --dummy-weights --num-requests 1 \
        --max-input 512 --max-output 1024 --temperature 0 --speculative draft --peer none
                                                      # speculation on vs off (one process, one engine)

--speculative ngram|draft runs the timed requests twice on the same LLM: speculation off (the
overlap loop where it would run) and then on, and reports both throughputs, the speed-up and the
acceptance; `draft` takes --speculative-draft-model (default: the model itself, so every draft is
accepted but for rounding: the upper bound of a draft model) and --speculative-num-tokens (4).

The recipe (random.seed(0)): N prompts of randint(100, max_input) token ids, each randint(0, 10000);
then N max_tokens of randint(100, max_output); temperature 0.6, EOS ignored. One warm-up request,
then throughput = total output tokens / wall time of one `LLM.generate` over all N requests.

The peer (--peer hf, the default) runs Hugging Face transformers on the same model, dtype, device
and requests (or the first --peer-subset of them), EOS ignored, same sampling:
  * CUDA: transformers' continuous batching (`init_continuous_batching`, per-request max_new_tokens)
    when the installed version has it, else batched `generate`.
  * CPU (or no continuous batching): batched `generate` with left padding, --peer-batch requests at a
    time; a batch runs to its longest max_tokens, but only each request's own max_tokens count as
    output (the rest is the waste of static batching), so both figures are useful tokens per second.
A config-only model folder (--dummy-weights) has no tokenizer and no weights: we run random weights
(`use_dummy_weight=True`) and HF runs `from_config` random weights; only token ids are used.
Prints both figures, the ratio, and one line of JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from random import randint, seed
from typing import Any, Dict, List, Tuple

import torch


def make_requests(num: int, max_input: int, max_output: int, vocab_size: int) -> Tuple[List[List[int]], List[int]]:
    """The recipe, call for call (prompts first, then max_tokens), so N=256/1024/1024 reproduces
    the published workload (133,966 output tokens)."""
    if max_input < 100 or max_output < 100:
        raise SystemExit("--max-input and --max-output must be >= 100 (the recipe draws lengths from [100, max])")
    top = min(10000, vocab_size - 1)
    seed(0)
    prompts = [[randint(0, top) for _ in range(randint(100, max_input))] for _ in range(num)]
    max_tokens = [randint(100, max_output) for _ in range(num)]
    return prompts, max_tokens


def synchronize(device: str) -> None:
    if device.startswith("cuda") and torch.cuda.is_available():
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------
# minisgl
# ---------------------------------------------------------------------------------------------


def run_minisgl(args: argparse.Namespace, prompts: List[List[int]], max_tokens: List[int]) -> Dict[str, Any]:
    from minisgl.core import SamplingParams
    from minisgl.llm import LLM

    config: Dict[str, Any] = dict(
        page_size=args.page_size,
        max_running_req=args.max_running_requests,
        attention_backend=args.attention_backend,
        use_dummy_weight=args.dummy_weights,
    )
    if args.cuda_graph_max_bs is not None:
        config["cuda_graph_max_bs"] = args.cuda_graph_max_bs
    if args.max_extend_tokens is not None:
        config["max_extend_tokens"] = args.max_extend_tokens
    if args.deterministic:
        config["deterministic"] = True
    if args.disable_mixed_batches:
        config["mixed_batches"] = False
    if args.num_pages is not None:
        config["num_page_override"] = args.num_pages
    if args.kv_cache_dtype != "auto":
        config["kv_cache_dtype"] = args.kv_cache_dtype
    if args.quantization is not None:
        config["quantization"] = args.quantization
    if args.speculative is not None:
        config["speculative_algorithm"] = args.speculative
        config["speculative_num_tokens"] = args.speculative_num_tokens
        if args.speculative == "draft":
            config["speculative_draft_model"] = args.speculative_draft_model or args.model
    longest = max(len(p) + n for p, n in zip(prompts, max_tokens))
    config["max_seq_len_override"] = max(longest, 128)

    t0 = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, device=args.device, **config)
    load_s = time.perf_counter() - t0
    engine = llm.scheduler.engine
    device = str(engine.device)
    info = dict(
        dtype=str(engine.dtype).replace("torch.", ""),
        device=device,
        attention_backend=engine.config.attention_backend,
        kv_cache_dtype=engine.kv_cache.kv_cache_dtype,
        quantization=engine.config.quantization,
        kv_tokens=engine.num_pages * engine.config.page_size,
        overlap=llm.scheduler.overlap,
    )
    params = [SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=n) for n in max_tokens]
    try:
        llm.generate([prompts[0][:100]], SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=16))
        synchronize(device)
        # The warm-up prompt is a prefix of request 0: drop it, so the timed run prefills every token.
        llm.scheduler.reset_prefix_cache()
        if args.speculative is not None:
            info.update(_speculation_off_run(llm, prompts, params, device))
        before = llm.scheduler.stats()
        compiles = _log_triton_compiles() if args.log_compiles else None
        t0, c0 = time.perf_counter(), time.process_time()
        if args.profile:  # host-side profile of the timed run (slows it down; for finding hot spots)
            import cProfile
            import pstats

            prof = cProfile.Profile()
            results = prof.runcall(llm.generate, prompts, params, use_tqdm=False)
            stats = pstats.Stats(prof)
            stats.sort_stats("tottime").print_stats(35)
            stats.sort_stats("cumulative").print_stats(80)
            stats.print_callees("replay|prepare_metadata|_launch")  # where the per-step host time goes
        else:
            results = llm.generate(prompts, params, use_tqdm=False)
        synchronize(device)
        elapsed, cpu_s = time.perf_counter() - t0, time.process_time() - c0
        after = llm.scheduler.stats()
        if compiles is not None:
            print(f"Triton kernels specialised during the timed run: {len(compiles)}")
            for line in compiles:
                print("  " + line)
            info["timed_run_compiles"] = compiles
        repeats = []
        for _ in range(args.repeat - 1):  # the headline stays the first run; repeats show warm-up effects
            llm.scheduler.reset_prefix_cache()  # else the repeat hits the cached prompts and skips prefill
            t1 = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            synchronize(device)
            repeats.append(round(sum(max_tokens) / (time.perf_counter() - t1), 1))
        if repeats:
            print(f"repeated runs in the same process (tok/s): {repeats}")
            info["repeat_tok_s"] = repeats
        if args.trace:  # a second run of the same requests under the profiler (CUDA only)
            llm.scheduler.reset_prefix_cache()
            sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
            from gpu_timeline import format_summary, traced

            t1 = time.perf_counter()
            _, timeline = traced(lambda: llm.generate(prompts, params, use_tqdm=False), args.trace_file)
            timeline["traced_wall_ms"] = round((time.perf_counter() - t1) * 1e3, 1)
            print(format_summary(timeline))
            info["timeline"] = timeline
        # where the time went: steps of each kind, host scheduling time, time blocked on the device
        info.update(
            prefill_steps=after.prefill_steps - before.prefill_steps,
            decode_steps=after.decode_steps - before.decode_steps,
            host_s=round(after.host_s - before.host_s, 3),
            wait_s=round(after.wait_s - before.wait_s, 3),
        )
        if args.speculative is not None:
            proposed = after.spec_proposed_tokens - before.spec_proposed_tokens
            accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
            rows = after.spec_verify_rows - before.spec_verify_rows
            info.update(
                speculative=args.speculative,
                spec_acceptance_rate=round(accepted / proposed, 4) if proposed else None,
                spec_mean_accepted_length=round((accepted + rows) / rows, 3) if rows else None,  # tokens per verify row
            )
    finally:
        llm.shutdown()
    out_tokens = sum(r.completion_tokens for r in results)
    assert out_tokens == sum(max_tokens), f"expected {sum(max_tokens)} output tokens, got {out_tokens}"
    if args.speculative is not None:
        info["spec_speedup"] = round(out_tokens / elapsed / info["spec_off_tok_s"], 3)
        print(
            f"speculative decoding ({args.speculative}): {out_tokens / elapsed:.1f} tok/s on vs {info['spec_off_tok_s']:.1f} off "
            f"= {info['spec_speedup']:.2f}x; acceptance {info['spec_acceptance_rate']}, "
            f"mean accepted length {info['spec_mean_accepted_length']} (tokens per verify row)"
        )
    return dict(info, load_s=load_s, time_s=elapsed, cpu_s=cpu_s, output_tokens=out_tokens, tok_s=out_tokens / elapsed)


def _speculation_off_run(llm: Any, prompts: List[List[int]], params: List[Any], device: str) -> Dict[str, Any]:
    """The timed requests with speculation off on the same LLM (same engine, graphs and pool),
    on the loop a server without speculation runs (overlap on CUDA), after a warm-up of that path;
    the speculative run follows."""
    from minisgl.core import SamplingParams

    sched = llm.scheduler
    algorithm, overlap = sched.speculative, sched.overlap
    sched.speculative = None
    sched.overlap = sched.config.overlap and sched.device.type != "cpu"
    try:
        llm.generate([prompts[0][:100]], SamplingParams(temperature=params[0].temperature, ignore_eos=True, max_tokens=16))
        sched.reset_prefix_cache()
        t0 = time.perf_counter()
        results = llm.generate(prompts, params, use_tqdm=False)
        synchronize(device)
        elapsed = time.perf_counter() - t0
        sched.reset_prefix_cache()
    finally:
        sched.speculative, sched.overlap = algorithm, overlap
    return dict(spec_off_tok_s=sum(r.completion_tokens for r in results) / elapsed, spec_off_overlap=sched.config.overlap)


def _log_triton_compiles() -> List[str]:
    """Record every Triton kernel specialisation built (or loaded from the disk cache) from now on:
    one in the timed run is a stall the engine's warm-up should have paid."""
    import triton

    seen: List[str] = []

    def hook(*, repr: str, **_: Any) -> None:
        seen.append(repr[:300])
        return None

    triton.knobs.runtime.jit_cache_hook = hook
    return seen


# ---------------------------------------------------------------------------------------------
# HF transformers
# ---------------------------------------------------------------------------------------------


def _hf_model(args: argparse.Namespace, dtype: torch.dtype, device: str) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    from minisgl.utils.hf import resolve_model_path

    path = resolve_model_path(args.model)
    if args.dummy_weights:
        cfg = AutoConfig.from_pretrained(path)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    return model.eval()


def _gen_config(args: argparse.Namespace, max_new: int) -> Any:
    from transformers import GenerationConfig

    return GenerationConfig(
        do_sample=args.temperature > 0,
        temperature=args.temperature if args.temperature > 0 else None,
        top_k=0,
        top_p=1.0,
        eos_token_id=None,
        pad_token_id=0,
        max_new_tokens=max_new,
    )


def _hf_generate_batched(model: Any, args: argparse.Namespace, prompts, max_tokens, device: str) -> Tuple[int, int]:
    """Static batches with left padding; returns (useful output tokens, generated incl. padding rows)."""
    useful = generated = 0
    bs = args.peer_batch or len(prompts)
    for start in range(0, len(prompts), bs):
        chunk, ns = prompts[start : start + bs], max_tokens[start : start + bs]
        width = max(map(len, chunk))
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros(len(chunk), width, dtype=torch.long)
        for i, p in enumerate(chunk):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                generation_config=_gen_config(args, max(ns)),
            )
        new = out.shape[1] - width
        assert new == max(ns), f"HF generated {new} tokens, expected {max(ns)} (EOS must be ignored)"
        useful += sum(ns)
        generated += new * len(chunk)
    return useful, generated


def _hf_continuous(model: Any, args: argparse.Namespace, prompts, max_tokens) -> int:
    manager = model.init_continuous_batching(generation_config=_gen_config(args, max(max_tokens)))
    manager.start()
    try:
        want = {}
        for i, (p, n) in enumerate(zip(prompts, max_tokens)):
            rid = manager.add_request(list(p), request_id=f"r{i}", max_new_tokens=n)
            want[rid] = n
        out = 0
        pending = set(want)
        deadline = time.time() + 3600
        while pending and time.time() < deadline:
            res = manager.get_result(timeout=1.0)
            if res is None:
                if not manager.is_running():
                    raise RuntimeError("HF continuous batching stopped before finishing")
                continue
            if res.is_finished() and res.request_id in pending:
                if res.error:
                    raise RuntimeError(f"HF continuous batching: {res.error}")
                pending.discard(res.request_id)
                out += len(res.generated_tokens)
        if pending:
            raise RuntimeError(f"HF continuous batching: {len(pending)} requests never finished")
        return out
    finally:
        manager.stop(block=True)


def run_hf(args: argparse.Namespace, prompts, max_tokens, dtype: torch.dtype, device: str) -> Dict[str, Any]:
    import transformers

    torch.manual_seed(0)
    t0 = time.perf_counter()
    model = _hf_model(args, dtype, device)
    load_s = time.perf_counter() - t0
    use_cb = device.startswith("cuda") and hasattr(model, "init_continuous_batching") and not args.peer_static
    method = (
        "continuous batching (init_continuous_batching)"
        if use_cb
        else (f"generate, static batches of {args.peer_batch or len(prompts)}, left padding")
    )
    # warm-up: one small request through the same path
    warm = [prompts[0][:100]]
    try:
        if use_cb:
            _hf_continuous(model, args, warm, [16])
        else:
            _hf_generate_batched(model, args, warm, [16], device)
    except Exception as exc:  # continuous batching missing or broken in this version: say so, fall back
        if not use_cb:
            raise
        print(f"[hf] continuous batching failed ({type(exc).__name__}: {exc}); falling back to batched generate")
        use_cb = False
        method = f"generate, static batches of {args.peer_batch or len(prompts)}, left padding (CB failed)"
        _hf_generate_batched(model, args, warm, [16], device)
    synchronize(device)
    t0, c0 = time.perf_counter(), time.process_time()
    if use_cb:
        useful = generated = _hf_continuous(model, args, prompts, max_tokens)
        assert useful == sum(max_tokens), f"HF produced {useful} tokens, expected {sum(max_tokens)}"
    else:
        useful, generated = _hf_generate_batched(model, args, prompts, max_tokens, device)
    synchronize(device)
    elapsed, cpu_s = time.perf_counter() - t0, time.process_time() - c0
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return dict(
        version=transformers.__version__,
        method=method,
        requests=len(prompts),
        load_s=load_s,
        time_s=elapsed,
        cpu_s=cpu_s,
        output_tokens=useful,
        generated_tokens=generated,
        tok_s=useful / elapsed,
    )


# ---------------------------------------------------------------------------------------------


def main(argv: List[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF folder, .gguf file or config dir (default: the embedded SmolLM2-135M)")
    ap.add_argument("--dummy-weights", action="store_true", help="random weights (a config-only folder is enough)")
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--max-input", type=int, default=256)
    ap.add_argument("--max-output", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA and on CPUs with bf16 units, else fp32) | bf16 | fp16 | fp32")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--page-size", type=int, default=1)
    ap.add_argument("--max-running-requests", type=int, default=256)
    ap.add_argument("--cuda-graph-max-bs", type=int, default=None)
    ap.add_argument("--max-extend-tokens", type=int, default=None, help="prefill token budget per step")
    ap.add_argument("--num-pages", type=int, default=None, help="KV pages (default: from free memory)")
    ap.add_argument("--deterministic", action="store_true", help="batch-invariant kernels (see docs/ARCHITECTURE.md)")
    ap.add_argument("--disable-mixed-batches", action="store_true", help="prefill and decode steps alternate")
    ap.add_argument("--kv-cache-dtype", default="auto", help="auto | fp8_e4m3 (CUDA) | int8 (CPU): what the KV pool stores")
    ap.add_argument("--quantization", default=None,
                    help="the engine's --quantization: fp8 (CUDA: per-channel FP8 weights, with --dummy-weights too) | int4 (CUDA: group-128 int4 weights, "
                         "W4A16; CPU: the int4 decode GEMMs) | none | int8 | gguf (CPU)")  # fmt: skip
    ap.add_argument(
        "--speculative",
        choices=["ngram", "draft"],
        default=None,
        help="speculative decoding: time the requests with it off, then on (same LLM), and report the speed-up",
    )
    ap.add_argument("--speculative-draft-model", default=None, help="with --speculative draft: the draft model (default: --model itself)")
    ap.add_argument("--speculative-num-tokens", type=int, default=4, help="with --speculative: drafts per row and step at most")
    ap.add_argument("--peer", choices=["hf", "none"], default="hf")
    ap.add_argument("--peer-subset", type=int, default=None, help="HF runs only the first N requests")
    ap.add_argument("--peer-batch", type=int, default=None, help="static batch size of HF generate (default: all)")
    ap.add_argument("--profile", action="store_true", help="cProfile the timed run and print the top functions")
    ap.add_argument("--log-compiles", action="store_true", help="list Triton kernels compiled during the timed run")
    ap.add_argument("--repeat", type=int, default=1, help="run the timed requests this many times (first is reported)")
    ap.add_argument("--trace", action="store_true", help="CUDA: rerun the requests under torch.profiler and summarise the device timeline")
    ap.add_argument("--trace-file", default=None, help="with --trace: also keep the chrome trace here")
    ap.add_argument("--peer-static", action="store_true", help="HF batched generate even where continuous batching exists")
    args = ap.parse_args(argv)

    from minisgl.utils.hf import cached_load_hf_config

    vocab = int(cached_load_hf_config(args.model).vocab_size)
    prompts, max_tokens = make_requests(args.num_requests, args.max_input, args.max_output, vocab)
    print(
        f"workload: {len(prompts)} requests, prompt tokens {sum(map(len, prompts))} "
        f"(len {min(map(len, prompts))}-{max(map(len, prompts))}), output tokens {sum(max_tokens)} "
        f"(max_tokens {min(max_tokens)}-{max(max_tokens)}), temperature {args.temperature}, EOS ignored"
    )

    # the CPU dev machine is shared: the load average says how much of it this run really had
    load_start = round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None
    ours = run_minisgl(args, prompts, max_tokens)
    print(
        f"minisgl: {ours['output_tokens']} tokens in {ours['time_s']:.2f} s ({ours['cpu_s']:.0f} CPU s) = {ours['tok_s']:.1f} output tok/s "
        f"({ours['dtype']}, {ours['device']}, attention {ours['attention_backend']}, overlap {ours['overlap']})"
    )
    summary: Dict[str, Any] = dict(
        bench="offline",
        model=args.model or "embedded:SmolLM2-135M-Instruct",
        dummy_weights=args.dummy_weights,
        num_requests=args.num_requests,
        max_input=args.max_input,
        max_output=args.max_output,
        torch=torch.__version__,
        threads=torch.get_num_threads(),
        host=platform.processor() or platform.machine(),
        loadavg_start=load_start,
        minisgl=ours,
    )
    if args.peer == "hf":
        n = min(args.peer_subset or len(prompts), len(prompts))
        dtype = getattr(torch, ours["dtype"])
        peer = run_hf(args, prompts[:n], max_tokens[:n], dtype, ours["device"])
        ratio = ours["tok_s"] / peer["tok_s"]
        print(
            f"hf transformers {peer['version']} ({peer['method']}, {n} requests): {peer['output_tokens']} tokens in "
            f"{peer['time_s']:.2f} s ({peer['cpu_s']:.0f} CPU s) = {peer['tok_s']:.1f} output tok/s"
            + (
                f" ({peer['generated_tokens']} generated incl. padding to each batch's longest)"
                if peer["generated_tokens"] != peer["output_tokens"]
                else ""
            )
        )
        print(f"ratio minisgl / hf: {ratio:.2f}x")
        summary.update(hf=peer, ratio=round(ratio, 3))
    summary["loadavg_end"] = round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None
    print(json.dumps(summary, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
