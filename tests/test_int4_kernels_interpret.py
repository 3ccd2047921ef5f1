"""The int4 W4A16 path on a CPU machine (tests/test_int4_cuda.py is the GPU half).

- kernels: the Triton GEMM (minisgl/kernel/triton_int4.py) through Triton's interpreter
  (tests/kernel_checks/int4.py, in a subprocess: TRITON_INTERPRET must be set before triton is
  imported) against a dequantize-then-matmul float32 oracle: the one-row GEMV and the decode
  tiles with K split over 1, 2 and 4 CTAs, prefill tiles, groups 32 / 64 / 128, symmetric and asymmetric, bias, float32 and
  bf16 activations; and the tiles compiled for sm_90 (tensor-core dots, no spills).
- layout: each 4-bit checkpoint format (AWQ, GPTQ v1 symmetric / v2 asymmetric,
  compressed-tensors group and channel), read by the loader and repacked into `Int4Packed`, is
  exactly the format's own dequantization; rows and group-aligned columns narrow like the dense
  weight, a cut inside a group is refused; merged parts of different groups concatenate; the
  online quantizer stays within half a step of the weight.
- loader: at tp = 2 each rank's int4 shards (codes, scales, zeros) are the dense checkpoint's
  shards; a row-parallel cut inside a group dequantizes that layer (logged).
- end to end on the CPU through the op's torch implementation (the kernel's arithmetic; the CPU
  never keeps int4 outside tests): the projections hold int4 codes, run the op, and float32
  prefill logits and greedy tokens match HF float32 on the dequantized weights.
"""

from __future__ import annotations

import importlib.util
from typing import Any, List

import pytest
import torch
from kernel_checks import run_module
from quant_helpers import FORMATS, PROMPTS, STEPS

from minisgl.layers.int4 import Int4Packed, Int4Unaligned, int4_linear, pack_codes, quantize_groups, unpack_codes
from minisgl.models.checkpoint_quant import AwqFormat, CompressedTensorsFormat, GptqFormat, IntGroups, QuantFormat

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
INT4_FORMATS = sorted(n for n, f in FORMATS.items() if f.int4)


@needs_triton
def test_int4_kernels_in_interpreter() -> None:
    proc = run_module("int4", timeout=300)
    print(proc.stdout)
    assert proc.returncode == 0, f"int4 checks failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"


@needs_triton
def test_int4_kernels_compile_for_sm90() -> None:
    """One tile of each family compiled for sm_90 (tests/kernel_checks/sm90.py int4; `int4_all`
    sweeps every tile of the Qwen3 shapes): tensor-core dots, shared memory within the H200's, no spills."""
    proc = run_module("sm90", "int4", interpret=False, timeout=300)
    print(proc.stdout)
    assert proc.returncode == 0, f"sm_90 compilation failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-4000:]}"


def _reader(name: str) -> QuantFormat:
    cfg = FORMATS[name].config
    method = cfg["quant_method"]
    return AwqFormat(cfg) if method == "awq" else GptqFormat(cfg) if method == "gptq" else CompressedTensorsFormat(cfg)


@pytest.mark.parametrize("name", INT4_FORMATS)
def test_repack_is_each_formats_own_dequantization(name: str) -> None:
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(48, 256, generator=gen) * 0.05
    q = FORMATS[name].quantize(w)  # the format's tensors, and its own dequantization (q.dense)
    groups = _reader(name).assemble("layer", dict(q.tensors))
    assert isinstance(groups, IntGroups)
    packed = Int4Packed.from_groups(groups.codes, groups.scale, groups.zero, groups.group, groups.bits)
    assert packed.qweight.dtype == torch.int32 and packed.qweight.shape == (48, 256 // 8)
    assert packed.group in (32, 64, 128) and packed.shape == (48, 256)
    assert torch.equal(packed.dense(), q.dense), f"{name}: the repacked weight is not the format's dequantization"
    assert torch.equal(unpack_codes(packed.qweight).long(), q.codes), "not the checkpoint's codes"


def test_pack_codes_layout() -> None:
    """Code k of a row in bits [4 (k % 8), +4) of word k // 8, words as int32 bits."""
    codes = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 15, 0, 0, 0, 0, 0, 0, 0, 8]])
    words = pack_codes(codes)
    assert words.tolist() == [[int.from_bytes((0xF7654321).to_bytes(4, "little"), "little", signed=True), 0x80000000 - 2**32]]
    assert torch.equal(unpack_codes(words).long(), codes)


