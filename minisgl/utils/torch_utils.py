"""Context managers around torch global state."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)} or 'auto', got {name!r}")
    return DTYPES[name]


@contextmanager
def torch_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Temporarily set the default dtype so modules built inside get parameters of `dtype`."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def cpu_has_fast_bf16() -> bool:
    """AVX512-BF16 or AMX: bf16 GEMMs run several times faster than fp32 on such CPUs."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return False
    return any(flag in flags.split() for flag in ("avx512_bf16", "amx_bf16"))


def auto_dtype(hf_config: object, device: torch.device) -> torch.dtype:
    """The checkpoint's half dtype on CUDA; on CPU bf16 where the CPU has bf16 units, else fp32."""
    if device.type == "cuda":
        name = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        dtype = parse_dtype(str(name).replace("torch.", "")) if name else torch.bfloat16
        return dtype if dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
    return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32
