"""Stream checkpoint tensors into this rank's shards.

Peak memory matters (a 14B model in bf16 is 28 GB): tensors are read one at a time straight
from the file into their own buffers (no mmap, whose resident pages would count a second copy),
sliced to this rank's shard, cast and moved to the device; merged parameters (q/k/v, gate/up,
experts) wait only until their last part arrives.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, Dict, Iterator, Tuple

import torch
from torch import nn

from minisgl.layers.base import ShardedModule

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
}


def iter_safetensors(path: Path) -> Iterator[Tuple[str, torch.Tensor]]:
    """Yield (name, tensor) from one .safetensors file, reading each tensor into fresh memory."""
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
        header.pop("__metadata__", None)
        base = 8 + header_len
        for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            start, end = info["data_offsets"]
            dtype = _ST_DTYPES.get(info["dtype"])
            if dtype is None:
                raise ValueError(f"{path.name}: tensor {name} has unsupported dtype {info['dtype']}")
            tensor = torch.empty(info["shape"], dtype=dtype)
            f.seek(base + start)
            if end > start:
                view = tensor.view(-1).view(torch.uint8).numpy()
                if f.readinto(memoryview(view)) != end - start:
                    raise ValueError(f"{path.name}: tensor {name} is truncated")
            yield name, tensor


def checkpoint_files(model_dir: str) -> list[Path]:
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors weights in {model_dir!r}; convert the checkpoint to safetensors "
            "or pass use_dummy_weight=True for a benchmark"
        )
    return files


def load_weights(model: nn.Module, model_dir: str, device: torch.device, dtype: torch.dtype) -> Dict[str, torch.Tensor]:
    """The state dict of `model` (built on meta) for this rank, read from `model_dir`."""
    out: Dict[str, torch.Tensor] = {}
    pending: Dict[str, Dict[Any, torch.Tensor]] = {}
    for file in checkpoint_files(model_dir):
        for ckpt_name, full in iter_safetensors(file):
            mapped = model.map_weight_name(ckpt_name)  # type: ignore[operator]
            if mapped is None:
                continue
            name, part = mapped
            module_path, _, param_name = name.rpartition(".")
            try:
                module = model.get_submodule(module_path)
            except AttributeError:
                raise ValueError(f"checkpoint weight {ckpt_name!r} does not belong to {type(model).__name__}") from None
            piece = module.shard(param_name, full, part) if isinstance(module, ShardedModule) else full
            target_dtype = dtype if piece.is_floating_point() else piece.dtype
            local = piece.to(device=device, dtype=target_dtype)
            if local.data_ptr() == full.data_ptr() and local.numel() < full.numel():
                local = local.clone()  # a view would keep the whole checkpoint tensor alive
            del full, piece
            parts = module.parts(param_name) if isinstance(module, ShardedModule) else None
            if part is None or parts is None:
                out[name] = local
                continue
            bucket = pending.setdefault(name, {})
            bucket[part] = local
            if len(bucket) == len(parts):
                out[name] = module.merge(param_name, pending.pop(name))
    if pending:
        name, bucket = next(iter(pending.items()))
        raise ValueError(
            f"checkpoint is missing parts of {name}: found {sorted(map(str, bucket))}, "
            f"need {len(model.get_submodule(name.rpartition('.')[0]).parts(name.rpartition('.')[2]))} parts"
        )
    return out


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