def test_narrow_cat_and_refusals() -> None:
    gen = torch.Generator().manual_seed(2)
    codes = torch.randint(0, 16, (40, 256), generator=gen)
    zero = torch.randint(0, 16, (40, 4), generator=gen).float()
    a = Int4Packed.from_groups(codes, torch.rand(40, 4, generator=gen), zero, 64, 4)
    dense = a.dense()
    assert torch.equal(a.narrow(0, 8, 16).dense(), dense[8:24])
    assert torch.equal(a.narrow(1, 128, 64).dense(), dense[:, 128:192])
    with pytest.raises(Int4Unaligned, match="cut the 64-column groups"):
        a.narrow(1, 96, 128)
    b = Int4Packed.from_groups(codes[:8], torch.rand(8, 1, generator=gen), zero[:8, :1], 256, 4)  # per-channel: G = K
    assert b.group == 128 and torch.equal(b.dense(), (codes[:8].float() - zero[:8, :1]) * b.scale[:, :1])
    merged = Int4Packed.cat([a, b])
    assert merged.group == 64 and torch.equal(merged.dense(), torch.cat([dense, b.dense()]))
    with pytest.raises(Int4Unaligned, match="not a multiple of the group"):
        Int4Packed.from_groups(codes[:, :96], torch.rand(40, 1), zero[:, :1], 64, 4)
    with pytest.raises(Int4Unaligned, match="group size 96"):
        Int4Packed.from_groups(codes[:, :192], torch.rand(40, 2), zero[:, :2], 96, 4)
    z16 = Int4Packed.from_groups(codes, torch.rand(40, 4), torch.full((40, 4), 16.0), 64, 4)  # GPTQ v1's stored 15
    assert torch.equal(z16.dense(), (codes.float() - 16) * z16.scale.repeat_interleave(64, 1))
    with pytest.raises(Int4Unaligned, match="not integers in"):
        Int4Packed.from_groups(codes, torch.rand(40, 4), torch.full((40, 4), 17.0), 64, 4)
    with pytest.raises(Int4Unaligned, match="8-bit"):
        Int4Packed.from_groups(codes, torch.rand(40, 4), zero, 64, 8)


def test_online_quantizer_and_torch_op() -> None:
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(24, 384, generator=gen) * 0.03
    w[3] = 0.0  # an all-zero row stays exactly zero
    q = quantize_groups(w)
    assert q.group == 128 and q.scale.shape == (24, 3) and bool(((q.zero >= 0) & (q.zero <= 15)).all())
    err = (q.dense() - w).abs()
    assert bool((err <= q.scale.repeat_interleave(128, 1) / 2 + 1e-7).all()), "more than half a step from the weight"
    assert bool((q.dense()[3] == 0).all())
    x = torch.randn(5, 384, generator=gen)
    bias = torch.randn(24, generator=gen)
    y = int4_linear(x.reshape(1, 5, 384), q.qweight, q.scale, q.zero, q.group, bias)
    torch.testing.assert_close(y.reshape(5, 24), x @ q.dense().t() + bias, rtol=1e-5, atol=1e-5)


