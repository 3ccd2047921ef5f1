"""The GPU attention backends and an Engine over them, on CUDA (tests/kernel_checks/attention.py):

- each backend (triton; flashinfer where installed, on the shapes it supports) against the torch
  backend on random paged inputs, bf16 and fp32, contexts up to 9k, page_size 1 and 16;
- a decode attention call and a mixed (decode rows + chunks) call replayed from CUDA graphs with
  new lengths and rows: the eager result, bit for bit;
- an Engine on a tiny random Qwen3 with head_dim 128: float32 greedy tokens == HF generate with and
  without CUDA graphs, page size 1 and 16, mixed batches; graphs == eager in bf16 too.

Skipped unless MINISGL_TEST_DEVICE=cuda; on the CPU tests/test_triton_attention_interpret.py runs
the same checks through Triton's interpreter at small sizes."""

from __future__ import annotations

from typing import Callable, Dict, List

import pytest
import torch
from helpers import TEST_DEVICE
from kernel_checks import attention as A

pytestmark = pytest.mark.skipif(TEST_DEVICE != "cuda", reason="CUDA attention backends (MINISGL_TEST_DEVICE=cuda)")

DEV = torch.device("cuda")
CASES = A.attention_cases(DEV, quick=False)
BACKENDS = A.gpu_backends(DEV)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_backends_match_the_torch_backend(case: A.AttentionCase) -> None:
    A.run_case(case, BACKENDS, DEV)


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_graph_replay_equals_eager(backend: str) -> None:
    A.check_graph_decode(backend, DEV, torch.bfloat16)


def test_mixed_graph_replay_equals_eager() -> None:
    A.check_graph_mixed(DEV, torch.bfloat16)


@pytest.fixture(scope="module")
def engine_run(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], List[List[int]]]:
    """engine_run(key) -> greedy tokens of that engine variant (each run once); key "hf": HF generate."""
    path = str(tmp_path_factory.mktemp("tiny_qwen3_d128"))
    A.build_tiny_qwen3(path)
    prompts, n_new = A.engine_prompts(quick=False)
    variants = {A.variant_key(v): v for v in A.engine_variants(DEV, BACKENDS)}
    cache: Dict[str, List[List[int]]] = {"hf": A.hf_generate(path, DEV, prompts, n_new)}

    def get(key: str) -> List[List[int]]:
        if key not in cache:
            b, ps, graphs, dt, mixed = variants[key]
            cache[key], info = A.run_engine(path, DEV, b, ps, graphs, dt, prompts, n_new, mixed=mixed)
            print(key, info)
            assert [len(o) for o in cache[key]] == n_new
        return cache[key]

    return get


VARIANTS = [A.variant_key(v) for v in A.engine_variants(DEV, BACKENDS)]


@pytest.mark.parametrize("key", VARIANTS)
def test_engine_variant(engine_run, key: str) -> None:
    """float32 runs give HF's greedy tokens exactly; bf16 runs (FlashInfer has no float32 kernels)
    must complete, and are compared with their eager twin below."""
    outs = engine_run(key)
    if "float32" in key:
        assert outs == engine_run("hf")


@pytest.mark.parametrize("graphs, eager", A.GRAPHS_EQUAL_EAGER)
def test_engine_graphs_equal_eager(engine_run, graphs: str, eager: str) -> None:
    assert engine_run(graphs) == engine_run(eager)
