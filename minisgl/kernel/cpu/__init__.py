"""Fused C kernels for the CPU forward, built on first use and called through ctypes.

`kernels.c` (norms, rotary, SiLU, paged attention), `kv_int8.c` (the int8 KV pool's store and decode attention), `argmax.c` (greedy sampling), `gemv.c` (the bf16 skinny GEMM of small
decode batches; `skinny_avx2.c` has it and qgemv.c's for CPUs without AVX512-BF16, and
`gemm_avx2.c` the GEMM of larger ones there, `attn_avx2.c` attn_amx.c's prefill attention) and `amx.c` (the bf16 GEMM on AMX tiles for larger ones), `qgemv.c` (the skinny GEMM on GGUF's
Q4_1 / Q8_0 blocks), `attn_amx.c` (prefill attention on AMX tiles) and `decode_loop.c` (a small
decode batch's whole layer stack in one call) are compiled once with the system C compiler (`cc -O3 -march=native -fopenmp`, under
a second) into MINISGL_CACHE_DIR, keyed by the source hash, the flags and the host CPU; no torch
headers, so no minute-long extension build. Without a compiler, or with MINISGL_CPU_KERNELS=0,
`cpu_kernels()` returns None and every op runs its torch code.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
from functools import lru_cache
from pathlib import Path

import torch

from minisgl.utils.env import read_env
from minisgl.utils.logger import init_logger

logger = init_logger(__name__)

_SRCS = [
    Path(__file__).with_name(n)
    for n in (
        "kernels.c",
        "gemv.c",
        "amx.c",
        "attn_amx.c",
        "qgemv.c",
        "skinny_avx2.c",
        "gemm_avx2.c",
        "attn_avx2.c",
        "decode_loop.c",
        "kv_int8.c",
        "argmax.c",
    )
]
_HEADERS = [Path(__file__).with_name(n) for n in ("bf16.h", "amx_tiles.h", "attn_common.h", "vec_math.h")]  # part of the cache key
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-shared", "-fPIC", "-std=gnu11"]
_P, _L, _F, _I = ctypes.c_void_p, ctypes.c_long, ctypes.c_float, ctypes.c_int
_SIGNATURES = {
    "add_rms_norm": [_P, _P, _P, _P, _L, _L, _F, _I],
    "silu_mul": [_P, _P, _L, _L],
    "rope_store": [_P, _P, _P, _P, _P, _P, _F, _P, _P, _P, _L, _L, _L, _L],
    "paged_attention": [_P, _L, _P, _P, _P, _L, _P, _P, _P, _L, _L, _L, _L, _F, _I],
    # the int8 pool (kv_int8.c): K/V codes and their per-head scales
    "rope_store_q8": [_P, _P, _P, _P, _P, _P, _F, _P, _P, _P, _P, _P, _L, _L, _L, _L],
    "paged_attention_q8": [_P, _L, _P, _P, _P, _P, _P, _L, _P, _P, _P, _L, _L, _L, _L, _F, _I],
}
SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}


# decode_loop.c's tables (same field order and types as its structs)
class DecodeGemm(ctypes.Structure):
    _fields_ = [("q", _P), ("q_bits", _L), ("q_rows", _L), ("w", _P), ("gemv_rows", _L), ("n", _L), ("k", _L),
                ("bias", _P), ("vnni", _L)]  # fmt: skip


class DecodeLayer(ctypes.Structure):
    _fields_ = [(n, _P) for n in ("ln1", "ln2", "q_norm", "k_norm", "k_cache", "v_cache", "k_scale", "v_scale")]
    _fields_ += [(n, DecodeGemm) for n in ("qkv", "o", "gate_up", "down")]


class DecodeStep(ctypes.Structure):
    _fields_ = [(n, _P) for n in ("res", "h", "qkv", "attn", "a", "gu", "act", "m", "positions", "cos", "sin",
                                  "final_norm", "out_loc", "table_row", "kv_len", "page_table")]  # fmt: skip
    _fields_ += [(n, _L) for n in ("pt_stride", "rows", "hidden", "inter", "hq", "hk", "d")]
    _fields_ += [("eps", _F), ("scale", _F), ("nthreads", _L)]


def _cache_dir() -> Path:
    return read_env().cache_dir / "cpu_kernels"


def _cpu_id() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return hashlib.sha1(line.encode()).hexdigest()[:8]
    except OSError:
        pass
    return platform.machine()


def _build() -> Path:
    cc = read_env().cc or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    src = b"".join(p.read_bytes() for p in _SRCS + _HEADERS)
    key = hashlib.sha1(src + " ".join(_FLAGS).encode() + _cpu_id().encode()).hexdigest()[:16]
    out = _cache_dir() / f"minisgl_cpu_{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".tmp{os.getpid()}.so")
    proc = subprocess.run([cc, *_FLAGS, "-o", str(tmp), *map(str, _SRCS), "-lm"], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{cc} failed: {proc.stderr.strip()[:2000]}")
    os.replace(tmp, out)  # atomic: concurrent builders produce the same file
    return out


class CpuKernels:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        for name, sig in _SIGNATURES.items():
            for suf in SUFFIX.values():
                fn = getattr(lib, f"{name}_{suf}")
                fn.argtypes, fn.restype = sig, None
        lib.max_head_dim.restype = lib.max_group.restype = ctypes.c_long
        self.max_head_dim, self.max_group = lib.max_head_dim(), lib.max_group()
        lib.gemv_available.restype = ctypes.c_int
        lib.gemv_bf16.argtypes, lib.gemv_bf16.restype = [_P, _L, _L, _P, _L, _L, _P, _P, _I], ctypes.c_int
        # 0 where the compiler had neither AVX512-BF16 nor AVX2 + FMA for this CPU: bf16 GEMMs stay on torch
        self.has_gemv = bool(lib.gemv_available())
        lib.amx_available.restype = ctypes.c_int
        lib.gemm_amx_bf16.argtypes, lib.gemm_amx_bf16.restype = lib.gemv_bf16.argtypes, ctypes.c_int
        # 0 without AMX (compiler or CPU) or where Linux refuses the tile state
        self.has_amx = bool(lib.amx_available())
        lib.gemm_avx2_available.restype = ctypes.c_int
        lib.gemm_avx2_bf16.argtypes, lib.gemm_avx2_bf16.restype = lib.gemv_bf16.argtypes, ctypes.c_int
        # 1 where the skinny GEMMs are skinny_avx2.c's: the GEMM of many rows without AMX
        self.has_avx2_gemm = bool(lib.gemm_avx2_available())
        # the same GEMMs on weights stored in VNNI tiles (layers/quant.py vnni_pack), and gate_up
        # with its SiLU in one pass
        for name in ("gemm_amx_vnni_bf16", "gemv_vnni_bf16"):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = lib.gemv_bf16.argtypes, ctypes.c_int
        lib.gemm_amx_vnni_silu_bf16.argtypes = [_P, _L, _L, _P, _L, _L, _P, _I]
        lib.gemm_amx_vnni_silu_bf16.restype = ctypes.c_int
        lib.qgemv_available.restype = ctypes.c_int
        for name in ("qgemv_q4_bf16", "qgemv_q8_bf16"):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = lib.gemv_bf16.argtypes, ctypes.c_int
        # 0 without AVX512-BF16 or AVX2 + FMA: quantized GEMMs stay on torch's kernels
        self.has_qgemv = bool(lib.qgemv_available())
        lib.decode_layers_bf16.argtypes, lib.decode_layers_bf16.restype = [_P, _L, _P], ctypes.c_int
        lib.prefill_attention_amx_bf16.argtypes = [_P, _L, _L, _L, _L, _L, _F, _P, _L, _I]
        lib.prefill_attention_amx_bf16.restype = ctypes.c_int
        lib.prefill_attention_avx2_bf16.argtypes = lib.prefill_attention_amx_bf16.argtypes
        lib.prefill_attention_avx2_bf16.restype = ctypes.c_int
        for suf in SUFFIX.values():
            fn = getattr(lib, f"argmax_rows_{suf}")
            fn.argtypes, fn.restype = [_P, _L, _L, _L, _P, _I], None

    def get(self, name: str, dtype: torch.dtype):  # type: ignore[no-untyped-def]
        return getattr(self.lib, f"{name}_{SUFFIX[dtype]}")


def argmax_rows(x: torch.Tensor) -> torch.Tensor | None:
    """torch.argmax(x, dim=-1) of 2-D CPU logits (fp32 or bf16, unit stride in the last dim) on
    argmax.c: same result, ties and NaNs included; None where it does not apply."""
    kern = cpu_kernels()
    if kern is None or x.dim() != 2 or x.dtype not in SUFFIX or x.stride(1) != 1 or x.shape[1] == 0:
        return None
    out = torch.empty(x.shape[0], dtype=torch.int64)
    kern.get("argmax_rows", x.dtype)(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out.data_ptr(), torch.get_num_threads())
    return out


@lru_cache(maxsize=1)
def cpu_kernels() -> CpuKernels | None:
    if not read_env().cpu_kernels:
        return None
    try:
        return CpuKernels(ctypes.CDLL(str(_build())))
    except (OSError, RuntimeError) as exc:
        logger.warning(f"CPU C kernels unavailable, using torch ops: {exc}")
        return None
