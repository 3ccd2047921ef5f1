"""Programmatic dependent launch (PDL, Hopper and newer) for the decode-path Triton kernels.

A batch-1 decode step is ~200 kernels of a few µs each, and each one normally starts only after
the previous one has fully drained. A kernel launched with PDL may start while its predecessor
is still finishing: it loads what no earlier kernel writes (the GEMV's weights) and then waits in
`griddepcontrol.wait` until the predecessor has completed and its writes are visible. Every
kernel launched this way calls the wait in every program before it reads or writes any
activation, so stream order is kept for everything that matters; it also signals
`launch_dependents` early so that its own successor can start the same way. CUDA graphs capture
the launches as programmatic edges.

On wherever the GPU has it (sm_90+): it won the batch-1 step on the H200 (docs/PERFORMANCE.md,
"PDL at decode batch 8-32"). Never on in Triton's interpreter (the instructions are inline PTX).
The attention kernels use it only for launches of at most PDL_MAX_ROWS rows (`pdl_for`): at
decode batch 8-32 it made the steps slower, as there the kernels are long enough that nothing is
won by starting early, and a dependent launched early holds SM slots while it waits.
"""

from __future__ import annotations

from typing import Any, Dict

import torch

from minisgl.utils.env import read_env

_state: Dict[str, Any] = {"enabled": None}


def pdl_enabled() -> bool:
    if _state["enabled"] is None:
        ok = not read_env().triton_interpret and torch.cuda.is_available()
        _state["enabled"] = bool(ok and torch.cuda.get_device_capability() >= (9, 0))
    return bool(_state["enabled"])


PDL_MAX_ROWS = 4  # the skinny GEMV's buckets (kernel/skinny.py): where the step is launch-bound


def pdl_for(rows: int) -> bool:
    """PDL for a launch over `rows` tokens / requests (see the module docstring)."""
    return pdl_enabled() and rows <= PDL_MAX_ROWS


def launch_kwargs(on: bool | None = None) -> Dict[str, Any]:
    """Extra launch options for a kernel whose USE_PDL constexpr is `on` (default pdl_enabled())."""
    return {"launch_pdl": True} if (pdl_enabled() if on is None else on) else {}
