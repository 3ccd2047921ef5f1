"""Quantized weights straight from a GGUF file, in our parameter names and layouts.

The engine loads the dequantized HF folder (utils/hf.py) for its dense weights; this module
re-reads the GGUF's own blocks so the quantized copy carries the file's exact codes instead of a
re-quantization of their dequantized values:

- Q4_1 (the embedded SmolLM2's projections) -> `Int4Weight` (lossless code for code);
- Q8_0 (its token embedding / tied LM head) -> `Int8Weight` (likewise).

llama.cpp stores Llama's q/k projections with the rows of each head interleaved for its rotary
layout; transformers undoes that when it dequantizes, and so do we (a row permutation, which
leaves the 32-column blocks intact).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, Tuple

import numpy as np
import torch

from minisgl.layers.quant import Int4Weight, Int8Weight, QuantWeight

GGUF_MARKER = "minisgl_gguf_source.txt"  # written by utils/hf.py's convert_gguf

# GGUF tensor name inside a block -> (our module path in the layer, part of the merged parameter)
_LAYER_TENSORS: Dict[str, Tuple[str, object]] = {
    "attn_q": ("self_attn.qkv_proj", "q"),
    "attn_k": ("self_attn.qkv_proj", "k"),
    "attn_v": ("self_attn.qkv_proj", "v"),
    "attn_output": ("self_attn.o_proj", None),
    "ffn_gate": ("mlp.gate_up_proj", 0),
    "ffn_up": ("mlp.gate_up_proj", 1),
    "ffn_down": ("mlp.down_proj", None),
}
_MERGE_ORDER = {"self_attn.qkv_proj": ("q", "k", "v"), "mlp.gate_up_proj": (0, 1)}


def _q4_1_blocks(raw: np.ndarray, rows: int, cols: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """raw uint8 [rows, cols/32 * 20] -> codes [rows, cols] (uint8), d and m [rows, cols/32] (fp32)."""
    blocks = np.ascontiguousarray(raw).reshape(rows, cols // 32, 20)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = blocks[..., 4:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(rows, cols)  # low nibbles first
    return torch.from_numpy(codes), torch.from_numpy(d), torch.from_numpy(m)


def _q8_0_blocks(raw: np.ndarray, rows: int, cols: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """raw uint8 [rows, cols/32 * 34] -> codes [rows, cols] (int8), d [rows, cols/32] (fp32)."""
    blocks = np.ascontiguousarray(raw).reshape(rows, cols // 32, 34)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = blocks[..., 2:].copy().view(np.int8).reshape(rows, cols)
    return torch.from_numpy(qs), torch.from_numpy(d)


def _unpermute_rows(x: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of llama.cpp's q/k row interleave (per head: [pairs, 2] -> [2, pairs])."""
    rows = x.shape[0]
    return x.reshape(n_head, rows // n_head // 2, 2, *x.shape[1:]).transpose(1, 2).reshape(x.shape)


# Bump when the record layout of layers/quant.py changes: cached records of another layout are not read.
RECORDS_VERSION = 1


def load_gguf_quant_cached(path: str | Path, num_q_heads: int, num_kv_heads: int, cache_dir: Path) -> Dict[str, QuantWeight]:
    """`load_gguf_quant`, kept in `cache_dir` (the folder converted from this GGUF, keyed by its
    content): parsing the GGUF (its tokenizer metadata) and repacking the codes took ~3.5 s of
    every start on the CPU; the cached records load in a fraction of that."""
    import json

    from safetensors.torch import load_file, save_file

    # (safetensors inside, but not named *.safetensors: the weight loader reads every such file)
    cache = cache_dir / f"minisgl_gguf_records-v{RECORDS_VERSION}-h{num_q_heads}-{num_kv_heads}.records"
    if cache.exists():
        from safetensors import safe_open

        with safe_open(str(cache), "pt") as f:
            kinds = json.loads((f.metadata() or {}).get("kinds", "{}"))
        tensors = load_file(str(cache))
        kind_of: Dict[str, type[Int4Weight] | type[Int8Weight]] = {"int4": Int4Weight, "int8": Int8Weight}
        return {name: kind_of[kind](tensors[name], int(k)) for name, (kind, k) in kinds.items()}
    out = load_gguf_quant(path, num_q_heads, num_kv_heads)
    kinds = {name: ("int4" if isinstance(w, Int4Weight) else "int8", w.in_features) for name, w in out.items()}
    tmp = cache.with_name(f"{cache.name}.tmp-{os.getpid()}")
    try:
        save_file({name: w.records for name, w in out.items()}, str(tmp), metadata={"kinds": json.dumps(kinds)})
        os.replace(tmp, cache)  # atomic: a concurrent writer's file is the same
    except OSError:  # (a read-only cache: parse again next time)
        tmp.unlink(missing_ok=True)
    return out


def load_gguf_quant(path: str | Path, num_q_heads: int, num_kv_heads: int) -> Dict[str, QuantWeight]:
    """{our module path (e.g. 'model.layers.0.self_attn.qkv_proj', 'lm_head'): quantized weight}
    for every Q4_1 / Q8_0 matrix; other tensors (norms, F32/F16 matrices) are left to the dense path."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    arch_field = reader.fields.get("general.architecture")
    arch = bytes(arch_field.parts[-1]).decode() if arch_field is not None else "llama"
    permute_qk = arch == "llama"
    pieces: Dict[str, Dict[object, Tuple[torch.Tensor, ...]]] = {}
    out: Dict[str, QuantWeight] = {}
    for t in reader.tensors:
        kind = t.tensor_type.name
        cols, rows = int(t.shape[0]), int(t.shape[1]) if len(t.shape) > 1 else 1
        name = t.name.removesuffix(".weight")
        if name == "token_embd" or name == "output":
            if kind == "Q8_0":
                target = "lm_head" if name == "output" else "model.embed_tokens"
                out[target] = Int8Weight.from_q8_0(*_q8_0_blocks(t.data, rows, cols))
            continue
        if not name.startswith("blk.") or kind != "Q4_1":
            continue
        _, layer, short = name.split(".", 2)
        if short not in _LAYER_TENSORS:
            continue
        module, part = _LAYER_TENSORS[short]
        codes, d, m = _q4_1_blocks(t.data, rows, cols)
        if permute_qk and part in ("q", "k"):
            heads = num_q_heads if part == "q" else num_kv_heads
            codes, d, m = (_unpermute_rows(x, heads) for x in (codes, d, m))
        full = f"model.layers.{layer}.{module}"
        if part is None:
            out[full] = Int4Weight.from_q4_1(codes, d, m)
            continue
        bucket = pieces.setdefault(full, {})
        bucket[part] = (codes, d, m)
        order = _MERGE_ORDER[module]
        if len(bucket) == len(order):
            merged = [torch.cat([bucket[p][i] for p in order]) for i in range(3)]
            out[full] = Int4Weight.from_q4_1(merged[0], merged[1], merged[2])
            del pieces[full]
    # A tied LM head reads the embedding's quantized copy.
    if "lm_head" not in out and "model.embed_tokens" in out:
        out["lm_head"] = out["model.embed_tokens"]
    out.pop("model.embed_tokens", None)  # the lookup itself stays dense (one row per token)
    return out


def gguf_source(model_path: str | None) -> str | None:
    """The .gguf file behind `model_path` (None / '' = the embedded default model), else None."""
    from minisgl.utils.hf import default_model_path

    if not model_path:
        try:
            return default_model_path()
        except FileNotFoundError:
            return None
    p = Path(model_path).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return str(p)
    marker = p / GGUF_MARKER
    if p.is_dir() and marker.exists():  # a folder converted from a GGUF (utils/hf.py)
        src = Path(marker.read_text().strip())
        return str(src) if src.is_file() else None
    return None
