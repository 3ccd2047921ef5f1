"""Quantized checkpoints, read through their own `quantization_config` (config.json); no flag.

Each quantized linear layer `P` of the checkpoint is a few tensors `P.<suffix>`; this module
groups them, checks their shapes against the format and turns them into one of two plain
forms, both exact restatements of the format's dequantization:

- `IntGroups` (AWQ, GPTQ, compressed-tensors `pack-quantized`): unsigned b-bit codes [out, in],
  a scale and a zero point per (output row, group of `group` inputs): w = scale * (code - zero);
- `Fp8Blocks` (`fp8`, compressed-tensors `float-quantized`): float8_e4m3fn values [out, in] and
  one float32 scale per (bo x bi) block (per-tensor: one block; per-channel: 1 x in):
  w = value * scale.

The formats, as their writers lay them out:

- `awq` (AutoAWQ GEMM, `version: gemm`, `zero_point: true`, 4 bits): qweight int32 [in, out/8]
  and qzeros int32 [in/group, out/8] packed along the output with AWQ's nibble order (nibble i
  of a word holds column [0, 2, 4, 6, 1, 3, 5, 7][i] of its 8), scales fp16 [in/group, out].
- `gptq` (4 or 8 bits, `sym` either way): qweight int32 [in * bits/32, out] packed along the
  input (nibble k of word r = input row r * 32/bits + k), qzeros int32 [in/group, out * bits/32]
  packed along the output in the same order, scales fp16 [in/group, out], g_idx int32 [in].
  `checkpoint_format: gptq` (v1, the default: AutoGPTQ / optimum) stores zero - 1 and every
  reader adds the 1 back (transformers' GPTQ backends convert v1 to v2 that way);
  `gptq_v2` (GPTQModel) stores the zero itself. Act-order (`desc_act: true`, a g_idx that is not
  `i // group`) is refused.
- `compressed-tensors` `pack-quantized` (int 4 or 8 bits, weight-only, group or channel
  strategy): weight_packed int32 [out, ceil(in * bits/32)] packed along the input in order, each
  code stored as value + 2^(bits-1); weight_scale [out, groups]; weight_zero_point (asymmetric
  only) packed the same way along the output, [ceil(out * bits/32), groups] (older writers: int8
  [out, groups]); weight_shape [2] = (out, in).
- `compressed-tensors` `float-quantized` (FP8 weights; tensor, channel, group or block
  strategy) and `quant_method: fp8` (`weight_block_size` [bo, bi] with `weight_scale_inv`
  [ceil(out/bo), ceil(in/bi)], the DeepSeek-V3 / Qwen3-FP8 layout; without a block size
  `weight_scale` per tensor or per output channel).

Activation scales (`input_scale`) and K/V scales (`k_scale`, `v_scale`) are not used: activations
run in the model dtype and the KV cache is `--kv-cache-dtype`'s; the loader says so once.
- `mxfp4` (GPT-OSS's experts, the OCP Microscaling format): for a fused expert tensor `P` of
  the unquantized layout [E, in, out], `P_blocks` uint8 [E, out, in / 32, 16] holds FP4 E2M1
  codes two per byte (the low nibble the even column, the high nibble the odd one) and
  `P_scales` uint8 [E, out, in / 32] one E8M0 exponent per 32 values: w = fp4(code) *
  2^(scale - 127), transposed back to [E, in, out] (`Mxfp4Blocks`). The other tensors (attention,
  router, biases) are plain.

What runs is decided by the loader (models/weight.py): every format is dequantized at load,
except FP8 linear layers on CUDA under `--quantization fp8`, which stay FP8 (layers/fp8.py, the
W8A8 FP8 GEMM); on the CPU at tp == 1 the 4-bit formats also keep their codes for the int4 decode
GEMM (`IntGroups.q4_1`, engine/cpu_decode.py).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, FrozenSet, Iterable, Iterator, List, Mapping, Tuple

import torch

UNUSED_SUFFIXES = frozenset({"input_scale", "k_scale", "v_scale"})
SUPPORTED_METHODS = ("awq", "gptq", "compressed-tensors", "fp8", "mxfp4")
# FP4 E2M1 by code: bit 3 the sign, bits 2-1 the exponent (bias 1), bit 0 the mantissa
FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_AWQ_NIBBLE_OF_COLUMN = (0, 4, 1, 5, 2, 6, 3, 7)  # column j of a word is nibble _AWQ_NIBBLE_OF_COLUMN[j]
FP8_E4M3 = torch.float8_e4m3fn


@dataclass
class IntGroups:
    """w[o, i] = scale[o, i // group] * (codes[o, i] - zero[o, i // group])."""

    codes: torch.Tensor  # [out, in] int32, unsigned codes in [0, 2^bits)
    scale: torch.Tensor  # [out, groups] float32
    zero: torch.Tensor  # [out, groups] float32, in the codes' unsigned domain
    group: int
    bits: int

    def dense(self) -> torch.Tensor:
        """The [out, in] float32 weight."""
        idx = torch.arange(self.codes.shape[1], device=self.codes.device) // self.group
        return (self.codes.float() - self.zero[:, idx]) * self.scale[:, idx]

    def q4_1(self) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(codes uint8 [out, in], d, m [out, in / 32]) for the int4 decode GEMM's Q4_1 blocks
        (w = d * code + m): the same codes, d = scale and m = -scale * zero, both rounded to
        fp16 (the block format's dtype: d is exact for an fp16 scale; m is exact for a power-of-two
        zero such as the symmetric 8 and rounds to fp16's 11 bits otherwise). None where the
        codes are not 4-bit or a 32-column block would straddle two groups."""
        k = self.codes.shape[1]
        if self.bits != 4 or self.group % 32 or k % 32:
            return None
        g = torch.arange(k // 32, device=self.codes.device) * 32 // self.group
        s, z = self.scale[:, g], self.zero[:, g]
        return self.codes.to(torch.uint8), s.half().float(), (-(s * z)).half().float()


@dataclass
class Fp8Blocks:
    """w[o, i] = weight[o, i] * scale[o // block[0], i // block[1]]."""

    weight: torch.Tensor  # [out, in] float8_e4m3fn
    scale: torch.Tensor  # [ceil(out / bo), ceil(in / bi)] float32
    block: Tuple[int, int]

    def dense(self) -> torch.Tensor:
        n, k = self.weight.shape
        bo, bi = self.block
        s = self.scale.repeat_interleave(bo, 0)[:n].repeat_interleave(bi, 1)[:, :k]
        return self.weight.float() * s


@dataclass
class Mxfp4Blocks:
    """w[..., o, i] = fp4(code of value i of row o) * 2^(scales[..., o, i // 32] - 127), returned
    transposed ([..., in, out]: the unquantized checkpoint tensor's layout)."""

    blocks: torch.Tensor  # [..., out, in / 32, 16] uint8, two codes per byte (low nibble first)
    scales: torch.Tensor  # [..., out, in / 32] uint8, E8M0 exponents (bias 127)

    def dense(self) -> torch.Tensor:
        lut = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32, device=self.blocks.device)
        b = self.blocks.to(torch.int64)
        codes = torch.stack([b & 0x0F, b >> 4], dim=-1).flatten(-2)  # [..., out, G, 32]
        scale = torch.exp2(self.scales.to(torch.float32) - 127.0)[..., None]
        w = (lut[codes] * scale).flatten(-2)  # [..., out, in]
        return w.transpose(-1, -2).contiguous()


Assembled = IntGroups | Fp8Blocks


# ---- packing ----------------------------------------------------------------------------------
def _unpack_cols(packed: torch.Tensor, bits: int, nibble_of_column: Tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 [r, c] -> [r, c * 32/bits] unsigned codes; column j of word w is field
    `nibble_of_column[j]` (field k = bits [k*bits, (k+1)*bits)), in order where None."""
    per = 32 // bits
    shifts = torch.arange(per, device=packed.device, dtype=torch.int32) * bits
    fields = (packed.to(torch.int32)[..., None] >> shifts) & ((1 << bits) - 1)
    if nibble_of_column is not None:
        fields = fields[..., list(nibble_of_column)]
    return fields.reshape(packed.shape[0], -1)


def _unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [r, c] packed along dim 0, in order -> [r * 32/bits, c]."""
    return _unpack_cols(packed.t(), bits).t()


def _expect(prefix: str, label: str, suffix: str, t: torch.Tensor, shape: Tuple[int, ...], dtypes: Tuple[torch.dtype, ...] = ()) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{label} checkpoint tensor {prefix}.{suffix} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    if dtypes and t.dtype not in dtypes:
        raise ValueError(f"{label} checkpoint tensor {prefix}.{suffix} is {t.dtype}, expected {' or '.join(map(str, dtypes))}")


def _group_of(group_size: Any, k: int) -> int:
    g = int(group_size) if group_size is not None else -1
    return k if g <= 0 else g


def _check_group_order(prefix: str, label: str, suffix: str, g_idx: torch.Tensor, group: int) -> None:
    want = torch.arange(g_idx.numel(), device=g_idx.device) // group
    if not torch.equal(g_idx.to(want.dtype).flatten(), want):
        raise ValueError(
            f"{label} checkpoint tensor {prefix}.{suffix} is not in group order (act-order / desc_act quantization): "
            "not supported; quantize with desc_act=false (static groups)"
        )


# ---- the formats ------------------------------------------------------------------------------
class QuantFormat:
    """One checkpoint's quantization format: which tensors make up a quantized linear layer,
    and how they become an `IntGroups` / `Fp8Blocks`."""

    label = ""
    suffixes: FrozenSet[str] = frozenset()  # the tensors of a quantized layer besides `weight`
    int4 = False  # whether the layers' codes may map onto the int4 decode GEMM (IntGroups.q4_1)

    def anchored(self, present: Mapping[str, torch.dtype]) -> bool:
        """Whether a layer with these tensors (suffix -> dtype) is quantized."""
        raise NotImplementedError

    def required(self, prefix: str) -> FrozenSet[str]:
        raise NotImplementedError

    def assemble(self, prefix: str, parts: Dict[str, torch.Tensor]) -> Assembled:
        raise NotImplementedError

    # -- streaming (models/weight.py feeds the checkpoint's tensors in file order) --
    def plan(self, index: Mapping[str, torch.dtype]) -> Dict[str, FrozenSet[str]]:
        """quantized layer prefix -> the suffixes of its tensors in the checkpoint (all files)."""
        by_prefix: Dict[str, Dict[str, torch.dtype]] = {}
        for name, dtype in index.items():
            prefix, _, suffix = name.rpartition(".")
            if suffix in self.suffixes or suffix == "weight":
                by_prefix.setdefault(prefix, {})[suffix] = dtype
        plan: Dict[str, FrozenSet[str]] = {}
        for prefix, present in by_prefix.items():
            if not self.anchored(present):
                continue
            missing = sorted(self.required(prefix) - present.keys())
            if missing:
                raise ValueError(f"{self.label} layer {prefix} has no {', '.join(f'{prefix}.{m}' for m in missing)} in the checkpoint")
            plan[prefix] = frozenset(present)
        return plan

    def stream(self, tensors: Iterable[Tuple[str, Any]], index: Mapping[str, torch.dtype], device: torch.device,
               only_quantized: bool = False) -> Iterator[Tuple[str, Any]]:  # fmt: skip
        """The checkpoint's tensors with each quantized layer's parts replaced by one
        (prefix, Assembled), read onto `device` as the last part arrives; unused scales are
        dropped; with `only_quantized` the other tensors are skipped unread."""
        plan = self.plan(index)
        pending: Dict[str, Dict[str, torch.Tensor]] = {}
        for name, tensor in tensors:
            prefix, _, suffix = name.rpartition(".")
            expected = plan.get(prefix)
            if expected is None or suffix not in expected:
                if suffix not in UNUSED_SUFFIXES and not only_quantized:
                    yield name, tensor
                continue
            bucket = pending.setdefault(prefix, {})
            bucket[suffix] = (tensor.read() if hasattr(tensor, "read") else tensor).to(device)
            if len(bucket) == len(expected):
                yield prefix, self.assemble(prefix, pending.pop(prefix))
        assert not pending, f"incomplete quantized layers: {sorted(pending)}"


class AwqFormat(QuantFormat):
    label = "AWQ"
    suffixes = frozenset({"qweight", "qzeros", "scales"})
    int4 = True

    def __init__(self, cfg: Mapping[str, Any]) -> None:
        bits = int(cfg.get("bits", cfg.get("w_bit", 4)))
        if bits != 4:
            raise ValueError(f"AWQ bits={bits} is not supported (supported: 4)")
        version = str(cfg.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"AWQ version={version!r} is not supported (supported: 'gemm', AutoAWQ's GEMM packing)")
        if cfg.get("zero_point", True) is not True:
            raise ValueError("AWQ zero_point=false is not supported (supported: zero_point=true)")
        self.group_size = cfg.get("group_size", cfg.get("q_group_size", 128))

    def anchored(self, present: Mapping[str, torch.dtype]) -> bool:
        return "qweight" in present

    def required(self, prefix: str) -> FrozenSet[str]:
        return self.suffixes

    def assemble(self, prefix: str, parts: Dict[str, torch.Tensor]) -> Assembled:
        qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
        k, n = qweight.shape[0], qweight.shape[1] * 8
        group = _group_of(self.group_size, k)
        if k % group:
            raise ValueError(f"AWQ layer {prefix}: in_features {k} is not a multiple of group_size {group}")
        _expect(prefix, self.label, "qweight", qweight, (k, n // 8), (torch.int32,))
        _expect(prefix, self.label, "qzeros", qzeros, (k // group, n // 8), (torch.int32,))
        _expect(prefix, self.label, "scales", scales, (k // group, n))
        codes = _unpack_cols(qweight, 4, _AWQ_NIBBLE_OF_COLUMN)  # [in, out]
        zeros = _unpack_cols(qzeros, 4, _AWQ_NIBBLE_OF_COLUMN)  # [groups, out]
        return IntGroups(codes.t().contiguous(), scales.float().t().contiguous(), zeros.float().t().contiguous(), group, 4)


class GptqFormat(QuantFormat):
    label = "GPTQ"
    suffixes = frozenset({"qweight", "qzeros", "scales", "g_idx"})

    def __init__(self, cfg: Mapping[str, Any]) -> None:
        self.bits = int(cfg.get("bits", 4))
        if self.bits not in (4, 8):
            raise ValueError(f"GPTQ bits={self.bits} is not supported (supported: 4, 8)")
        fmt = str(cfg.get("checkpoint_format", "gptq")).lower()
        if cfg.get("is_marlin_format") or fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"GPTQ checkpoint_format={'marlin' if cfg.get('is_marlin_format') else fmt!r} is not supported "
                             "(supported: 'gptq', 'gptq_v2')")  # fmt: skip
        self.zero_offset = 1 if fmt == "gptq" else 0  # v1 stores zero - 1
        self.desc_act = bool(cfg.get("desc_act", False))
        self.group_size = cfg.get("group_size", 128)
        self.int4 = self.bits == 4

    def anchored(self, present: Mapping[str, torch.dtype]) -> bool:
        return "qweight" in present

    def required(self, prefix: str) -> FrozenSet[str]:
        base = {"qweight", "qzeros", "scales"}
        return frozenset(base | {"g_idx"}) if self.desc_act else frozenset(base)

    def assemble(self, prefix: str, parts: Dict[str, torch.Tensor]) -> Assembled:
        qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
        per = 32 // self.bits
        k, n = qweight.shape[0] * per, qweight.shape[1]
        group = _group_of(self.group_size, k)
        if k % group:
            raise ValueError(f"GPTQ layer {prefix}: in_features {k} is not a multiple of group_size {group}")
        _expect(prefix, self.label, "qweight", qweight, (k // per, n), (torch.int32,))
        _expect(prefix, self.label, "qzeros", qzeros, (k // group, -(-n // per)), (torch.int32,))
        _expect(prefix, self.label, "scales", scales, (k // group, n))
        if "g_idx" in parts:
            _expect(prefix, self.label, "g_idx", parts["g_idx"], (k,))
            _check_group_order(prefix, self.label, "g_idx", parts["g_idx"], group)
        codes = _unpack_rows(qweight, self.bits)  # [in, out]
        zeros = _unpack_cols(qzeros, self.bits)[:, :n] + self.zero_offset  # [groups, out]
        return IntGroups(codes.t().contiguous(), scales.float().t().contiguous(), zeros.float().t().contiguous(), group, self.bits)


def _fp8_blocks(prefix: str, label: str, weight: torch.Tensor, suffix: str, scale: torch.Tensor, block: Tuple[int, int]) -> Fp8Blocks:
    if weight.dtype != FP8_E4M3:
        raise ValueError(f"{label} checkpoint tensor {prefix}.weight is {weight.dtype}; only float8_e4m3fn weights are supported")
    n, k = weight.shape
    bo, bi = block
    want = (-(-n // bo), -(-k // bi))
    if scale.numel() == 1 and want == (1, 1):
        scale = scale.reshape(1, 1)
    elif bi == k and scale.dim() == 1:
        scale = scale.reshape(-1, 1)  # per-channel scales written as [out]
    _expect(prefix, label, suffix, scale, want)
    return Fp8Blocks(weight, scale.float(), block)


class Fp8Format(QuantFormat):
    """quant_method fp8: block-wise (`weight_block_size`, `weight_scale_inv`) or per-tensor /
    per-channel (`weight_scale`) float8_e4m3fn weights."""

    suffixes = frozenset({"weight_scale_inv", "weight_scale"})

    def __init__(self, cfg: Mapping[str, Any]) -> None:
        fmt = str(cfg.get("fmt", "e4m3")).lower()
        if fmt != "e4m3":
            raise ValueError(f"fp8 fmt={fmt!r} is not supported (supported: 'e4m3')")
        block = cfg.get("weight_block_size")
        if block is not None and (len(block) != 2 or any(int(b) <= 0 for b in block)):
            raise ValueError(f"fp8 weight_block_size={block!r} is not supported (supported: [rows, columns])")
        self.block = (int(block[0]), int(block[1])) if block is not None else None
        self.label = f"FP8 ({self.block[0]}x{self.block[1]} blocks)" if self.block else "FP8"

    def anchored(self, present: Mapping[str, torch.dtype]) -> bool:
        return present.get("weight") in (FP8_E4M3, torch.float8_e5m2)

    def required(self, prefix: str) -> FrozenSet[str]:
        return frozenset({"weight", "weight_scale_inv" if self.block else "weight_scale"})

    def assemble(self, prefix: str, parts: Dict[str, torch.Tensor]) -> Assembled:
        w = parts["weight"]
        if self.block is not None:
            return _fp8_blocks(prefix, self.label, w, "weight_scale_inv", parts["weight_scale_inv"], self.block)
        s = parts["weight_scale"]
        block = (w.shape[0], w.shape[1]) if s.numel() == 1 else (1, w.shape[1])
        return _fp8_blocks(prefix, self.label, w, "weight_scale", s, block)


class Mxfp4Format(QuantFormat):
    """quant_method mxfp4: `P_blocks` + `P_scales` pairs (GPT-OSS's fused expert tensors), each
    pair one `Mxfp4Blocks` named `P`; any other tensor passes through."""

    label = "MXFP4"

    def __init__(self, cfg: Mapping[str, Any]) -> None:
        pass  # (modules_to_not_convert: those are stored plain and load as they are)

    def stream(self, tensors: Iterable[Tuple[str, Any]], index: Mapping[str, torch.dtype], device: torch.device,
               only_quantized: bool = False) -> Iterator[Tuple[str, Any]]:  # fmt: skip
        pending: Dict[str, Dict[str, torch.Tensor]] = {}
        for name, tensor in tensors:
            stem, _, kind = name.rpartition("_")
            if kind not in ("blocks", "scales") or index.get(name) != torch.uint8:
                if not only_quantized:
                    yield name, tensor
                continue
            bucket = pending.setdefault(stem, {})
            bucket[kind] = (tensor.read() if hasattr(tensor, "read") else tensor).to(device)
            if len(bucket) == 2:
                parts = pending.pop(stem)
                blocks, scales = parts["blocks"], parts["scales"]
                if blocks.dim() < 3 or blocks.shape[-1] != 16 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
                    raise ValueError(f"MXFP4 tensor {stem}: blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} "
                                     f"do not pair (blocks [..., out, in/32, 16], scales [..., out, in/32])")  # fmt: skip
                yield stem, Mxfp4Blocks(blocks, scales)
        if pending:
            stem, parts = next(iter(pending.items()))
            raise ValueError(
                f"MXFP4 tensor {stem} has {stem}_{next(iter(parts))} but no {stem}_{'scales' if 'blocks' in parts else 'blocks'}"
            )


@dataclass(frozen=True)
class _CtScheme:
    """One compressed-tensors config group, as this loader runs it."""

    kind: str  # "int" (pack-quantized) or "fp8" (float-quantized)
    bits: int
    symmetric: bool
    strategy: str
    group_size: int | None
    block: Tuple[int, int] | None
    targets: Tuple[str, ...]


class CompressedTensorsFormat(QuantFormat):
    suffixes = frozenset({"weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx"})

    def __init__(self, cfg: Mapping[str, Any]) -> None:
        top_format = cfg.get("format")
        status = cfg.get("quantization_status", "compressed")
        if status != "compressed":
            raise ValueError(f"compressed-tensors quantization_status={status!r} is not supported (supported: 'compressed')")
        sparsity = cfg.get("sparsity_config") or {}
        if sparsity and sparsity.get("format", "dense") != "dense":
            raise ValueError(f"compressed-tensors sparsity_config format={sparsity.get('format')!r} is not supported (dense only)")
        if cfg.get("transform_config"):
            raise ValueError("compressed-tensors transform_config (rotations) is not supported")
        groups = cfg.get("config_groups") or {}
        if not groups:
            raise ValueError("compressed-tensors quantization_config has no config_groups")
        self.schemes = [self._scheme(name, g, g.get("format") or top_format) for name, g in groups.items()]
        kinds = {s.kind for s in self.schemes}
        self.int4 = any(s.kind == "int" and s.bits == 4 for s in self.schemes)
        what = sorted(f"pack-quantized W{s.bits}A16" if s.kind == "int" else "float-quantized FP8" for s in self.schemes)
        self.label = "compressed-tensors " + " + ".join(dict.fromkeys(what))
        self._fp8 = "fp8" in kinds

    @staticmethod
    def _scheme(name: str, group: Mapping[str, Any], fmt: Any) -> _CtScheme:
        where = f"compressed-tensors config group {name!r}"
        w = group.get("weights")
        if not w:
            raise ValueError(f"{where} quantizes no weights (activation-only quantization is not supported)")
        typ, bits, strategy = str(w.get("type", "int")), int(w.get("num_bits", 0)), str(w.get("strategy", "tensor"))
        act = group.get("input_activations")
        if group.get("output_activations"):
            raise ValueError(f"{where}: output_activations quantization is not supported")
        if w.get("dynamic"):
            raise ValueError(f"{where}: dynamic weight quantization is not supported")
        actorder = w.get("actorder")
        if actorder not in (None, False, "weight", "static"):
            raise ValueError(f"{where}: actorder={actorder!r} (weight_g_idx) is not supported (supported: none, 'weight')")
        targets = tuple(str(t) for t in group.get("targets") or ("Linear",))
        if typ == "int":
            if act:
                raise ValueError(f"{where}: activation-quantized int{bits} (W{bits}A{act.get('num_bits')}) is not supported; "
                                 "weight-only pack-quantized W4A16/W8A16 is")  # fmt: skip
            if fmt != "pack-quantized":
                raise ValueError(f"{where}: format={fmt!r} for int weights is not supported (supported: 'pack-quantized')")
            if bits not in (4, 8):
                raise ValueError(f"{where}: num_bits={bits} is not supported (supported: 4, 8)")
            if strategy not in ("group", "channel"):
                raise ValueError(f"{where}: strategy={strategy!r} is not supported for int weights (supported: group, channel)")
            gs = w.get("group_size") if strategy == "group" else None
            if strategy == "group" and (gs is None or int(gs) <= 0):
                raise ValueError(f"{where}: strategy 'group' needs a positive group_size, got {gs!r}")
            return _CtScheme("int", bits, bool(w.get("symmetric", True)), strategy, int(gs) if gs else None, None, targets)
        if typ == "float":
            if bits != 8:
                raise ValueError(f"{where}: float num_bits={bits} (FP4 / NVFP4 / MXFP4) is not supported (supported: 8, FP8 e4m3)")
            if fmt not in ("float-quantized", "naive-quantized"):
                raise ValueError(f"{where}: format={fmt!r} for FP8 weights is not supported (supported: 'float-quantized')")
            if act and str(act.get("type", "float")) != "float":
                raise ValueError(f"{where}: {act.get('type')} activations with FP8 weights are not supported")
            if not w.get("symmetric", True):
                raise ValueError(f"{where}: asymmetric FP8 weights are not supported")
            block = None
            if strategy == "block":
                bs = w.get("block_structure")
                if not bs or len(bs) != 2:
                    raise ValueError(f"{where}: strategy 'block' needs block_structure [rows, columns], got {bs!r}")
                block = (int(bs[0]), int(bs[1]))
            elif strategy not in ("tensor", "channel", "group"):
                raise ValueError(
                    f"{where}: strategy={strategy!r} is not supported for FP8 weights (supported: tensor, channel, group, block)"
                )
            gs = w.get("group_size") if strategy == "group" else None
            return _CtScheme("fp8", 8, True, strategy, int(gs) if gs else None, block, targets)
        raise ValueError(f"{where}: weights type={typ!r} is not supported (supported: int, float)")

    def scheme_for(self, prefix: str) -> _CtScheme:
        """The config group whose targets name this layer: its exact name, then a `re:` pattern,
        then a class name (every quantized tensor here belongs to a Linear)."""
        if len(self.schemes) == 1:
            return self.schemes[0]
        for s in self.schemes:
            if prefix in s.targets:
                return s
        for s in self.schemes:
            if any(t.startswith("re:") and re.match(t[3:], prefix) for t in s.targets):
                return s
        for s in self.schemes:
            if "Linear" in s.targets:
                return s
        raise ValueError(f"compressed-tensors layer {prefix} matches no config group's targets")

    def anchored(self, present: Mapping[str, torch.dtype]) -> bool:
        return "weight_packed" in present or (self._fp8 and present.get("weight") in (FP8_E4M3, torch.float8_e5m2))

    def required(self, prefix: str) -> FrozenSet[str]:
        s = self.scheme_for(prefix)
        if s.kind == "fp8":
            return frozenset({"weight", "weight_scale"})
        return frozenset({"weight_packed", "weight_scale", "weight_shape"} | (set() if s.symmetric else {"weight_zero_point"}))

    def assemble(self, prefix: str, parts: Dict[str, torch.Tensor]) -> Assembled:
        s = self.scheme_for(prefix)
        label = self.label
        if s.kind == "fp8":
            if "weight" not in parts:
                raise ValueError(f"{label} layer {prefix} is packed ({prefix}.weight_packed) but its config group is FP8")
            w = parts["weight"]
            block = {"tensor": tuple(w.shape), "channel": (1, w.shape[1])}.get(s.strategy) or s.block or (1, s.group_size or w.shape[1])
            return _fp8_blocks(prefix, label, w, "weight_scale", parts["weight_scale"], (int(block[0]), int(block[1])))
        if "weight_packed" not in parts:
            raise ValueError(f"{label} layer {prefix} has no {prefix}.weight_packed but its config group is pack-quantized")
        packed, scale = parts["weight_packed"], parts["weight_scale"]
        n, k = (int(x) for x in parts["weight_shape"].flatten().tolist())
        per, offset = 32 // s.bits, 1 << (s.bits - 1)
        _expect(prefix, label, "weight_packed", packed, (n, -(-k // per)), (torch.int32,))
        group = s.group_size if s.strategy == "group" and s.group_size else k
        groups = -(-k // group)
        _expect(prefix, label, "weight_scale", scale, (n, groups))
        if "weight_g_idx" in parts:
            _check_group_order(prefix, label, "weight_g_idx", parts["weight_g_idx"], group)
        codes = _unpack_cols(packed, s.bits)[:, :k]
        if s.symmetric:
            zero = torch.full((n, groups), float(offset), device=packed.device)
        else:
            zp = parts["weight_zero_point"]
            if zp.dtype == torch.int32 and tuple(zp.shape) == (-(-n // per), groups):
                zero = _unpack_rows(zp, s.bits)[:n].float()  # packed along the output, stored + offset
            else:
                _expect(prefix, label, "weight_zero_point", zp, (n, groups), (torch.int8, torch.int32))
                zero = zp.float() + offset  # unpacked signed zero points (older writers)
        return IntGroups(codes.contiguous(), scale.float(), zero, group, s.bits)


def read_quantization_config(model_dir: str | Path) -> Dict[str, Any] | None:
    path = Path(model_dir) / "config.json"
    if not path.exists():
        return None
    cfg = json.loads(path.read_text()).get("quantization_config")
    return dict(cfg) if cfg else None


def quant_format(model_dir: str | Path) -> QuantFormat | None:
    """The checkpoint's quantization format from its config.json (None: not quantized);
    anything this loader cannot run exactly is refused here, naming the scheme."""
    cfg = read_quantization_config(model_dir)
    if cfg is None:
        return None
    method = str(cfg.get("quant_method", "")).lower()
    if method == "awq":
        return AwqFormat(cfg)
    if method == "gptq":
        return GptqFormat(cfg)
    if method == "compressed-tensors":
        return CompressedTensorsFormat(cfg)
    if method == "fp8":
        return Fp8Format(cfg)
    if method == "mxfp4":
        return Mxfp4Format(cfg)
    raise ValueError(f"quantization_config quant_method={method!r} is not supported (supported: {', '.join(SUPPORTED_METHODS)})")


QUANTIZED_TENSOR_SUFFIXES = ("qweight", "weight_packed", "weight_scale_inv")


def refuse_unannounced(index: Mapping[str, torch.dtype]) -> None:
    """A checkpoint without quantization_config must not hold quantized tensors (they would load
    wrong or fail obscurely): refuse the first one, naming it."""
    for name, dtype in index.items():
        mx = name.endswith("_blocks") and dtype == torch.uint8  # (MXFP4)
        if name.rpartition(".")[2] in QUANTIZED_TENSOR_SUFFIXES or dtype in (FP8_E4M3, torch.float8_e5m2) or mx:
            raise ValueError(f"checkpoint tensor {name} ({dtype}) is quantized but config.json has no quantization_config")


def unused_tensors(index: Mapping[str, torch.dtype]) -> List[str]:
    """The suffixes of the checkpoint's tensors this loader drops (activation and K/V scales)."""
    return sorted({n.rpartition(".")[2] for n in index} & UNUSED_SUFFIXES)
