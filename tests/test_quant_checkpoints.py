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

import functools
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import numpy as np
import pytest
import torch
from helpers import (
    LOGIT_ATOL,
    TEST_DEVICE,
    HFOracle,
    allocated_reqs,
    assert_greedy_match,
    build_tiny_model,
    prefill_logits,
    random_prompts,
    record_runners,
    run_generation,
    running_engine,
)
from safetensors.torch import load_file, save_file

from minisgl.layers.quant import Int4Weight, QuantLinear
from minisgl.models.checkpoint_quant import quant_format

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MERGED = {"self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"), "mlp.gate_up_proj": ("gate_proj", "up_proj")}
PROMPTS = random_prompts([7, 12], seed=5)
STEPS = 8
FP8_MAX = 448.0


# ---- the formats' own math --------------------------------------------------------------------
def _per_group(w: torch.Tensor, group: int) -> torch.Tensor:
    """[out, in] -> [out, in / group, group]."""
    return w.reshape(w.shape[0], -1, group)


def _expand(t: torch.Tensor, group: int) -> torch.Tensor:
    return t.repeat_interleave(group, dim=1)


def _asym(w: torch.Tensor, group: int, bits: int, scale_dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """min/max asymmetric quantization: (codes [out, in] in [0, 2^b), scale, zero [out, groups])."""
    qmax = 2**bits - 1
    g = _per_group(w, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo).clamp(min=1e-5) / qmax).to(scale_dtype).float()
    zero = torch.clamp(torch.round(-lo / scale), 0, qmax)
    codes = torch.clamp(torch.round(w / _expand(scale, group)) + _expand(zero, group), 0, qmax)
    return codes.long(), scale, zero.long()


