"""Int4 W4A16 weights on CUDA (layers/int4.py, kernel/triton_int4.py). Skipped unless
MINISGL_TEST_DEVICE=cuda; tests/test_int4_kernels_interpret.py is the CPU half.

kernels: the W4A16 GEMM (groups 128, and 32 / 64 at one shape; symmetric and asymmetric; float32
         and bf16 + bias) against a dequantize-then-matmul float32 oracle (tests/kernel_checks/int4.py)
         at the Qwen3-0.6B and Qwen3-14B projection shapes, M in {1, 2, 4, 8, 16, 64, 512, 2048}
         (the one-row GEMV and the decode tiles, with and without split-K; prefill tiles).
graph:   w4a16_linear captured in a CUDA graph (the GEMV and a decode tile with split-K, a prefill
         tile) and replayed on new input == eager, bit for bit.
e2e:     tiny AWQ / GPTQ (v1 symmetric, v2 asymmetric) / compressed-tensors (group, channel)
         checkpoints (tests/quant_helpers.py) on CUDA in float32 (IEEE float32 dots): every
         projection keeps its codes as int4 (packed int32 weight, scales, zeros), prefill logits
         within 1e-4 of HF float32 on the dequantized weights and greedy tokens identical
         (tie-aware); with CUDA graphs and without, the same tokens.
bf16:    AWQ and GPTQ in bf16 (the tensor-core tiles): each greedy token in HF float32's top 5
         until the first divergence, graphs == eager.
online:  --quantization int4 on a dense checkpoint (float32): group-128 int4 weights, tokens
         identical (tie-aware) to HF float32 on the same quantized weights; with dummy weights in
         bf16 (benchmark/offline.py --dummy-weights --quantization int4) it runs.
"""

from __future__ import annotations

from typing import Any, List

import pytest
import torch
from helpers import (
    LOGIT_ATOL,
    TEST_DEVICE,
    HFOracle,
    allocated_reqs,
    assert_greedy_match,
    prefill_logits,
    random_prompts,
    run_generation,
    running_engine,
)
from kernel_checks.int4 import run_cases, run_checks
from quant_helpers import online_int4_checkpoint

pytestmark = pytest.mark.skipif(TEST_DEVICE != "cuda", reason="the int4 GEMM on the GPU (MINISGL_TEST_DEVICE=cuda)")

ROWS = (1, 2, 4, 8, 16, 64, 512, 2048)
# (N, K) of each projection: qkv, o, gate_up, down
SHAPES = {
    "0.6B": [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)],
    "14B": [(7168, 5120), (5120, 5120), (34816, 5120), (5120, 17408)],
}
INT4_FORMATS = ["awq", "ct_w4a16_asym", "ct_w4a16_sym", "gptq_asym_v2", "gptq_sym_v1"]
PROMPTS = random_prompts([9, 23, 40], seed=7)
STEPS = 12


@pytest.fixture(autouse=True)
def _true_float32(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)  # the oracles in true float32


@pytest.mark.parametrize("model,n,k", [(m, n, k) for m, shapes in SHAPES.items() for n, k in shapes])
def test_int4_kernels_at_model_shapes(model: str, n: int, k: int) -> None:
    failures = run_checks([(m, n, k) for m in ROWS], "cuda", sum_rtol=1e-4, groups=(128,))
    assert not failures, f"Qwen3-{model}: {failures}"


def test_int4_kernels_small_groups() -> None:
    cases = [(m, 4096, 1024, g) for m in (1, 8, 64, 512) for g in (32, 64)] + [(1, 5120, 17408, 32), (16, 5120, 17408, 64)]
    failures = run_cases(cases, "cuda", sum_rtol=1e-4)
    assert not failures, failures


def test_int4_linear_replays_from_a_cuda_graph() -> None:
    from kernel_checks.int4 import make_weight

    from minisgl.kernel.triton_int4 import gemm_config, w4a16_linear

    gen = torch.Generator(device="cuda").manual_seed(0)
    w = make_weight(1024, 2048, 128, False, gen, "cuda").to(torch.device("cuda"), torch.bfloat16)
    bias = torch.randn(1024, generator=gen, device="cuda").bfloat16()
    assert gemm_config(1, 1024, 2048, 128, torch.cuda.get_device_properties(0).multi_processor_count).split_k > 1
    for m in (1, 8, 200):
        x = torch.randn(m, 2048, generator=gen, device="cuda").bfloat16()
        w4a16_linear(x, w.qweight, w.scale, w.zero, w.group, bias)  # compile outside the capture
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = w4a16_linear(x, w.qweight, w.scale, w.zero, w.group, bias)
        new = torch.randn(m, 2048, generator=gen, device="cuda").bfloat16()
        x.copy_(new)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, w4a16_linear(new, w.qweight, w.scale, w.zero, w.group, bias)), f"M={m}: the replay differs from eager"


def _int4_linears(engine: Any) -> List[str]:
    from minisgl.layers.linear import _Linear

    return [n for n, m in engine.model.named_modules() if isinstance(m, _Linear) and m.weight_zero is not None]


