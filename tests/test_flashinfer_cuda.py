"""The FlashInfer backend over real pages (page_size > 1): its logits equal the torch backend's
within bf16 rounding (prefill, decode across page boundaries, a prefill over a shared cached
prefix), page size 16 computes what page size 1 computes, and CUDA graphs replay what runs
eagerly. FlashInfer has no float32 kernels, so everything here is bf16.

Skipped unless MINISGL_TEST_DEVICE=cuda and flashinfer is installed (CI has neither; flashinfer
is only imported when an engine builds the backend). The tiny model has head_dim 128, the shape
of the benchmarks, so the kernels FlashInfer JIT-compiles here are the ones they reuse."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import List, Tuple

import pytest
import torch
from helpers import (
    TEST_DEVICE,
    PageAllocator,
    allocated_reqs,
    build_tiny_model,
    make_req,
    prefill_logits,
    random_prompts,
    run_generation,
    running_engine,
    teacher_forced_logits,
)

from minisgl.engine import Engine

pytestmark = pytest.mark.skipif(
    TEST_DEVICE != "cuda" or importlib.util.find_spec("flashinfer") is None,
    reason="FlashInfer runs on CUDA only (MINISGL_TEST_DEVICE=cuda, flashinfer installed)",
)
BF16 = torch.bfloat16
PROMPTS = [9, 23, 40, 70]  # 70 + 12 steps crosses pages 16, 32, 48, 64, 80
STEPS = 12
REL_TOL = 2e-2  # of max |logit|: bf16 attention, summed in another order than the torch backend


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model("qwen3", tmp_path_factory.mktemp("qwen3_d128"), seed=4, head_dim=128)


def _prefix_logits(engine: Engine) -> torch.Tensor:
    """Prefill a 50-token prompt, then a second request that shares its first 32 tokens (whole
    pages, already in the pool) and prefills only its own 20: the paged prefill with kv > qo."""
    a = random_prompts([50], seed=7)[0]
    b = a[:32] + random_prompts([20], seed=8)[0]
    alloc = PageAllocator(engine)
    alloc.allocate(0, len(a))
    alloc.allocate(1, len(b), share_from=0, shared_tokens=32)
    first = prefill_logits(engine, [make_req(a, 0, 1)])
    second = prefill_logits(engine, [make_req(b, 1, 1, cached_len=32)])
    return torch.cat([first, second])


def _run(
    path: Path, backend: str, page_size: int, continuation: List[List[int]] | None, kv: str = "auto"
) -> Tuple[List[List[int]], torch.Tensor, torch.Tensor]:
    """(greedy tokens, teacher-forced logits [steps, B, vocab], prefix-case logits)."""
    prompts = random_prompts(PROMPTS, seed=3)
    kw = dict(max_running_req=4, attention_backend=backend, page_size=page_size, dtype=BF16, kv_cache_dtype=kv)
    with running_engine(path, **kw) as engine:
        assert engine.config.attention_backend == backend
        tokens = run_generation(engine, allocated_reqs(engine, prompts, STEPS), STEPS)
        cont = continuation if continuation is not None else tokens
        logits = torch.stack(teacher_forced_logits(engine, allocated_reqs(engine, prompts, STEPS), cont))
        prefix = _prefix_logits(engine)
    return tokens, logits, prefix


def _close(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert not got.isnan().any(), what
    diff = (got - ref).abs().max().item()
    scale = ref.abs().max().item()
    print(f"{what}: max |diff| {diff:.3g} (max |logit| {scale:.3g})")
    assert diff <= REL_TOL * scale, what


@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3"])  # fp8: two more JIT modules (-k auto skips them)
def test_flashinfer_pages_match_torch_backend(model_dir: Path, kv: str) -> None:
    ref_tokens, ref, ref_prefix = _run(model_dir, "torch", 16, None, kv)
    tokens16, got16, prefix16 = _run(model_dir, "flashinfer", 16, ref_tokens, kv)
    _, got1, prefix1 = _run(model_dir, "flashinfer", 1, ref_tokens, kv)
    _close(got16, ref, f"flashinfer ps=16 vs torch ps=16 ({kv})")
    _close(prefix16, ref_prefix, f"flashinfer ps=16 vs torch, shared prefix ({kv})")
    _close(got16, got1, f"flashinfer ps=16 vs flashinfer ps=1 ({kv})")
    _close(prefix16, prefix1, f"flashinfer ps=16 vs ps=1, shared prefix ({kv})")
    n = sum(x == y for a, b in zip(tokens16, ref_tokens) for x, y in zip(a, b))
    print(f"greedy tokens, flashinfer ps=16 == torch ps=16: {n}/{sum(map(len, ref_tokens))} ({kv})")


@pytest.mark.parametrize("page_size", [16, 1])
def test_flashinfer_pages_cuda_graphs_equal_eager(model_dir: Path, page_size: int) -> None:
    """Greedy tokens, batch 3 (padded to the graph of 4), contexts crossing page boundaries: the
    decode steps replayed from CUDA graphs == every step eager."""
    prompts = random_prompts([9, 23, 40], seed=5)
    steps = 30
    kw = dict(max_running_req=4, attention_backend="flashinfer", page_size=page_size, dtype=BF16)
    with running_engine(model_dir, **kw) as engine:
        assert engine.graph_runner.batch_sizes, "no decode graphs captured"
        graphs = run_generation(engine, allocated_reqs(engine, prompts, steps), steps)
    with running_engine(model_dir, cuda_graph_bs=[], **kw) as engine:
        assert not engine.graph_runner.batch_sizes
        eager = run_generation(engine, allocated_reqs(engine, prompts, steps), steps)
    assert graphs == eager
