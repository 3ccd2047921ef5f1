"""FP8 weights on CUDA (layers/fp8.py, kernel/triton_fp8.py). Skipped unless MINISGL_TEST_DEVICE=cuda;
tests/test_fp8_kernels_interpret.py and tests/test_fp8_weights.py are the CPU halves.

kernels: the activation quantizer and the block-scaled FP8 GEMM (128x128 blocks and per-row
         scales, fp32 and bf16 output, bias) against a dequantize-then-matmul float32 oracle
         (tests/kernel_checks/fp8.py) at the Qwen3-0.6B and Qwen3-14B projection shapes, M in
         {1, 8, 64, 512, 4096}; the GEMM sums each 128-wide dot on the FP8 tensor cores, so
         results are held to 1e-4 of the output's scale (+ the output dtype's rounding).
graph:   fp8_linear captured in a CUDA graph and replayed on new input == eager, bit for bit.
e2e:     a tiny FP8-block checkpoint (tests/quant_helpers.py; also per-channel, per-tensor) on CUDA in bf16: every linear layer
         keeps float8_e4m3fn weights, each greedy token is in HF float32's top 5 (on the exact
         dequantized weights, fed our tokens) until the first divergence from HF's argmax, max
         |logit diff| printed; with CUDA graphs (decode and mixed-step) the same tokens as eager.
online:  --quantization fp8 on a bf16 checkpoint: per-channel FP8 weights, the same top-5 rule.
"""

from __future__ import annotations

from typing import Any, List

import pytest
import torch
from helpers import TEST_DEVICE, HFOracle, allocated_reqs, prefill_logits, random_prompts, run_generation, running_engine
from kernel_checks.fp8 import run_checks

pytestmark = pytest.mark.skipif(TEST_DEVICE != "cuda", reason="the FP8 GEMM on the GPU (MINISGL_TEST_DEVICE=cuda)")

ROWS = (1, 8, 64, 512, 4096)
# (N, K) of each projection: qkv, o, gate_up, down
SHAPES = {
    "0.6B": [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)],
    "14B": [(7168, 5120), (5120, 5120), (34816, 5120), (5120, 17408)],
}
PROMPTS = random_prompts([9, 23, 40], seed=7)
STEPS = 12


@pytest.mark.parametrize("model,n,k", [(m, n, k) for m, shapes in SHAPES.items() for n, k in shapes])
def test_fp8_kernels_at_model_shapes(model: str, n: int, k: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)  # the oracle in true float32
    failures = run_checks([(m, n, k) for m in ROWS], "cuda", sum_rtol=1e-4)
    assert not failures, f"Qwen3-{model}: {failures}"


def test_fp8_linear_replays_from_a_cuda_graph() -> None:
    from kernel_checks.fp8 import quantize_weight

    from minisgl.kernel.triton_fp8 import fp8_linear

    gen = torch.Generator(device="cuda").manual_seed(0)
    w_q, w_s = quantize_weight(torch.randn(1024, 2048, generator=gen, device="cuda") * 0.05, 128, False)
    for m in (1, 8, 200):
        x = torch.randn(m, 2048, generator=gen, device="cuda").bfloat16()
        fp8_linear(x, w_q, w_s, 128)  # compile outside the capture
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = fp8_linear(x, w_q, w_s, 128)
        new = torch.randn(m, 2048, generator=gen, device="cuda").bfloat16()
        x.copy_(new)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, fp8_linear(new, w_q, w_s, 128)), f"M={m}: the replay differs from eager"


def _fp8_linears(engine: Any) -> List[str]:
    from minisgl.layers.linear import _Linear

    return [n for n, m in engine.model.named_modules() if isinstance(m, _Linear) and m.weight.dtype == torch.float8_e4m3fn]


def _top5_and_max_diff(engine: Any, hf: HFOracle, outs: List[List[int]], label: str) -> float:
    """Each of our greedy tokens in HF's top 5 (HF fed our tokens) until the first divergence from
    HF's argmax; the max |prefill logit diff| against HF."""
    logits = prefill_logits(engine, allocated_reqs(engine, PROMPTS, 1))
    diff = max((logits[i].float().cpu() - hf.logits(ids)[-1]).abs().max().item() for i, ids in enumerate(PROMPTS))
    for ids, out in zip(PROMPTS, outs):
        ref = hf.logits(list(ids) + out[:-1])[len(ids) - 1 :]
        for j, tok in enumerate(out):
            assert tok in ref[j].topk(5).indices.tolist(), f"{label}: token {j} ({tok}) not in HF's top 5"
            if tok != int(ref[j].argmax()):
                break
    print(f"{label}: max |logit diff| vs HF float32 {diff:.4g}")
    return diff


def test_fp8_block_checkpoint_keeps_fp8_weights_on_cuda(quant_checkpoint, path_oracle) -> None:
    ck = quant_checkpoint("fp8_block")
    kw = dict(dtype=torch.bfloat16, max_running_req=4, attention_backend="triton", quantization="fp8")
    with running_engine(ck.quantized, **kw) as engine:
        kept = _fp8_linears(engine)
        layers = engine.model.model.layers
        assert len(kept) == 4 * len(layers), f"every projection should keep FP8 weights, got {kept}"
        assert all(m.weight_scale is not None and m.weight_scale.dtype == torch.float32 for n, m in engine.model.named_modules()
                   if n in kept)  # fmt: skip
        assert engine.graph_runner.batch_sizes, "no decode graphs captured"
        graphs = run_generation(engine, allocated_reqs(engine, PROMPTS, STEPS), STEPS)
        diff = _top5_and_max_diff(engine, path_oracle(ck.dense), graphs, "fp8_block (graphs)")
        assert diff < 0.5 * path_oracle(ck.dense).logits(PROMPTS[0]).abs().max().item()
    with running_engine(ck.quantized, cuda_graph_bs=[], cuda_graph_max_tokens=0, **kw) as engine:
        assert len(_fp8_linears(engine)) == len(kept)
        eager = run_generation(engine, allocated_reqs(engine, PROMPTS, STEPS), STEPS)
    assert graphs == eager, "CUDA graphs changed the tokens"


@pytest.mark.parametrize("name", ["ct_fp8_channel", "fp8_tensor_static"])
def test_fp8_channel_and_tensor_checkpoints_keep_fp8_weights_on_cuda(name, quant_checkpoint, path_oracle) -> None:
    ck = quant_checkpoint(name)
    with running_engine(ck.quantized, dtype=torch.bfloat16, attention_backend="triton", quantization="fp8") as engine:
        assert len(_fp8_linears(engine)) == 4 * len(engine.model.model.layers)
        outs = run_generation(engine, allocated_reqs(engine, PROMPTS, STEPS), STEPS)
        _top5_and_max_diff(engine, path_oracle(ck.dense), outs, name)


def test_online_fp8_quantization(quant_checkpoint, path_oracle) -> None:
    ck = quant_checkpoint("fp8_block")  # its dense quant_checkpoint: a plain float32 HF model
    with running_engine(ck.dense, dtype=torch.bfloat16, attention_backend="triton", quantization="fp8") as engine:
        kept = _fp8_linears(engine)
        assert len(kept) == 4 * len(engine.model.model.layers), kept
        assert all(m.weight_block_n == 1 for n, m in engine.model.named_modules() if n in kept)
        outs = run_generation(engine, allocated_reqs(engine, PROMPTS, STEPS), STEPS)
        _top5_and_max_diff(engine, path_oracle(ck.dense), outs, "--quantization fp8")
