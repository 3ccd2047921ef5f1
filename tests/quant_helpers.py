"""Quantized checkpoints written from tiny random HF models with each format's own math and layout
(AWQ, GPTQ, compressed-tensors, FP8), plus the dense HF checkpoints of their exact dequantized
weights (the oracle's): shared by tests/test_quant_checkpoints.py and the FP8 tests."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Tuple

import numpy as np
import torch
from helpers import build_tiny_model, random_prompts
from safetensors.torch import load_file, save_file

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


def ct_config(fmt: str, weights: Dict[str, Any], act: Dict[str, Any] | None = None) -> Dict[str, Any]:
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": act,
                                          "output_activations": None, "format": fmt}}}  # fmt: skip


def ct_int(group: int | None, sym: bool) -> Dict[str, Any]:
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
    "ct_w4a16_sym": Format("qwen3", ct_config("pack-quantized", ct_int(32, True)), lambda w: ct_pack(w, 32, True), int4=True),
    "ct_w4a16_asym": Format("llama", ct_config("pack-quantized", ct_int(None, False)),
                            lambda w: ct_pack(w, w.shape[1], False), int4=True),
    "ct_fp8_channel": Format("qwen3", ct_config("float-quantized", {"num_bits": 8, "type": "float", "symmetric": True,
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


# Formats only some tests build (kept out of FORMATS, which test_quant_checkpoints.py runs whole)
EXTRA_FORMATS: Dict[str, Format] = {
    # a 4-bit Qwen3-MoE, experts quantized too; per-channel (group_size -1: the experts' in_features is 48)
    "gptq_moe": Format("qwen3_moe", {"quant_method": "gptq", "bits": 4, "group_size": -1, "desc_act": False, "sym": True},
                       lambda w: gptq(w, w.shape[1], 4, True, True)),
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
    fmt = FORMATS[name] if name in FORMATS else EXTRA_FORMATS[name]
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


def online_int4_checkpoint(dense: Path, root: Path) -> Path:
    """An HF checkpoint of what `--quantization int4` makes of `dense` (layers/int4.quantize_groups
    of each projection, dequantized: per row, so the same as quantizing merged q/k/v and gate/up)."""
    from minisgl.layers.int4 import ONLINE_GROUP, quantize_groups

    state = load_file(str(dense / "model.safetensors"))
    for key, w in state.items():
        if key.endswith(".weight") and key.removesuffix(".weight").rpartition(".")[2] in PROJ:
            state[key] = quantize_groups(w.float(), ONLINE_GROUP).dense()
    return _write(dense, root / "online_int4", state, None)
