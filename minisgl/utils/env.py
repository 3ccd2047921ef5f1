"""Every environment variable minisgl reads, typed, in one place.

`read_env()` reads the environment when called (cheap), so a test or a launcher that sets a
variable before building an engine is seen. Anything configurable per run should be a command-line
option or a config field; these are the few process-wide switches.

| variable | type | default | meaning |
|---|---|---|---|
| MINISGL_API_KEY | str | unset | default of `--api-key` |
| MINISGL_DISABLE_OVERLAP_SCHEDULING | bool | false | run the scheduler loop synchronously |
| MINISGL_FUSED_OPS | bool | true | use the Triton fused ops on CUDA |
| MINISGL_SKINNY_GEMM | bool | true | CUDA: small-batch projections through the fused Triton GEMV where init measures it faster |
| MINISGL_PDL | bool | true | CUDA sm_90+: decode-path Triton kernels use programmatic dependent launch |
| MINISGL_CACHE_DIR | path | ~/.cache/minisgl | converted-checkpoint cache (GGUF → HF folder) |
| MINISGL_LOG_LEVEL | str | WARNING | log level of library use (the server sets its own from --log-level) |
| TRITON_INTERPRET | bool | false | Triton's CPU interpreter (kernel tests on CPUs) |
| MINISGL_CPU_FAST_DECODE | bool | true | CPU: the flat forward over fused C kernels (false: the module path) |
| MINISGL_CPU_KERNELS | bool | true | CPU: build and use the C kernels (false: the same loop on torch ops) |
| CC | str | cc, gcc on PATH | the C compiler of the CPU kernels |
| MINISGL_CPU_PACKED | bool | false | CPU: bf16 GEMM weights packed once for oneDNN (faster, twice the weight memory) |
| MINISGL_CPU_AMX | bool | true | CPU: bf16 GEMMs of > 8 rows on the C AMX kernel (false: oneDNN through torch) |
| MINISGL_CPU_VNNI | bool | true | CPU: projection weights stored in the AMX tile layout, read in place (false: plain weights) |
| MINISGL_FP8_DOT | f16, bf16 | f16 | CUDA: the dots of the tensor-core decode over an fp8 pool in a bf16 model |
| MINISGL_FP8_DECODE | auto, dot, cc | auto | CUDA: the decode kernel over an fp8 pool (auto: CUDA-core for GQA groups <= 2) |
| MINISGL_FLASHINFER_TENSOR_CORES | bool | true | FlashInfer decode on its tensor-core kernel for every GQA group (false: from a group of 4) |
| MINISGL_FLASHINFER_FAST_MAX | bool | true | FlashInfer: its plan() gets a `max` that reduces a tensor in one op |

The A/B switches (the last four, MINISGL_CPU_VNNI, MINISGL_PDL, MINISGL_SKINNY_GEMM) keep the
alternative a measurement chose against; docs/PERFORMANCE.md has the figures.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return default
    v = value.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise ValueError(f"environment variable {name}={value!r}: expected one of {_TRUE + _FALSE}")


def _choice(name: str, default: str, allowed: tuple[str, ...]) -> str:
    value = (os.environ.get(name) or "").strip().lower() or default
    if value not in allowed:
        raise ValueError(f"environment variable {name}={os.environ.get(name)!r}: expected one of {allowed}")
    return value


@dataclass(frozen=True)
class Env:
    api_key: str | None
    disable_overlap_scheduling: bool
    fused_ops: bool
    skinny_gemm: bool
    pdl: bool
    cache_dir: Path
    log_level: str
    triton_interpret: bool
    cpu_fast_decode: bool
    cpu_kernels: bool
    cpu_packed: bool
    cpu_amx: bool
    cpu_vnni: bool
    fp8_dot: str
    fp8_decode: str
    flashinfer_tensor_cores: bool
    flashinfer_fast_max: bool
    cc: str | None


def read_env() -> Env:
    return Env(
        api_key=os.environ.get("MINISGL_API_KEY") or None,
        disable_overlap_scheduling=_flag("MINISGL_DISABLE_OVERLAP_SCHEDULING", False),
        fused_ops=_flag("MINISGL_FUSED_OPS", True),
        skinny_gemm=_flag("MINISGL_SKINNY_GEMM", True),
        pdl=_flag("MINISGL_PDL", True),
        cache_dir=Path(os.environ.get("MINISGL_CACHE_DIR") or Path.home() / ".cache" / "minisgl"),
        log_level=(os.environ.get("MINISGL_LOG_LEVEL") or "WARNING").upper(),
        triton_interpret=_flag("TRITON_INTERPRET", False),
        cpu_fast_decode=_flag("MINISGL_CPU_FAST_DECODE", True),
        cpu_kernels=_flag("MINISGL_CPU_KERNELS", True),
        cpu_packed=_flag("MINISGL_CPU_PACKED", False),
        cpu_amx=_flag("MINISGL_CPU_AMX", True),
        cpu_vnni=_flag("MINISGL_CPU_VNNI", True),
        fp8_dot=_choice("MINISGL_FP8_DOT", "f16", ("f16", "bf16")),
        fp8_decode=_choice("MINISGL_FP8_DECODE", "auto", ("auto", "dot", "cc")),
        flashinfer_tensor_cores=_flag("MINISGL_FLASHINFER_TENSOR_CORES", True),
        flashinfer_fast_max=_flag("MINISGL_FLASHINFER_FAST_MAX", True),
        cc=os.environ.get("CC") or None,
    )
