"""Every environment variable minisgl reads, typed, in one place.

`read_env()` reads the environment when called (cheap), so a test or a launcher that sets a
variable before building an engine is seen. Anything configurable per run should be a command-line
option or a config field; these are the few process-wide switches.

| variable | type | default | meaning |
|---|---|---|---|
| MINISGL_API_KEY | str | unset | default of `--api-key` |
| MINISGL_DISABLE_OVERLAP_SCHEDULING | bool | false | run the scheduler loop synchronously |
| MINISGL_CACHE_DIR | path | ~/.cache/minisgl | converted-checkpoint cache (GGUF → HF folder) |
| MINISGL_LOG_LEVEL | str | WARNING | log level of library use (the server sets its own from --log-level) |
| TRITON_INTERPRET | bool | false | Triton's CPU interpreter (kernel tests on CPUs) |
| MINISGL_CPU_KERNELS | bool | true | CPU: build and use the C kernels (false: every op on torch, as without a C compiler) |
| CC | str | cc, gcc on PATH | the C compiler of the CPU kernels |

No switch chooses between kernels: where a measurement chose, the losing branch left with its
switch (the deciding figures stay in docs/PERFORMANCE.md). MINISGL_CPU_KERNELS is no such choice:
it runs what a machine without a C compiler runs.
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


@dataclass(frozen=True)
class Env:
    api_key: str | None
    disable_overlap_scheduling: bool
    cache_dir: Path
    log_level: str
    triton_interpret: bool
    cpu_kernels: bool
    cc: str | None


def read_env() -> Env:
    return Env(
        api_key=os.environ.get("MINISGL_API_KEY") or None,
        disable_overlap_scheduling=_flag("MINISGL_DISABLE_OVERLAP_SCHEDULING", False),
        cache_dir=Path(os.environ.get("MINISGL_CACHE_DIR") or Path.home() / ".cache" / "minisgl"),
        log_level=(os.environ.get("MINISGL_LOG_LEVEL") or "WARNING").upper(),
        triton_interpret=_flag("TRITON_INTERPRET", False),
        cpu_kernels=_flag("MINISGL_CPU_KERNELS", True),
        cc=os.environ.get("CC") or None,
    )