def _tp2_check(name: str, quant_checkpoint: Any, monkeypatch: pytest.MonkeyPatch) -> List[str]:
    """Each rank's weights at tp = 2 with int4 kept: int4 layers' dense values equal the dense
    checkpoint's shards; returns the log."""
    from transformers import AutoConfig

    from minisgl.distributed import set_tp_info
    from minisgl.distributed.info import clear_tp_info
    from minisgl.layers.linear import _Linear
    from minisgl.layers.rotary import rope_tables
    from minisgl.models import ModelConfig, create_model, weight
    from minisgl.utils.torch_utils import torch_dtype

    said: List[str] = []
    monkeypatch.setattr(weight.logger, "info_rank0", lambda msg, *args: said.append(msg))
    ck = quant_checkpoint(name)
    cfg = ModelConfig.from_hf(AutoConfig.from_pretrained(ck.dense))
    cpu = torch.device("cpu")
    try:
        for rank in range(2):
            set_tp_info(rank, 2)
            with rope_tables(cpu), torch.device("meta"), torch_dtype(torch.float32):
                model = create_model(cfg)
            ours = weight.load_weights(model, str(ck.quantized), cpu, torch.float32, keep_int4=True)
            ref = weight.load_weights(model, str(ck.dense), cpu, torch.float32)
            assert ours.keys() == ref.keys()
            kept = 0
            for key in ref:
                mod = model.get_submodule(key.rpartition(".")[0])
                got = ours[key]
                if isinstance(mod, _Linear) and key.endswith(".weight") and got.dtype == torch.int32:
                    assert mod.weight_zero is not None and mod.weight_scale is not None
                    got = Int4Packed(got, mod.weight_scale, mod.weight_zero, mod.weight_group).dense()
                    kept += 1
                torch.testing.assert_close(got, ref[key], rtol=0, atol=1e-6, msg=f"rank {rank} {key}")
            assert kept, "no layer kept int4"
    finally:
        clear_tp_info()
    return said


def test_tp2_int4_shards_are_the_dense_checkpoints_shards(quant_checkpoint, monkeypatch) -> None:
    said = _tp2_check("ct_w4a16_sym", quant_checkpoint, monkeypatch)  # group 32: every shard keeps int4
    assert not any("cannot stay int4" in m for m in said), said
    said = _tp2_check("awq", quant_checkpoint, monkeypatch)  # group 128, K 128 split in 64s: row-parallel dequantized
    assert any("o_proj.weight: this rank's shard cannot stay int4" in m for m in said), said


@pytest.mark.parametrize("name", ["awq", "ct_w4a16_sym"])
def test_kept_int4_weights_run_the_int4_op(name, quant_checkpoint, path_oracle, monkeypatch) -> None:
    """The kept-int4 path end to end on the CPU in float32, the op's torch implementation standing
    in for the CUDA kernel: every projection holds packed int32 codes and runs the int4 op, the
    log says `kept as int4`, prefill logits and greedy tokens match HF float32 on the dequantized
    weights (tie-aware)."""
    from helpers import LOGIT_ATOL, allocated_reqs, assert_greedy_match, prefill_logits, run_generation, running_engine

    from minisgl.engine import engine as engine_mod
    from minisgl.layers import int4
    from minisgl.layers.linear import _Linear
    from minisgl.models import weight

    ck = quant_checkpoint(name)
    calls: List[int] = []
    said: List[str] = []
    op = int4.int4_linear
    monkeypatch.setattr(engine_mod, "keeps_int4", lambda device, deterministic, quantization: True)
    monkeypatch.setattr(int4, "int4_linear", lambda x, *a: calls.append(x.shape[0]) or op(x, *a))
    monkeypatch.setattr(weight.logger, "info_rank0", lambda msg, *args: said.append(msg))
    with running_engine(ck.quantized, device="cpu", cpu_fast_decode=False) as engine:
        mods = [m for m in engine.model.modules() if isinstance(m, _Linear)]
        assert mods and all(m.weight.dtype == torch.int32 and m.weight_zero is not None for m in mods)
        assert len(mods) == 4 * len(engine.model.model.layers)
        hf = path_oracle(ck.dense)
        logits = prefill_logits(engine, allocated_reqs(engine, PROMPTS, 1))
        for i, ids in enumerate(PROMPTS):
            diff = (logits[i] - hf.logits(ids)[-1]).abs().max().item()
            assert diff < LOGIT_ATOL, f"{name} prompt {i}: max |logit diff| {diff:.3g}"
        outs = run_generation(engine, allocated_reqs(engine, PROMPTS, STEPS), STEPS)
    for i, ids in enumerate(PROMPTS):
        ref, ref_logits = hf.greedy(ids, STEPS)
        assert assert_greedy_match(outs[i], ref, ref_logits, label=f"{name} prompt {i}") == STEPS
    assert len(calls) >= len(mods) * STEPS, "the projections did not run the int4 op"
    assert any(m.endswith("weights kept as int4 (W4A16 GEMM, activations in float32)") for m in said), said