def _sym(w: torch.Tensor, group: int, bits: int, scale_dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """symmetric quantization around 2^(b-1): (codes in [0, 2^b), scale, zero = 2^(b-1))."""
    mid = 2 ** (bits - 1)
    g = _per_group(w, group)
    scale = (g.abs().amax(-1).clamp(min=1e-5) / (mid - 0.5)).to(scale_dtype).float()
    codes = torch.clamp(torch.round(w / _expand(scale, group)) + mid, 0, 2**bits - 1)
    return codes.long(), scale, torch.full_like(scale, mid).long()


def _words(fields: np.ndarray, bits: int) -> torch.Tensor:
    """[..., 32/bits] unsigned fields, field k at bits [k*bits, (k+1)*bits) -> int32 words."""
    shifts = np.arange(fields.shape[-1], dtype=np.uint64) * bits
    words = (fields.astype(np.uint64) << shifts).sum(-1).astype(np.uint32)
    return torch.from_numpy(words.view(np.int32).copy())


def pack_in_order(v: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack along the last dim, value j of each word in field j (GPTQ, compressed-tensors)."""
    a = v.numpy()
    per = 32 // bits
    pad = -a.shape[-1] % per
    a = np.pad(a, ((0, 0), (0, pad)))
    return _words(a.reshape(a.shape[0], -1, per), bits)


AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # field i of a word holds column AWQ_PACK_ORDER[i] of its 8


def pack_awq(v: torch.Tensor) -> torch.Tensor:
    a = v.numpy().reshape(v.shape[0], -1, 8)
    return _words(a[..., AWQ_PACK_ORDER], 4)


@dataclass
class Quantized:
    """One layer in its format: the checkpoint's tensors and what this file computes from them."""

    tensors: Dict[str, torch.Tensor]
    dense: torch.Tensor  # [out, in] float32: the format's dequantization
    codes: torch.Tensor | None = None  # [out, in] unsigned 4-bit codes (int formats)
    scale: torch.Tensor | None = None  # [out, groups]
    zero: torch.Tensor | None = None  # [out, groups], unsigned domain
    group: int = 0

    def q4_1(self) -> torch.Tensor:
        """The int4 decode GEMM's values: d * code + m per 32 columns, d = fp16(scale),
        m = fp16(-scale * zero) (docs/MODELS.md)."""
        assert self.codes is not None and self.scale is not None and self.zero is not None
        d, m = _expand(self.scale, self.group).half().float(), (-_expand(self.scale * self.zero, self.group)).half().float()
        return self.codes.float() * d + m


def _int_layer(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int, tensors: Dict[str, torch.Tensor]) -> Quantized:
    dense = (codes.float() - _expand(zero.float(), group)) * _expand(scale, group)
    return Quantized(tensors, dense, codes, scale, zero, group)


def awq(w: torch.Tensor, group: int) -> Quantized:
    codes, scale, zero = _asym(w, group, 4, torch.float16)
    tensors = {"qweight": pack_awq(codes.t().contiguous()), "qzeros": pack_awq(zero.t().contiguous()),
               "scales": scale.t().contiguous().half()}  # fmt: skip
    return _int_layer(codes, scale, zero, group, tensors)


def gptq(w: torch.Tensor, group: int, bits: int, sym: bool, v1: bool) -> Quantized:
    codes, scale, zero = (_sym if sym else _asym)(w, group, bits, torch.float16)
    stored_zero = zero - 1 if v1 else zero  # v1 stores zero - 1
    assert (stored_zero >= 0).all()
    tensors = {
        "qweight": _pack_rows(codes.t(), bits),
        "qzeros": pack_in_order(stored_zero.t().contiguous(), bits),
        "scales": scale.t().contiguous().half(),
        "g_idx": (torch.arange(w.shape[1]) // group).to(torch.int32),
    }
    return _int_layer(codes, scale, zero, group, tensors)


def _pack_rows(v: torch.Tensor, bits: int) -> torch.Tensor:
    """[in, out] -> [in * bits/32, out]: GPTQ's qweight, 32/bits input rows per word, in order."""
    return pack_in_order(v.t().contiguous(), bits).t().contiguous()


def ct_pack(w: torch.Tensor, group: int, sym: bool) -> Quantized:
    codes, scale, zero = (_sym if sym else _asym)(w, group, 4, torch.bfloat16)
    tensors = {"weight_packed": pack_in_order(codes, 4), "weight_scale": scale.bfloat16(),
               "weight_shape": torch.tensor(list(w.shape), dtype=torch.int64)}  # fmt: skip
    if not sym:  # zero points packed along the output dim
        tensors["weight_zero_point"] = pack_in_order(zero.t().contiguous(), 4).t().contiguous()
    return _int_layer(codes, scale, zero, group, tensors)


def fp8_blocks(
    w: torch.Tensor, bo: int, bi: int, scale_dtype: torch.dtype = torch.float32
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, scale [ceil(out/bo), ceil(in/bi)], dense) with amax / 448 per block."""
    n, k = w.shape
    scale = torch.zeros(-(-n // bo), -(-k // bi))
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            scale[i, j] = w[i * bo : (i + 1) * bo, j * bi : (j + 1) * bi].abs().amax() / FP8_MAX
    scale = scale.to(scale_dtype).float()
    full = scale.repeat_interleave(bo, 0)[:n].repeat_interleave(bi, 1)[:, :k]
    q = (w / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale.to(scale_dtype), q.float() * full


def fp8_block_layer(w: torch.Tensor, block: Tuple[int, int]) -> Quantized:
    q, s, dense = fp8_blocks(w, *block)
    return Quantized({"weight": q, "weight_scale_inv": s}, dense)


def fp8_tensor_layer(w: torch.Tensor) -> Quantized:
    q, s, dense = fp8_blocks(w, *w.shape)
    return Quantized({"weight": q, "weight_scale": s.reshape(()), "input_scale": torch.tensor(0.02)}, dense)


def ct_fp8_channel_layer(w: torch.Tensor) -> Quantized:
    q, s, dense = fp8_blocks(w, 1, w.shape[1], torch.bfloat16)
    return Quantized({"weight": q, "weight_scale": s}, dense)


def _ct_config(fmt: str, weights: Dict[str, Any], act: Dict[str, Any] | None = None) -> Dict[str, Any]:
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": act,
                                          "output_activations": None, "format": fmt}}}  # fmt: skip


def _ct_int(group: int | None, sym: bool) -> Dict[str, Any]:
    return {"num_bits": 4, "type": "int", "symmetric": sym, "strategy": "group" if group else "channel", "group_size": group,
            "dynamic": False, "actorder": None, "observer": "minmax"}  # fmt: skip


@dataclass(frozen=True)
class Format:
    arch: str
    config: Dict[str, Any]
    quantize: Callable[[torch.Tensor], Quantized]
    int4: bool = False  # runs the CPU int4 decode GEMM under quantization="auto"
    extra: Dict[str, Any] = field(default_factory=dict)


FORMATS: Dict[str, Format] = {
    "awq": Format("llama", {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
                  lambda w: awq(w, 128), int4=True),
    "gptq_sym_v1": Format("qwen3", {"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": False, "sym": True,
                                    "checkpoint_format": "gptq"}, lambda w: gptq(w, 64, 4, True, True), int4=True),
    "gptq_asym_v2": Format("llama", {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": False,
                                     "checkpoint_format": "gptq_v2"}, lambda w: gptq(w, 32, 4, False, False), int4=True),
    "gptq_8bit": Format("llama", {"quant_method": "gptq", "bits": 8, "group_size": 64, "desc_act": False, "sym": True},
                        lambda w: gptq(w, 64, 8, True, True)),
    "ct_w4a16_sym": Format("qwen3", _ct_config("pack-quantized", _ct_int(32, True)), lambda w: ct_pack(w, 32, True), int4=True),
    "ct_w4a16_asym": Format("llama", _ct_config("pack-quantized", _ct_int(None, False)),
                            lambda w: ct_pack(w, w.shape[1], False), int4=True),
    "ct_fp8_channel": Format("qwen3", _ct_config("float-quantized", {"num_bits": 8, "type": "float", "symmetric": True,
                                                                     "strategy": "channel", "dynamic": False},
                                                 {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token",
                                                  "dynamic": True}), ct_fp8_channel_layer),
    "fp8_block": Format("qwen3", {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128]}, lambda w: fp8_block_layer(w, (128, 128))),
    "fp8_block_moe": Format("qwen3_moe", {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                          "weight_block_size": [128, 128]}, lambda w: fp8_block_layer(w, (128, 128))),
    "fp8_block_ragged": Format("llama", {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                         "weight_block_size": [48, 80]}, lambda w: fp8_block_layer(w, (48, 80))),
    "fp8_tensor_static": Format("llama", {"quant_method": "fp8", "activation_scheme": "static"}, fp8_tensor_layer),
}  # fmt: skip


@dataclass
class Checkpoint:
    quantized: Path  # the format's checkpoint
    dense: Path  # HF checkpoint of the exact dequantized weights (the oracle's)
    q4_1: Path | None  # HF checkpoint of the int4 GEMM's values, where they differ from `dense`
    layers: Dict[str, Quantized]  # checkpoint layer prefix -> its quantization


def _write(src: Path, dst: Path, state: Dict[str, torch.Tensor], quantization_config: Dict[str, Any] | None) -> Path:
    shutil.copytree(src, dst)
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    if quantization_config is not None:
        cfg["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def build_checkpoint(name: str, root: Path, **config_changes: Any) -> Checkpoint:
    fmt = FORMATS[name]
    base = build_tiny_model(fmt.arch, root / "base", seed=3, hidden_size=128, intermediate_size=256)
    state = load_file(str(base / "model.safetensors"))
    quant_state, dense_state, q4_state, layers = {}, {}, {}, {}
    for key, w in state.items():
        prefix = key.removesuffix(".weight")
        if key.endswith(".weight") and prefix.rpartition(".")[2] in PROJ:
            q = fmt.quantize(w.float())
            layers[prefix] = q
            quant_state.update({f"{prefix}.{s}": t for s, t in q.tensors.items()})
            dense_state[key] = q.dense
            q4_state[key] = q.q4_1() if fmt.int4 else q.dense
        else:
            quant_state[key] = dense_state[key] = q4_state[key] = w
    config = {**fmt.config, **config_changes}
    exact_q4 = all(torch.equal(q4_state[k], dense_state[k]) for k in dense_state)
    return Checkpoint(
        quantized=_write(base, root / "quantized", quant_state, config),
        dense=_write(base, root / "dense", dense_state, None),
        q4_1=None if exact_q4 else _write(base, root / "q4_1", q4_state, None),
        layers=layers,
    )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Checkpoint]:
    cache: Dict[str, Checkpoint] = {}

    def get(name: str) -> Checkpoint:
        if name not in cache:
            cache[name] = build_checkpoint(name, tmp_path_factory.mktemp(name))
        return cache[name]

    return get


@pytest.fixture(scope="module")
def oracle() -> Callable[[Path], HFOracle]:
    return functools.cache(HFOracle)


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
def test_dequantized_checkpoint_matches_hf(name, checkpoint, oracle, monkeypatch):
    from minisgl.models import weight

    ck = checkpoint(name)
    said: List[str] = []
    monkeypatch.setattr(weight.logger, "info_rank0", lambda msg, *args: said.append(msg))
    with running_engine(ck.quantized, quantization="none") as engine:
        assert all(g is None or g.quant is None for g in _gemms(engine))
        _check_against(engine, oracle(ck.dense), name)
    assert any(msg.endswith("weights dequantized to float32 at load") for msg in said), said


def _gemms(engine: Any) -> List[QuantLinear | None]:
    return [getattr(m, "cpu_gemm", None) for _, m in engine.model.named_modules() if hasattr(m, "cpu_gemm")]


# ---- (c) the 4-bit formats' own codes on the CPU int4 decode GEMM -----------------------------
@pytest.mark.skipif(TEST_DEVICE != "cpu", reason="the int4 decode GEMM is the CPU's")
@pytest.mark.parametrize("name", sorted(n for n, f in FORMATS.items() if f.int4))
def test_int4_codes_run_the_cpu_int4_gemm(name, checkpoint, oracle, monkeypatch):
    ck = checkpoint(name)
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
        _check_against(engine, oracle(ck.q4_1 or ck.dense), f"{name} (int4 GEMM)")
    assert calls and max(calls) <= len(PROMPTS), "the decode steps did not run the int4 GEMM"


@pytest.mark.skipif(TEST_DEVICE != "cpu", reason="the int4 decode GEMM is the CPU's")
def test_bf16_awq_decodes_on_the_c_int4_kernel(checkpoint, oracle):
    """bf16 on a CPU with the C kernels: the AWQ codes' records are what the C decode loop
    streams (qgemv.c), and every token it picks is in the top 5 of HF float32 on the Q4_1 values
    (fed our tokens) until a first divergence from HF's own argmax."""
    from minisgl.engine.cpu_decode import CpuDecodeLoop
    from minisgl.kernel.cpu import cpu_kernels

    kern = cpu_kernels()
    if kern is None or not kern.has_qgemv:
        pytest.skip("no C compiler or no AVX512-BF16 here")
    ck = checkpoint("awq")
    with running_engine(ck.quantized, dtype=torch.bfloat16) as engine:
        assert isinstance(engine.cpu_runner, CpuDecodeLoop), "the C decode loop was not built"
        gemm = engine.model.model.layers[0].mlp.down_proj.cpu_gemm
        assert isinstance(gemm.quant, Int4Weight) and gemm.qgemv is not None
        log = record_runners(engine)
        outs = run_generation(engine, allocated_reqs(engine, PROMPTS, STEPS), STEPS)
    assert ("CpuDecodeLoop", "decode") in log
    hf = oracle(ck.q4_1)
    for ids, out in zip(PROMPTS, outs):
        logits = hf.logits(list(ids) + out[:-1])[len(ids) - 1 :]
        for j, tok in enumerate(out):
            assert tok in logits[j].topk(5).indices.tolist(), f"token {j} ({tok}) not in HF's top 5"
            if tok != int(logits[j].argmax()):
                break


# ---- tensor parallelism: dequantize, then shard -----------------------------------------------
@pytest.mark.parametrize("name", ["awq", "fp8_block_ragged"])
def test_tp2_shards_are_the_dense_checkpoints_shards(name, checkpoint):
    from transformers import AutoConfig

    from minisgl.distributed import set_tp_info
    from minisgl.distributed.info import clear_tp_info
    from minisgl.layers.rotary import rope_tables
    from minisgl.models import ModelConfig, create_model
    from minisgl.models.weight import load_weights
    from minisgl.utils.torch_utils import torch_dtype

    ck = checkpoint(name)
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
        (_ct_config("int-quantized", {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
                    {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}),
         "activation-quantized int8"),
        (_ct_config("nvfp4-pack-quantized", {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}),
         "FP4"),
        (_ct_config("pack-quantized", {**_ct_int(128, True), "num_bits": 2}), "num_bits=2 is not supported"),
        (_ct_config("pack-quantized", {**_ct_int(128, True), "actorder": "group"}), "actorder='group'"),
        (_ct_config("marlin-24", _ct_int(128, True)), "format='marlin-24'"),
    ],
)  # fmt: skip
def test_unsupported_schemes_are_refused_by_name(config, match, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": config}))
    with pytest.raises(ValueError, match=match):
        quant_format(tmp_path)


def test_act_order_gptq_is_refused(checkpoint, tmp_path):
    ck = checkpoint("gptq_sym_v1")
    prefix = next(iter(ck.layers))
    k = ck.layers[prefix].codes.shape[1]  # type: ignore[union-attr]
    g_idx = (torch.randperm(k, generator=torch.Generator().manual_seed(0)) // 64).to(torch.int32)
    cfg = {**FORMATS["gptq_sym_v1"].config, "desc_act": True}
    path = _with_config(ck, tmp_path, cfg, change={f"{prefix}.g_idx": g_idx})
    with pytest.raises(ValueError, match=rf"{prefix}.g_idx is not in group order \(act-order"):
        with running_engine(path):
            pass


def test_broken_checkpoints_are_refused(checkpoint, tmp_path):
    ck = checkpoint("awq")
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


def test_dummy_weights_need_no_quantized_tensors(checkpoint, tmp_path):
    """--load-format dummy on a quantized checkpoint's config alone: random dense weights, no
    codes to read (the CPU int4 path is skipped)."""
    shutil.copy(checkpoint("awq").quantized / "config.json", tmp_path / "config.json")
    with running_engine(tmp_path, use_dummy_weight=True) as engine:
        assert all(g is None or g.quant is None for g in _gemms(engine))
        assert len(run_generation(engine, allocated_reqs(engine, PROMPTS[:1], 2), 2)[0]) == 2


def test_only_whole_32_column_blocks_of_4_bit_codes_map_onto_q4_1():
    from minisgl.models.checkpoint_quant import IntGroups

    codes, ones = torch.randint(0, 16, (8, 96), dtype=torch.int32), torch.ones(8, 3)
    assert IntGroups(codes, ones, ones, 32, 4).q4_1() is not None
    assert IntGroups(codes, ones[:, :2], ones[:, :2], 48, 4).q4_1() is None  # a block would straddle two groups
    assert IntGroups(codes, ones, ones, 32, 8).q4_1() is None  # 8-bit codes
