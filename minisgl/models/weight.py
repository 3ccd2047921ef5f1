"""Stream checkpoint tensors into this rank's shards.

Peak memory matters (a 14B model in bf16 is 28 GB): tensors are read one at a time straight
from the file into their own buffers (no mmap, whose resident pages would count a second copy);
a sharded parameter reads only this rank's slice (CheckpointTensor.narrow), so at tp=N a rank
reads and holds about 1/N of the checkpoint; each piece is cast and moved to the device; merged
parameters (q/k/v, gate/up, experts) wait only until their last part arrives. A checkpoint tensor
that already holds several parts (Phi-3's qkv_proj and gate_up_proj: `Fused`) is split into its
parts first, each then sharded like a separate tensor (rank r takes its heads of q, of k and of v).

A quantized checkpoint (config.json's `quantization_config`: models/checkpoint_quant.py) streams
the same way, each quantized layer's tensors (packed codes, scales, zero points) gathered until its
last one arrives, dequantized to float32 on the load device and then treated as that layer's
dense `weight`: cast, sharded (at tp=N each rank reads the whole quantized matrix, dequantizes it
and keeps its slice) and merged like any other. With `keep_fp8` (CUDA) an FP8 layer of a linear
module stays FP8 instead: an `Fp8Weight` (layers/fp8.py) sharded and merged with its scales,
whose scales are installed on the module and whose float8 weight goes into the state dict; a cut
off its 128-column groups, or a module that is not a linear layer (MoE experts), dequantizes
it. With `keep_int4` (CUDA) a 4-bit layer (AWQ, GPTQ, compressed-tensors) of a linear module keeps
its codes the same way: an `Int4Packed` (layers/int4.py) sharded and merged with its scales and
zeros, whose packed codes go into the state dict as `weight`; a cut inside a group, a group
size the W4A16 GEMM does not take, or MoE experts (the fused MoE GEMM has no int4 path)
dequantize it. `load_int4_codes` reads a 4-bit checkpoint's codes a second time for the CPU's int4 decode
GEMM (tp == 1).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Dict, Iterator, List, Sequence, Tuple, cast

import torch
from torch import nn

from minisgl.layers.base import ShardedModule
from minisgl.layers.fp8 import FP8_E4M3, GROUP_K, Fp8Unaligned, Fp8Weight, quantize_per_row
from minisgl.layers.int4 import ONLINE_GROUP, Int4Packed, Int4Unaligned
from minisgl.layers.int4 import quantize_groups as quantize_int4_groups
from minisgl.layers.linear import _Linear
from minisgl.layers.quant import Int4Weight
from minisgl.models.checkpoint_quant import Fp8Blocks, IntGroups, Mxfp4Blocks, quant_format, refuse_unannounced, unused_tensors
from minisgl.utils.logger import init_logger

logger = init_logger(__name__)

_ST_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


class CheckpointTensor:
    """One tensor of an open safetensors file, not read yet. A layer's `shard()` receives it as
    `full` and slices it with `narrow` (through `narrow_rank`), which reads only this rank's
    bytes from the file: at tp=N a rank never holds more than its 1/N of a sharded tensor.
    `read()` reads the whole tensor (replicated parameters)."""

    BLOCK_BYTES = 8 << 20  # a slice along dim > 0 is gathered from row blocks of at most this

    def __init__(self, f: BinaryIO, path: Path, name: str, offset: int, nbytes: int, shape: List[int], dtype: torch.dtype) -> None:
        self._f: Any = f  # a buffered binary file: readinto fills tensors in place
        self._path, self.name = path, name
        self._offset, self._nbytes = offset, nbytes
        self.shape = torch.Size(shape)
        self.dtype = dtype
        if self.shape.numel() * dtype.itemsize != nbytes:
            raise ValueError(
                f"{path.name}: tensor {name} has {nbytes} bytes, its shape {shape} needs {self.shape.numel() * dtype.itemsize}"
            )

    def is_floating_point(self) -> bool:
        return self.dtype.is_floating_point

    def numel(self) -> int:
        return self.shape.numel()

    def new_zeros(self, shape: Sequence[int]) -> torch.Tensor:
        return torch.zeros(tuple(shape), dtype=self.dtype)

    def _read_rows(self, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of dim 0 (contiguous in the file), in fresh memory."""
        row_bytes = self._nbytes // self.shape[0] if self.shape[0] else 0
        out = torch.empty((stop - start, *self.shape[1:]), dtype=self.dtype)
        n = (stop - start) * row_bytes
        if n:
            self._f.seek(self._offset + start * row_bytes)
            view = out.view(-1).view(torch.uint8).numpy()
            if self._f.readinto(memoryview(view)) != n:  # type: ignore[arg-type]
                raise ValueError(f"{self._path.name}: tensor {self.name} is truncated")
        return out

    def read(self) -> torch.Tensor:
        if self.shape.numel() == 0 or len(self.shape) == 0:
            out = torch.empty(self.shape, dtype=self.dtype)
            if self._nbytes:
                self._f.seek(self._offset)
                buffer = memoryview(out.view(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
                if self._f.readinto(buffer) != self._nbytes:
                    raise ValueError(f"{self._path.name}: tensor {self.name} is truncated")
            return out
        return self._read_rows(0, self.shape[0])

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        dim = dim % len(self.shape)
        if length == 0:
            shape = list(self.shape)
            shape[dim] = 0
            return torch.empty(shape, dtype=self.dtype)
        if not 0 <= start <= start + length <= self.shape[dim]:
            raise IndexError(f"narrow({dim}, {start}, {length}) outside {tuple(self.shape)} of {self.name}")
        if dim == 0:
            return self._read_rows(start, start + length)
        if start == 0 and length == self.shape[dim]:
            return self.read()  # tp=1: the whole tensor, no block copies
        shape = list(self.shape)
        shape[dim] = length
        out = torch.empty(shape, dtype=self.dtype)
        row_bytes = max(1, self._nbytes // max(1, self.shape[0]))
        step = max(1, self.BLOCK_BYTES // row_bytes)
        for i in range(0, self.shape[0], step):
            j = min(i + step, self.shape[0])
            out[i:j].copy_(self._read_rows(i, j).narrow(dim, start, length))
        return out

    def rows(self, start: int, length: int) -> "CheckpointTensor":
        """Rows [start, start + length) of dim 0, still unread (they are contiguous in the file)."""
        if not 0 <= start <= start + length <= self.shape[0]:
            raise IndexError(f"rows({start}, {length}) outside {tuple(self.shape)} of {self.name}")
        row_bytes = self._nbytes // self.shape[0] if self.shape[0] else 0
        shape = [length, *self.shape[1:]]
        return CheckpointTensor(self._f, self._path, self.name, self._offset + start * row_bytes, length * row_bytes, shape, self.dtype)


@dataclass(frozen=True)
class Fused:
    """The `part` of a checkpoint tensor that stacks several parts of one merged parameter on dim 0,
    in file order: ((part, rows in the checkpoint), ...), e.g. (("q", 3072), ("k", 3072), ("v", 3072))."""

    parts: Tuple[Tuple[Any, int], ...]

    def split(self, full: Any) -> List[Tuple[Any, Any]]:
        """(part, its rows of `full`) for each part; nothing is read from the file yet."""
        total = sum(n for _, n in self.parts)
        if full.shape[0] != total:
            raise ValueError(
                f"fused checkpoint tensor {getattr(full, 'name', '')!r} has {full.shape[0]} rows, its parts "
                f"{', '.join(f'{p}: {n}' for p, n in self.parts)} need {total}"
            )
        out, start = [], 0
        for part, n in self.parts:
            out.append((part, full.rows(start, n) if isinstance(full, CheckpointTensor) else full.narrow(0, start, n)))
            start += n
        return out


def _read_header(f: BinaryIO, path: Path) -> Tuple[int, List[Tuple[str, torch.dtype, Dict[str, Any]]]]:
    """(offset of the data, [(name, dtype, header entry)] in file order) of an open .safetensors file."""
    (header_len,) = struct.unpack("<Q", f.read(8))
    header = json.loads(f.read(header_len))
    header.pop("__metadata__", None)
    out = []
    for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        dtype = _ST_DTYPES.get(info["dtype"])
        if dtype is None:
            raise ValueError(f"{path.name}: tensor {name} has unsupported dtype {info['dtype']}")
        out.append((name, dtype, info))
    return 8 + header_len, out


def iter_checkpoint(path: Path) -> Iterator[Tuple[str, CheckpointTensor]]:
    """Yield (name, CheckpointTensor) of one .safetensors file in file order; nothing is read
    until a tensor is narrowed or read (the file stays open meanwhile)."""
    with open(path, "rb") as f:
        base, entries = _read_header(f, path)
        for name, dtype, info in entries:
            start, end = info["data_offsets"]
            yield name, CheckpointTensor(f, path, name, base + start, end - start, info["shape"], dtype)


def checkpoint_index(files: Sequence[Path]) -> Dict[str, torch.dtype]:
    """name -> dtype of every tensor of the checkpoint (headers only)."""
    out: Dict[str, torch.dtype] = {}
    for path in files:
        with open(path, "rb") as f:
            out.update((name, dtype) for name, dtype, _ in _read_header(f, path)[1])
    return out


def _iter_files(files: Sequence[Path]) -> Iterator[Tuple[str, CheckpointTensor]]:
    for file in files:
        yield from iter_checkpoint(file)


def iter_safetensors(path: Path) -> Iterator[Tuple[str, torch.Tensor]]:
    """Yield (name, tensor) from one .safetensors file, reading each tensor into fresh memory."""
    for name, lazy in iter_checkpoint(path):
        yield name, lazy.read()


def checkpoint_files(model_dir: str) -> list[Path]:
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors weights in {model_dir!r}; convert the checkpoint to safetensors "
            "or pass use_dummy_weight=True for a benchmark"
        )
    return files


def _pieces(model: nn.Module, ckpt_name: str, full: Any) -> Tuple[str, Any, str, List[Tuple[Any, Any]]] | None:
    """(our parameter name, its module, the parameter's name in it, [(part, tensor)]) of a
    checkpoint tensor (a fused one split into its parts), or None where the model skips it."""
    mapped = model.map_weight_name(ckpt_name)  # type: ignore[operator]
    if mapped is None:
        return None
    name, fused_or_part = mapped
    module_path, _, param_name = name.rpartition(".")
    try:
        module: Any = model.get_submodule(module_path)  # a ShardedModule (parts/shard/merge)
    except AttributeError:
        raise ValueError(f"checkpoint weight {ckpt_name!r} does not belong to {type(model).__name__}") from None
    pieces = fused_or_part.split(full) if isinstance(fused_or_part, Fused) else [(fused_or_part, full)]
    return name, module, param_name, pieces


# The quantized layouts a linear layer may keep (layers/fp8.py, layers/int4.py), and what each
# raises where a cut or a group leaves it no layout (the layer is then dequantized)
Kept = Fp8Weight | Int4Packed
_KEPT = (Fp8Weight, Int4Packed)
_UNALIGNED = (Fp8Unaligned, Int4Unaligned)


def _kind(t: Kept) -> str:
    return "FP8" if isinstance(t, Fp8Weight) else "int4"


def _checkpoint_tensors(model_dir: str, device: torch.device, dtype: torch.dtype, keep_fp8: bool,
                        keep_int4: bool = False) -> Iterator[Tuple[str, Any]]:  # fmt: skip
    """(name, CheckpointTensor or dense tensor) of the checkpoint in file order: a quantized
    layer's tensors become one dequantized `<layer>.weight` (float32, on `device`), or with
    `keep_fp8` an FP8 layer whose layout the FP8 GEMM takes one `Fp8Weight`, with `keep_int4` a
    4-bit layer whose groups the W4A16 GEMM takes one `Int4Packed`."""
    files = checkpoint_files(model_dir)
    index = checkpoint_index(files)
    fmt = quant_format(model_dir)
    if fmt is None:
        refuse_unannounced(index)
        yield from _iter_files(files)
        return
    unused = unused_tensors(index)
    if unused:
        logger.info_rank0(f"{fmt.label}: the checkpoint's {', '.join(unused)} tensors are not used (activations run in "
                          f"{str(dtype).removeprefix('torch.')}, the KV cache is --kv-cache-dtype's)")  # fmt: skip
    said: set[str] = set()
    for name, tensor in fmt.stream(_iter_files(files), index, device):
        if isinstance(tensor, Mxfp4Blocks):  # a fused expert tensor, named as the unquantized one
            if "dense" not in said:
                logger.info_rank0(f"{fmt.label} weights dequantized to {str(dtype).removeprefix('torch.')} at load")
                said.add("dense")
            yield name, tensor.dense()
            continue
        if isinstance(tensor, Fp8Blocks) and keep_fp8:
            try:
                yield f"{name}.weight", Fp8Weight.from_blocks(tensor.weight, tensor.scale, tensor.block)
                if "fp8" not in said:
                    logger.info_rank0(f"{fmt.label} weights kept as FP8 (W8A8 FP8 GEMM, dynamic per-token-group activations)")
                    said.add("fp8")
                continue
            except Fp8Unaligned as e:
                logger.info_rank0(f"{fmt.label} layer {name}: {e}; dequantized to {str(dtype).removeprefix('torch.')}")
        if isinstance(tensor, IntGroups) and keep_int4 and tensor.bits == 4:
            try:
                yield f"{name}.weight", Int4Packed.from_groups(tensor.codes, tensor.scale, tensor.zero, tensor.group, tensor.bits)
                if "int4" not in said:
                    logger.info_rank0(f"{fmt.label} weights kept as int4 (W4A16 GEMM, activations in {str(dtype).removeprefix('torch.')})")
                    said.add("int4")
                continue
            except Int4Unaligned as e:
                logger.info_rank0(f"{fmt.label} layer {name}: {e}; dequantized to {str(dtype).removeprefix('torch.')}")
        if isinstance(tensor, (IntGroups, Fp8Blocks)):
            if "dense" not in said:
                logger.info_rank0(f"{fmt.label} weights dequantized to {str(dtype).removeprefix('torch.')} at load")
                said.add("dense")
            yield f"{name}.weight", tensor.dense()
        else:
            yield name, tensor


def _shards(module: Any, param_name: str, pieces: List[Tuple[Any, Any]]) -> List[Tuple[Any, Any]]:
    """(part, this rank's shard) of each piece; a sharded layer narrows the piece, which for a
    CheckpointTensor reads only this rank's slice from the file."""
    if not isinstance(module, ShardedModule):
        return pieces
    return [(part, module.shard(param_name, cast(Any, tensor), part)) for part, tensor in pieces]


def _merge_kept(module: Any, name: str, bucket: Dict[Any, Any], dtype: torch.dtype) -> Any:
    """The merged parameter of parts some of which are kept quantized (FP8 or int4): one
    Fp8Weight / Int4Packed where all parts are of that layout, else (a part left dense by the
    checkpoint or by its cut) every part dense (logged)."""
    parts = [bucket[p] for p in module.parts(name.rpartition(".")[2])]
    for layout in _KEPT:
        if all(isinstance(p, layout) for p in parts):
            return layout.cat(parts)
    kind = next(_kind(p) for p in parts if isinstance(p, _KEPT))
    logger.info_rank0(f"{name}: some parts are not {kind}; the merged weight is dequantized to {str(dtype).removeprefix('torch.')}")
    return torch.cat([p.dense().to(dtype) if isinstance(p, _KEPT) else p for p in parts], dim=0)


def load_weights(model: nn.Module, model_dir: str, device: torch.device, dtype: torch.dtype,
                 keep_fp8: bool = False, keep_int4: bool = False) -> Dict[str, torch.Tensor]:  # fmt: skip
    """The state dict of `model` (built on meta) for this rank, read from `model_dir`. With
    `keep_fp8` (CUDA, layers/fp8.py) an FP8 checkpoint's linear layers keep float8_e4m3fn weights:
    their scales are installed on the layer (`weight_scale`), the weights are in the state dict.
    With `keep_int4` (CUDA, layers/int4.py) a 4-bit checkpoint's linear layers keep their codes:
    packed int32 `weight` in the state dict, `weight_scale` / `weight_zero` / `weight_group` on
    the layer."""
    out: Dict[str, torch.Tensor] = {}
    pending: Dict[str, Dict[Any, Any]] = {}
    said: set[str] = set()
    for ckpt_name, full in _checkpoint_tensors(model_dir, device, dtype, keep_fp8, keep_int4):
        found = _pieces(model, ckpt_name, full)
        if found is None:
            continue
        name, module, param_name, pieces = found
        if isinstance(full, _KEPT):
            shards = None
            kind = _kind(full)
            if isinstance(module, _Linear) and param_name == "weight":
                try:
                    shards = _shards(module, param_name, pieces)
                except _UNALIGNED as e:
                    logger.info_rank0(f"{ckpt_name}: this rank's shard cannot stay {kind} ({e}); dequantized")
            if shards is None:  # not a linear layer's weight (MoE experts), or a cut off the groups
                if not isinstance(module, _Linear) and f"non-linear {kind}" not in said:
                    logger.info_rank0(f"{ckpt_name}: {kind} weights of {type(module).__name__} are dequantized (only linear "
                                      f"layers run the {kind} GEMM; the fused MoE GEMM has no {kind} path); the same "
                                      "for the others")  # fmt: skip
                    said.add(f"non-linear {kind}")
                _, module, param_name, pieces = cast(Any, _pieces(model, ckpt_name, full.dense()))
                shards = _shards(module, param_name, pieces)
        else:
            shards = _shards(module, param_name, pieces)
        for part, piece in shards:
            local: Any
            if isinstance(piece, Fp8Weight):
                local = piece.to(device)
            elif isinstance(piece, Int4Packed):
                local = piece.to(device, dtype)  # scales and zeros in the model dtype
            else:
                if isinstance(piece, CheckpointTensor):
                    piece = piece.read()  # replicated
                target_dtype = piece.dtype
                if piece.is_floating_point():  # (a module may keep some parameters in float32: a router's)
                    target_dtype = torch.float32 if param_name in getattr(module, "float32_params", ()) else dtype
                local = piece.to(device=device, dtype=target_dtype)
            del piece
            parts = module.parts(param_name) if isinstance(module, ShardedModule) else None
            bucket = _whole(pending, name, part, parts, local)
            if bucket is None:
                continue  # other parts of this parameter are still to come
            if part is None or parts is None:
                merged = local
            elif any(isinstance(t, _KEPT) for t in bucket.values()):
                merged = _merge_kept(module, name, bucket, dtype)
            else:
                merged = module.merge(param_name, bucket)
            if isinstance(merged, Fp8Weight):
                merged.install(module)
                merged = merged.weight
            elif isinstance(merged, Int4Packed):
                merged.install(module)
                merged = merged.qweight
            out[name] = merged
    if pending:
        name, bucket = next(iter(pending.items()))
        raise ValueError(
            f"checkpoint is missing parts of {name}: found {sorted(map(str, bucket))}, "
            f"need {len(cast(Any, model.get_submodule(name.rpartition('.')[0])).parts(name.rpartition('.')[2]))} parts"
        )
    return out


def _whole(pending: Dict[str, Dict[Any, Any]], name: str, part: Any, parts: Any, value: Any) -> Dict[Any, Any] | None:
    """The parts of parameter `name` once the last of them arrived ({part: value}), else None
    (kept in `pending` meanwhile); a value that is a whole parameter (no part) comes back at once."""
    if part is None or parts is None:
        return {part: value}
    bucket = pending.setdefault(name, {})
    bucket[part] = value
    return pending.pop(name) if len(bucket) == len(parts) else None


def load_int4_codes(model: nn.Module, model_dir: str) -> Tuple[str, Dict[str, Int4Weight]]:
    """(the format's label, {module path: its int4 decode weight}) for the linear layers of a
    4-bit checkpoint whose codes map onto the int4 GEMM's Q4_1 blocks (`IntGroups.q4_1`: the
    same codes, d = scale, m = -scale * zero), merged like the dense weights (q/k/v, gate/up);
    empty for any other checkpoint. tp == 1: whole matrices, read on the CPU. A merged
    projection missing any part (a part left dense, a group size that does not map) stays dense."""
    fmt = quant_format(model_dir)
    if fmt is None or not fmt.int4:
        return "", {}
    files = checkpoint_files(model_dir)
    pending: Dict[str, Dict[Any, torch.Tensor]] = {}
    out: Dict[str, Int4Weight] = {}
    cpu = torch.device("cpu")
    for prefix, groups in fmt.stream(_iter_files(files), checkpoint_index(files), cpu, only_quantized=True):
        blocks = groups.q4_1() if isinstance(groups, IntGroups) else None
        found = _pieces(model, f"{prefix}.weight", None if blocks is None else torch.cat([b.float() for b in blocks], dim=1))
        if blocks is None or found is None or not isinstance(found[1], _Linear) or found[2] != "weight":
            continue
        name, module, _, pieces = found
        k = blocks[0].shape[1]
        for part, rows in pieces:  # rows: [codes | d | m] of this part's output rows
            parts = module.parts("weight")
            bucket = _whole(pending, name, part, parts, rows)
            if bucket is None:
                continue
            merged = rows if part is None or parts is None else module.merge("weight", bucket)
            codes, d, m = merged[:, :k], merged[:, k : k + k // 32], merged[:, k + k // 32 :]
            out[name.rpartition(".")[0]] = Int4Weight.from_q4_1(codes.to(torch.uint8), d, m)
    return fmt.label, out


def quantize_linears_fp8(model: nn.Module) -> List[str]:
    """Turn every linear layer's bf16/fp16/fp32 weight into per-row FP8 in place (layers whose K
    is not a multiple of 128 stay dense, logged); the names of the layers converted."""
    done: List[str] = []
    skipped: List[str] = []
    for name, mod in model.named_modules():
        if not isinstance(mod, _Linear) or mod.weight.dtype == FP8_E4M3:
            continue
        if mod.weight.shape[1] % GROUP_K:
            skipped.append(name)
            continue
        q = quantize_per_row(mod.weight.data)
        mod.weight = nn.Parameter(q.weight, requires_grad=False)
        q.install(mod)
        done.append(name)
    if skipped:
        logger.info_rank0(f"--quantization fp8: {len(skipped)} linear layers keep their dense weight (in_features not a "
                          f"multiple of {GROUP_K}), e.g. {skipped[0]}")  # fmt: skip
    logger.info_rank0(f"--quantization fp8: {len(done)} linear layers run per-channel FP8 weights (W8A8)")
    return done


ROUTERS = ("gate", "router", "shared_expert_gate")  # MoE routing layers: their logits choose experts


def quantize_linears_int4(model: nn.Module, dtype: torch.dtype) -> List[str]:
    """Turn every linear layer's dense weight into group-128 asymmetric int4 in place
    (`--quantization int4` on CUDA, layers/int4.quantize_groups); layers whose K is not a multiple
    of 128 and the MoE routers (an int4 error there flips expert choices) stay dense, logged; the
    names of the layers converted."""
    done: List[str] = []
    skipped: List[str] = []
    for name, mod in model.named_modules():
        if not isinstance(mod, _Linear) or not mod.weight.is_floating_point() or mod.weight.dtype == FP8_E4M3:
            continue
        if mod.weight.shape[1] % ONLINE_GROUP or name.rpartition(".")[2] in ROUTERS:
            skipped.append(name)
            continue
        q = quantize_int4_groups(mod.weight.data, ONLINE_GROUP).to(mod.weight.device, dtype)
        mod.weight = nn.Parameter(q.qweight, requires_grad=False)
        q.install(mod)
        done.append(name)
    if skipped:
        logger.info_rank0(f"--quantization int4: {len(skipped)} linear layers keep their dense weight (in_features not a "
                          f"multiple of {ONLINE_GROUP}, or an MoE router), e.g. {skipped[0]}")  # fmt: skip
    logger.info_rank0(f"--quantization int4: {len(done)} linear layers run group-{ONLINE_GROUP} int4 weights (W4A16)")
    return done


def dummy_weights(model: nn.Module, device: torch.device, dtype: torch.dtype, seed: int = 0) -> Dict[str, torch.Tensor]:
    """Random weights with the right shapes, for benchmarks that need no checkpoint."""
    gen = torch.Generator(device=device).manual_seed(seed)
    out: Dict[str, torch.Tensor] = {}
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    for name, param in model.named_parameters():
        if tied and name == "lm_head.weight":
            continue  # load_state_dict ties it to the embedding, as a real checkpoint would
        if name.endswith("norm.weight"):
            out[name] = torch.ones(param.shape, device=device, dtype=dtype)
        else:
            t = torch.empty(param.shape, device=device, dtype=dtype)
            out[name] = t.uniform_(-0.02, 0.02, generator=gen)
    return out
