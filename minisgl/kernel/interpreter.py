"""Make Triton's CPU interpreter (TRITON_INTERPRET=1) agree with the GPU where our checks need it.

For the CPU tests and the benchmark scripts' --smoke/--quick modes only; nothing on a serving path
imports this. Two differences are mended:
  * float32 -> bfloat16 conversion: the interpreter truncates, the GPU (and torch) round to
    nearest even, so bf16 results could not be held to the GPU's rounding;
  * scalars a kernel loads are one-element arrays there, and `int()` of one (a `range()` over
    loaded bounds) fails under numpy 2: convert through `.item()`.
"""

from __future__ import annotations

from typing import Any

_state = {"patched": False}


def patch_interpreter() -> None:
    """Apply both mends (idempotent). Call after TRITON_INTERPRET=1 is set, before any launch."""
    if _state["patched"]:
        return
    import numpy as np
    import torch
    import triton.language as tl
    import triton.runtime.interpreter as interp

    truncating = interp._convert_float

    def convert_float(data: Any, src: Any, dst: Any, rounding_mode: Any) -> Any:
        if src == tl.float32 and dst == tl.bfloat16 and rounding_mode in (None, "rtne"):
            arr = np.ascontiguousarray(data).view(np.float32)
            return torch.from_numpy(arr).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        return truncating(data, src, dst, rounding_mode)

    patch_tensor = interp._patch_lang_tensor

    def patch_tensor_scalars(tensor: Any, scope: Any) -> None:
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0].item()))

    interp._convert_float = convert_float
    interp._patch_lang_tensor = patch_tensor_scalars
    _state["patched"] = True