def _assert_exact(engine: Any, hf: HFOracle, label: str) -> List[List[int]]:
    """Prefill logits within LOGIT_ATOL of HF, greedy tokens identical (tie-aware); our tokens."""
    logits = prefill_logits(engine, allocated_reqs(engine, PROMPTS, 1))
    for i, ids in enumerate(PROMPTS):
        diff = (logits[i].float().cpu() - hf.logits(ids)[-1]).abs().max().item()
        assert diff < LOGIT_ATOL, f"{label} prompt {i}: max |logit diff| {diff:.3g}"
    outs = run_generation(engine, allocated_reqs(engine, PROMPTS, STEPS), STEPS)
    for i, ids in enumerate(PROMPTS):
        ref, ref_logits = hf.greedy(ids, STEPS)
        assert assert_greedy_match(outs[i], ref, ref_logits, label=f"{label} prompt {i}") == STEPS
    return outs


@pytest.mark.parametrize("name", INT4_FORMATS)
def test_int4_checkpoint_keeps_int4_weights_on_cuda(name, quant_checkpoint, path_oracle, monkeypatch) -> None:
    from minisgl.models import weight

    ck = quant_checkpoint(name)
    said: List[str] = []
    monkeypatch.setattr(weight.logger, "info_rank0", lambda msg, *args: said.append(msg))
    with running_engine(ck.quantized, attention_backend="triton", quantization="int4") as engine:  # float32
        kept = _int4_linears(engine)
        layers = engine.model.model.layers
        assert len(kept) == 4 * len(layers), f"every projection should keep int4 codes, got {kept}"
        for n, m in engine.model.named_modules():
            if n in kept:
                assert m.weight.dtype == torch.int32 and m.weight.shape[1] * 8 == m.in_local, n
                assert m.weight_scale.dtype == m.weight_zero.dtype == torch.float32 and m.weight_group in (32, 64, 128)
        assert engine.graph_runner.batch_sizes, "no decode graphs captured"
        graphs = _assert_exact(engine, path_oracle(ck.dense), f"{name} (graphs)")
    assert any(m.endswith("weights kept as int4 (W4A16 GEMM, activations in float32)") for m in said), said
    with running_engine(ck.quantized, attention_backend="triton", quantization="int4", cuda_graph_bs=[], cuda_graph_max_tokens=0) as engine:
        assert len(_int4_linears(engine)) == len(kept)
        eager = run_generation(engine, allocated_reqs(engine, PROMPTS, STEPS), STEPS)
    assert graphs == eager, "CUDA graphs changed the tokens"


def _top5(engine: Any, hf: HFOracle, outs: List[List[int]], label: str) -> None:
    """Each of our greedy tokens in HF's top 5 (HF fed our tokens) until the first divergence from
    HF's argmax; the max |prefill logit diff| printed."""
    logits = prefill_logits(engine, allocated_reqs(engine, PROMPTS, 1))
    diff = max((logits[i].float().cpu() - hf.logits(ids)[-1]).abs().max().item() for i, ids in enumerate(PROMPTS))
    for ids, out in zip(PROMPTS, outs):
        ref = hf.logits(list(ids) + out[:-1])[len(ids) - 1 :]
        for j, tok in enumerate(out):
            assert tok in ref[j].topk(5).indices.tolist(), f"{label}: token {j} ({tok}) not in HF's top 5"
            if tok != int(ref[j].argmax()):
                break
    print(f"{label}: max |logit diff| vs HF float32 {diff:.4g}")


@pytest.mark.parametrize("name", ["awq", "gptq_asym_v2"])
def test_int4_checkpoint_in_bf16(name, quant_checkpoint, path_oracle) -> None:
    ck = quant_checkpoint(name)
    kw: dict[str, Any] = dict(dtype=torch.bfloat16, attention_backend="triton", quantization="int4")
    with running_engine(ck.quantized, **kw) as engine:
        kept = _int4_linears(engine)
        assert len(kept) == 4 * len(engine.model.model.layers)
        assert all(m.weight_scale.dtype == torch.bfloat16 for n, m in engine.model.named_modules() if n in kept)
        graphs = run_generation(engine, allocated_reqs(engine, PROMPTS, STEPS), STEPS)
        _top5(engine, path_oracle(ck.dense), graphs, f"{name} bf16")
    with running_engine(ck.quantized, cuda_graph_bs=[], cuda_graph_max_tokens=0, **kw) as engine:
        eager = run_generation(engine, allocated_reqs(engine, PROMPTS, STEPS), STEPS)
    assert graphs == eager, "CUDA graphs changed the tokens"


def test_online_int4_quantization(quant_checkpoint, tmp_path) -> None:
    ck = quant_checkpoint("awq")  # its dense checkpoint: a plain float32 HF model
    oracle = HFOracle(online_int4_checkpoint(ck.dense, tmp_path))
    with running_engine(ck.dense, quantization="int4", attention_backend="triton") as engine:
        kept = _int4_linears(engine)
        assert len(kept) == 4 * len(engine.model.model.layers), kept
        assert all(m.weight_group == 128 for n, m in engine.model.named_modules() if n in kept)
        _assert_exact(engine, oracle, "--quantization int4")


def test_online_int4_with_dummy_weights_in_bf16(quant_checkpoint) -> None:
    """What `benchmark/offline.py --dummy-weights --quantization int4` builds."""
    ck = quant_checkpoint("awq")
    with running_engine(ck.dense, dtype=torch.bfloat16, use_dummy_weight=True, quantization="int4", attention_backend="triton") as engine:
        assert len(_int4_linears(engine)) == 4 * len(engine.model.model.layers)
        outs = run_generation(engine, allocated_reqs(engine, PROMPTS, 4), 4)
    assert all(len(o) == 4 for o in outs)
