"""Quantized checkpoints loaded from their own `quantization_config` (models/checkpoint_quant.py).

Each format's checkpoint is written here from a tiny random HF model (Llama with q/k/v/o
biases, Qwen3 with q/k norms and a tied head, float32): its projections are quantized with the
format's own math and stored in the format's own layout (Qwen3-MoE: each expert's too) (AWQ's nibble order, GPTQ's input-major
packing and v1 zero offset, compressed-tensors' packed codes and zero points, FP8 blocks). The
oracle is HF transformers in float32 on dense weights that this file dequantizes from its own
integer codes and scales (before packing), so a packing or scale-layout mistake in the loader
shows up as a mismatch:

- `quantization="none"`: the engine runs the dequantized weights; prefill logits within 1e-4 and
  greedy tokens identical (tie-aware) for every format, FP8 ones included;
- default (`auto`) on the CPU: the 4-bit formats' own codes run the decode GEMMs (int4, Q4_1
  blocks: d = scale, m = -scale * zero rounded to fp16); the layers carry exactly the checkpoint's
  codes, the decode steps call the int4 kernel, and the tokens and logits match HF on the Q4_1
  values (this file's own rounding of m; for symmetric formats those are the exact weights);
- tp = 2: each rank's dequantized shards equal the shards of the dense oracle checkpoint;
- unsupported schemes are refused at load, naming the scheme.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest
import torch
from helpers import (
    LOGIT_ATOL,
    TEST_DEVICE,
    HFOracle,
    allocated_reqs,
    assert_greedy_match,
    prefill_logits,
    record_runners,
    run_generation,
    running_engine,
)
from quant_helpers import FORMATS, MERGED, PROMPTS, STEPS, Checkpoint, ct_config, ct_int
from safetensors.torch import load_file, save_file

from minisgl.layers.quant import Int4Weight, QuantLinear
from minisgl.models.checkpoint_quant import quant_format


def _check_against(engine: Any, hf: HFOracle, label: str) -> None:
    """Prefill logits of PROMPTS within LOGIT_ATOL of `hf`, greedy tokens identical (tie-aware)."""
    logits = prefill_logits(engine, allocated_reqs(engine, PROMPTS, 1))
    for i, ids in enumerate(PROMPTS):
        diff = (logits[i] - hf.logits(ids)[-1]).abs().max().item()
        assert diff < LOGIT_ATOL, f"{label} prompt {i}: max |logit diff| {diff:.3g}"
    outs = run_generation(engine, allocated_reqs(engine, PROMPTS, STEPS), STEPS)
    for i, ids in enumerate(PROMPTS):
        ref, ref_logits = hf.greedy(ids, STEPS)
        assert assert_greedy_match(outs[i], ref, ref_logits, label=f"{label} prompt {i}") == STEPS


# ---- (a) every format, dequantized ------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(FORMATS))
def test_dequantized_checkpoint_matches_hf(name, quant_checkpoint, path_oracle, monkeypatch):
    from minisgl.models import weight

    ck = quant_checkpoint(name)
    said: List[str] = []
    monkeypatch.setattr(weight.logger, "info_rank0", lambda msg, *args: said.append(msg))
    with running_engine(ck.quantized, quantization="none") as engine:
        assert all(g is None or g.quant is None for g in _gemms(engine))
        _check_against(engine, path_oracle(ck.dense), name)
    assert any(msg.endswith("weights dequantized to float32 at load") for msg in said), said


def _gemms(engine: Any) -> List[QuantLinear | None]:
    return [getattr(m, "cpu_gemm", None) for _, m in engine.model.named_modules() if hasattr(m, "cpu_gemm")]


# ---- (c) the 4-bit formats' own codes on the CPU int4 decode GEMM -----------------------------
@pytest.mark.skipif(TEST_DEVICE != "cpu", reason="the int4 decode GEMM is the CPU's")
@pytest.mark.parametrize("name", sorted(n for n, f in FORMATS.items() if f.int4))
def test_int4_codes_run_the_cpu_int4_gemm(name, quant_checkpoint, path_oracle, monkeypatch):
    ck = quant_checkpoint(name)
    calls = []
    torch_mm = Int4Weight.torch_mm
    monkeypatch.setattr(Int4Weight, "torch_mm", lambda self, x: calls.append(x.shape[0]) or torch_mm(self, x))
    with running_engine(ck.quantized) as engine:  # quantization="auto", the default
        for i, layer in enumerate(engine.model.model.layers):
            for module, parts in MERGED.items():
                gemm = layer.get_submodule(module).cpu_gemm
                assert isinstance(gemm, QuantLinear) and isinstance(gemm.quant, Int4Weight), f"layer {i} {module}"
                codes, d, m = gemm.quant.blocks()
                src = [ck.layers[f"model.layers.{i}.{module.split('.')[0]}.{p}"] for p in parts]
                assert torch.equal(codes.long(), torch.cat([q.codes for q in src])), f"layer {i} {module}: not the checkpoint's codes"
                assert torch.equal(d, torch.cat([q.scale[:, torch.arange(0, q.codes.shape[1], 32) // q.group] for q in src]).half().float())
                want_m = torch.cat([(-(q.scale * q.zero))[:, torch.arange(0, q.codes.shape[1], 32) // q.group] for q in src])
                assert torch.equal(m, want_m.half().float())
            assert isinstance(layer.self_attn.o_proj.cpu_gemm.quant, Int4Weight)
            assert isinstance(layer.mlp.down_proj.cpu_gemm.quant, Int4Weight)
        _check_against(engine, path_oracle(ck.q4_1 or ck.dense), f"{name} (int4 GEMM)")
    assert calls and max(calls) <= len(PROMPTS), "the decode steps did not run the int4 GEMM"


@pytest.mark.skipif(TEST_DEVICE != "cpu", reason="the int4 decode GEMM is the CPU's")
def test_bf16_awq_decodes_on_the_c_int4_kernel(quant_checkpoint, path_oracle):
    """bf16 on a CPU with the C kernels: the AWQ codes' records are what the C decode loop
    streams (qgemv.c), and every token it picks is in the top 5 of HF float32 on the Q4_1 values
    (fed our tokens) until a first divergence from HF's own argmax."""
    from minisgl.engine.cpu_decode import CpuDecodeLoop
    from minisgl.kernel.cpu import cpu_kernels

    kern = cpu_kernels()
    if kern is None or not kern.has_qgemv:
        pytest.skip("no C compiler or no AVX512-BF16 here")
    ck = quant_checkpoint("awq")
    with running_engine(ck.quantized, dtype=torch.bfloat16) as engine:
        assert isinstance(engine.cpu_runner, CpuDecodeLoop), "the C decode loop was not built"
        gemm = engine.model.model.layers[0].mlp.down_proj.cpu_gemm
        assert isinstance(gemm.quant, Int4Weight) and gemm.qgemv is not None
        log = record_runners(engine)
        outs = run_generation(engine, allocated_reqs(engine, PROMPTS, STEPS), STEPS)
    assert ("CpuDecodeLoop", "decode") in log
    hf = path_oracle(ck.q4_1)
    for ids, out in zip(PROMPTS, outs):
        logits = hf.logits(list(ids) + out[:-1])[len(ids) - 1 :]
        for j, tok in enumerate(out):
            assert tok in logits[j].topk(5).indices.tolist(), f"token {j} ({tok}) not in HF's top 5"
            if tok != int(logits[j].argmax()):
                break


