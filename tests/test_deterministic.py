"""`--deterministic` (issue 13): in bf16, greedy and seeded outputs are identical whatever the
batch composition, the prefill chunking and the prefix-cache state (cold, warm, partly
cached), and after a retraction's recompute."""

from __future__ import annotations

import dataclasses
import importlib.util
import random
from typing import Any, Dict, List, Tuple

import pytest
import torch
from helpers import TEST_DEVICE
from sched_helpers import TINY

from minisgl.core import SamplingParams
from minisgl.llm import LLM

N_NEW = 24


def make_llm(path: Any, deterministic: bool = True, **kw: Any) -> LLM:
    kw.setdefault("max_running_req", 16)
    kw.setdefault("max_seq_len_override", 256)
    kw.setdefault("num_page_override", 16 * 256)
    return LLM(str(path), dtype="bfloat16", device=TEST_DEVICE, deterministic=deterministic, **kw)


def params(n: int = N_NEW) -> List[SamplingParams]:
    return [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=1),
        SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=n, ignore_eos=True, logprobs=1),
    ]


Out = Tuple[List[int], List[float]]


def gen(llm: LLM, prompts: List[List[int]], sp: SamplingParams) -> List[Out]:
    return [(r.token_ids, r.logprobs or []) for r in llm.generate(prompts, sp)]


def scenarios(path: Any, sp: SamplingParams, deterministic: bool) -> Dict[str, Out]:
    """The same request's tokens and logprobs (bit for bit) in different surroundings."""
    rng = random.Random(5)
    target = [rng.randrange(1, 256) for _ in range(70)]
    others = [[rng.randrange(1, 256) for _ in range(rng.randint(3, 90))] for _ in range(7)]
    sharing = target[:40] + [rng.randrange(1, 256) for _ in range(20)]  # leaves target's first 40 cached
    out: Dict[str, Out] = {}
    llm = make_llm(path, deterministic, cache_type="radix")
    try:
        out["cold"] = gen(llm, [target], sp)[0]
        out["warm"] = gen(llm, [target], sp)[0]  # its prompt pages are cached now
        # the prompt extended by its own first 12 tokens: token 13 comes from a prefill, not a
        # decode step (a multi-turn chat, or a retracted request's recompute)
        tokens, logprobs = out["cold"]
        more = dataclasses.replace(sp, max_tokens=N_NEW - 12)
        cont = gen(llm, [target + tokens[:12]], more)[0]
        out["continued"] = (tokens[:12] + cont[0], logprobs[:12] + cont[1])
        llm.scheduler.reset_prefix_cache()
        gen(llm, [sharing], sp)
        out["partly cached"] = gen(llm, [target], sp)[0]  # a 40-token prefix hit
        llm.scheduler.reset_prefix_cache()
        out["batched"] = gen(llm, others[:3] + [target] + others[3:], sp)[3]
    finally:
        llm.shutdown()
    # small chunks, no cache: the prompt prefilled 16 tokens at a time beside other requests
    llm = make_llm(path, deterministic, cache_type="naive", max_extend_tokens=16)
    try:
        out["chunked, batched"] = gen(llm, others + [target], sp)[-1]
        out["chunked, alone"] = gen(llm, [target], sp)[0]
    finally:
        llm.shutdown()
    return out


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_outputs_do_not_depend_on_batch_chunking_or_cache(tiny_dir, sampling) -> None:
    sp = params()[0 if sampling == "greedy" else 1]
    out = scenarios(tiny_dir, sp, deterministic=True)
    cold = out["cold"]
    assert len(cold[0]) == N_NEW and len(cold[1]) == N_NEW
    for name, got in out.items():
        assert got[0] == cold[0], f"{name}: tokens differ"
        assert got[1] == cold[1], f"{name}: logprobs differ (bitwise)"


def test_default_mode_is_not_batch_invariant(tiny_dir) -> None:
    """The control: without --deterministic the same comparisons do see differences (chunked
    prefill and decode-vs-prefill round differently), so the test above can fail."""
    out = scenarios(tiny_dir, params()[0], deterministic=False)
    cold = out["cold"]
    assert any(got[1] != cold[1] for got in out.values())


def test_deterministic_refuses_what_it_cannot_honour(tiny_dir) -> None:
    with pytest.raises(ValueError, match="attention_backend"):
        LLM(str(tiny_dir), dtype="bfloat16", device=TEST_DEVICE, deterministic=True, attention_backend="torch")
    if TEST_DEVICE == "cpu":
        with pytest.raises(ValueError, match="quantization"):
            LLM(str(tiny_dir), dtype="bfloat16", device="cpu", deterministic=True, quantization="int8")


def test_batch_invariant_linear_rows_do_not_depend_on_the_batch() -> None:
    import torch.nn.functional as F

    from minisgl.layers.batch_invariant import BatchInvariantMode

    gen_ = torch.Generator().manual_seed(0)
    w = torch.randn(96, 80, generator=gen_).to(TEST_DEVICE)
    x = torch.randn(70, 80, generator=gen_).to(TEST_DEVICE)
    with BatchInvariantMode():
        full = F.linear(x, w)
        for lo, hi in ((0, 1), (5, 6), (3, 40), (33, 70)):
            assert torch.equal(F.linear(x[lo:hi], w), full[lo:hi])
    torch.testing.assert_close(full, x @ w.t(), rtol=1e-5, atol=1e-5)


def test_deterministic_mode_matches_hf_in_float32(tiny_dir, hf_oracle) -> None:
    """Its attention and GEMM tiles compute the same model: greedy tokens equal HF's (fp32)."""
    from sched_helpers import assert_match_ref, refs_for

    refs = refs_for(hf_oracle(TINY))
    rng = random.Random(9)
    prompts = [[rng.randrange(1, 256) for _ in range(n)] for n in (1, 17, 64, 130)]
    llm = LLM(str(tiny_dir), dtype="float32", device=TEST_DEVICE, deterministic=True, max_seq_len_override=256, max_extend_tokens=48)
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    finally:
        llm.shutdown()
    for p, out in zip(prompts, outs):
        ref, scores = refs.get(p, 16)
        assert_match_ref(out.token_ids, ref, scores, f"prompt of {len(p)}")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_deterministic_kernel_in_interpreter() -> None:
    """The CUDA kernel of the mode, through Triton's interpreter: matches float64 attention and
    gives a query the same bits alone and inside larger launches (float32; on CUDA the test below
    runs the bf16 case too)."""
    from kernel_checks import run_module

    proc = run_module("deterministic")
    assert proc.returncode == 0 and "deterministic kernels: ok" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.skipif(TEST_DEVICE != "cuda", reason="the Triton kernel on the GPU (MINISGL_TEST_DEVICE=cuda)")
def test_triton_deterministic_kernel_on_cuda() -> None:
    from kernel_checks.deterministic import check

    assert check(torch.device("cuda"))