def test_online_int4_layers_run_the_int4_op(quant_checkpoint, tmp_path) -> None:
    """`--quantization int4`'s conversion (models/weight.quantize_linears_int4, which the engine
    runs on CUDA) on a CPU engine in float32, through the op's torch implementation: tokens and
    logits match HF float32 on the same group-128 int4 weights (tests/test_int4_cuda.py's oracle)."""
    from helpers import LOGIT_ATOL, HFOracle, allocated_reqs, assert_greedy_match, prefill_logits, run_generation, running_engine
    from quant_helpers import online_int4_checkpoint

    from minisgl.models.weight import quantize_linears_int4

    ck = quant_checkpoint("awq")
    hf = HFOracle(online_int4_checkpoint(ck.dense, tmp_path))
    with running_engine(ck.dense, device="cpu", cpu_fast_decode=False) as engine:
        done = quantize_linears_int4(engine.model, torch.float32)
        assert len(done) == 4 * len(engine.model.model.layers)
        logits = prefill_logits(engine, allocated_reqs(engine, PROMPTS, 1))
        for i, ids in enumerate(PROMPTS):
            assert (logits[i] - hf.logits(ids)[-1]).abs().max().item() < LOGIT_ATOL
        outs = run_generation(engine, allocated_reqs(engine, PROMPTS, STEPS), STEPS)
    for i, ids in enumerate(PROMPTS):
        ref, ref_logits = hf.greedy(ids, STEPS)
        assert assert_greedy_match(outs[i], ref, ref_logits, label=f"online int4 prompt {i}") == STEPS


def test_moe_experts_are_dequantized(quant_checkpoint, monkeypatch) -> None:
    """A 4-bit Qwen3-MoE with int4 kept: attention projections hold int4 codes, the experts are
    dequantized (the fused MoE GEMM has no int4 path; logged) to the dense checkpoint's values."""
    from transformers import AutoConfig

    from minisgl.layers.linear import _Linear
    from minisgl.layers.rotary import rope_tables
    from minisgl.models import ModelConfig, create_model, weight
    from minisgl.utils.torch_utils import torch_dtype

    said: List[str] = []
    monkeypatch.setattr(weight.logger, "info_rank0", lambda msg, *args: said.append(msg))
    ck = quant_checkpoint("gptq_moe")
    cfg = ModelConfig.from_hf(AutoConfig.from_pretrained(ck.dense))
    cpu = torch.device("cpu")
    with rope_tables(cpu), torch.device("meta"), torch_dtype(torch.float32):
        model = create_model(cfg)
    ours = weight.load_weights(model, str(ck.quantized), cpu, torch.float32, keep_int4=True)
    ref = weight.load_weights(model, str(ck.dense), cpu, torch.float32)
    kept = [k for k, t in ours.items() if t.dtype == torch.int32]
    assert kept and all(isinstance(model.get_submodule(k.rpartition(".")[0]), _Linear) for k in kept)
    assert any("experts" in k for k in ref) and not any("experts" in k for k in kept)
    for key in ref:
        if key not in kept:
            torch.testing.assert_close(ours[key], ref[key], rtol=0, atol=1e-6, msg=key)
    assert any("int4 weights of" in m and "the fused MoE GEMM has no int4 path" in m for m in said), said


def test_int4_quantization_is_refused_where_it_cannot_run(tiny_dir) -> None:
    """The CPU's int4 is its decode GEMMs' (unchanged): refused where those cannot run, naming the flag."""
    from helpers import running_engine

    with pytest.raises(ValueError, match="quantization='int4' runs on the CPU decode path only"):
        with running_engine(tiny_dir, device="cpu", quantization="int4", cpu_fast_decode=False):
            pass