# ---- tensor parallelism: dequantize, then shard -----------------------------------------------
@pytest.mark.parametrize("name", ["awq", "fp8_block_ragged"])
def test_tp2_shards_are_the_dense_checkpoints_shards(name, quant_checkpoint):
    from transformers import AutoConfig

    from minisgl.distributed import set_tp_info
    from minisgl.distributed.info import clear_tp_info
    from minisgl.layers.rotary import rope_tables
    from minisgl.models import ModelConfig, create_model
    from minisgl.models.weight import load_weights
    from minisgl.utils.torch_utils import torch_dtype

    ck = quant_checkpoint(name)
    cfg = ModelConfig.from_hf(AutoConfig.from_pretrained(ck.dense))
    cpu = torch.device("cpu")
    try:
        for rank in range(2):
            set_tp_info(rank, 2)
            with rope_tables(cpu), torch.device("meta"), torch_dtype(torch.float32):
                model = create_model(cfg)
            ours = load_weights(model, str(ck.quantized), cpu, torch.float32)
            ref = load_weights(model, str(ck.dense), cpu, torch.float32)
            assert ours.keys() == ref.keys()
            for key in ref:
                torch.testing.assert_close(ours[key], ref[key], rtol=0, atol=1e-6, msg=f"rank {rank} {key}")
    finally:
        clear_tp_info()


# ---- (b) refusals -----------------------------------------------------------------------------
def _with_config(ck: Checkpoint, root: Path, quantization_config: Dict[str, Any] | None, drop: Tuple[str, ...] = (),
                 change: Dict[str, torch.Tensor] | None = None) -> Path:  # fmt: skip
    out = root / "variant"
    shutil.copytree(ck.quantized, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg.pop("quantization_config")
    if quantization_config is not None:
        cfg["quantization_config"] = quantization_config
    (out / "config.json").write_text(json.dumps(cfg))
    if drop or change:
        state = {k: v for k, v in load_file(str(out / "model.safetensors")).items() if k not in drop}
        state.update(change or {})
        save_file(state, str(out / "model.safetensors"))
    return out


@pytest.mark.parametrize(
    "config,match",
    [
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method='bitsandbytes' is not supported"),
        ({"quant_method": "exl2", "bits": 4}, "quant_method='exl2'"),
        ({"quant_method": "hqq"}, "quant_method='hqq'"),
        ({"quant_method": "awq", "bits": 3, "group_size": 128}, "AWQ bits=3 is not supported"),
        ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "AWQ version='gemv'"),
        ({"quant_method": "awq", "bits": 4, "version": "marlin"}, "AWQ version='marlin'"),
        ({"quant_method": "gptq", "bits": 3}, "GPTQ bits=3 is not supported"),
        ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "GPTQ checkpoint_format='marlin'"),
        ({"quant_method": "fp8", "fmt": "e5m2"}, "fp8 fmt='e5m2'"),
        (ct_config("int-quantized", {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
                    {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}),
         "activation-quantized int8"),
        (ct_config("nvfp4-pack-quantized", {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}),
         "FP4"),
        (ct_config("pack-quantized", {**ct_int(128, True), "num_bits": 2}), "num_bits=2 is not supported"),
        (ct_config("pack-quantized", {**ct_int(128, True), "actorder": "group"}), "actorder='group'"),
        (ct_config("marlin-24", ct_int(128, True)), "format='marlin-24'"),
    ],
)  # fmt: skip
def test_unsupported_schemes_are_refused_by_name(config, match, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": config}))
    with pytest.raises(ValueError, match=match):
        quant_format(tmp_path)


def test_act_order_gptq_is_refused(quant_checkpoint, tmp_path):
    ck = quant_checkpoint("gptq_sym_v1")
    prefix = next(iter(ck.layers))
    k = ck.layers[prefix].codes.shape[1]  # type: ignore[union-attr]
    g_idx = (torch.randperm(k, generator=torch.Generator().manual_seed(0)) // 64).to(torch.int32)
    cfg = {**FORMATS["gptq_sym_v1"].config, "desc_act": True}
    path = _with_config(ck, tmp_path, cfg, change={f"{prefix}.g_idx": g_idx})
    with pytest.raises(ValueError, match=rf"{prefix}.g_idx is not in group order \(act-order"):
        with running_engine(path):
            pass


def test_broken_checkpoints_are_refused(quant_checkpoint, tmp_path):
    ck = quant_checkpoint("awq")
    prefix = next(iter(ck.layers))
    (tmp_path / "a").mkdir()
    missing = _with_config(ck, tmp_path / "a", FORMATS["awq"].config, drop=(f"{prefix}.qzeros",))
    with pytest.raises(ValueError, match=rf"AWQ layer {prefix} has no {prefix}.qzeros"):
        with running_engine(missing):
            pass
    (tmp_path / "b").mkdir()
    unannounced = _with_config(ck, tmp_path / "b", None)
    with pytest.raises(ValueError, match=r"\.qweight \(torch.int32\) is quantized but config.json has no quantization_config"):
        with running_engine(unannounced):
            pass


def test_dummy_weights_need_no_quantized_tensors(quant_checkpoint, tmp_path):
    """--load-format dummy on a quantized checkpoint's config alone: random dense weights, no
    codes to read (the CPU int4 path is skipped)."""
    shutil.copy(quant_checkpoint("awq").quantized / "config.json", tmp_path / "config.json")
    with running_engine(tmp_path, use_dummy_weight=True) as engine:
        assert all(g is None or g.quant is None for g in _gemms(engine))
        assert len(run_generation(engine, allocated_reqs(engine, PROMPTS[:1], 2), 2)[0]) == 2


def test_only_whole_32_column_blocks_of_4_bit_codes_map_onto_q4_1():
    from minisgl.models.checkpoint_quant import IntGroups

    codes, ones = torch.randint(0, 16, (8, 96), dtype=torch.int32), torch.ones(8, 3)
    assert IntGroups(codes, ones, ones, 32, 4).q4_1() is not None
    assert IntGroups(codes, ones[:, :2], ones[:, :2], 48, 4).q4_1() is None  # a block would straddle two groups
    assert IntGroups(codes, ones, ones, 32, 8).q4_1() is None  # 8-bit codes
