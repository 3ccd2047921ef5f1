"""Make Triton's CPU interpreter (TRITON_INTERPRET=1) agree with the GPU where our checks need it.

For the CPU tests (tests/kernel_checks) only; nothing on a serving path
imports this. Three differences are mended:
  * float32 -> bfloat16 conversion: the interpreter truncates, the GPU (and torch) round to
    nearest even, so bf16 results could not be held to the GPU's rounding;
  * float8_e4m3fn conversions (the fp8 KV cache): the interpreter's bit-shuffling treats e4m3fn
    like an IEEE format (it has no infinities, and its top exponent holds finite values) and
    truncates; torch converts as the GPU's cvt.rn does;
  * scalars a kernel loads are one-element arrays there, and `int()` of one (a `range()` over
    loaded bounds) fails under numpy 2: convert through `.item()`;
  * tl.dot of bfloat16 operands: the interpreter multiplies their raw 16-bit patterns (numpy has
    no bfloat16); the GPU's products of two bf16 values are exact in float32, so the operands
    are widened to float32 first.
"""

from __future__ import annotations

from typing import Any

_state = {"patched": False}


def patch_interpreter() -> None:
    """Apply the mends (idempotent). Call after TRITON_INTERPRET=1 is set, before any launch."""
    if _state["patched"]:
        return
    import numpy as np
    import torch
    import triton.language as tl
    import triton.runtime.interpreter as interp

    truncating = interp._convert_float
    rtne = interp._ir.ROUNDING_MODE.RTNE
    # (triton dtype, torch dtype, numpy bits of one element)
    uint_of = {np.uint8: torch.uint8, np.uint16: torch.uint16, np.uint32: torch.uint32}
    fp8_types = {tl.float8e4nv: (torch.float8_e4m3fn, np.uint8), tl.float32: (torch.float32, np.uint32),
                 tl.bfloat16: (torch.bfloat16, np.uint16), tl.float16: (torch.float16, np.uint16)}  # fmt: skip

    def convert_float(data: Any, src: Any, dst: Any, rounding_mode: Any) -> Any:
        if src == tl.float32 and dst == tl.bfloat16 and rounding_mode in (None, "rtne"):
            arr = np.ascontiguousarray(data).view(np.float32)
            return torch.from_numpy(arr).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        if tl.float8e4nv in (src, dst) and src in fp8_types and dst in fp8_types and rounding_mode in (None, rtne):
            (t_src, n_src), (t_dst, n_dst) = fp8_types[src], fp8_types[dst]
            y = torch.from_numpy(np.ascontiguousarray(data).view(n_src)).view(t_src).to(t_dst)
            return y.view(uint_of[n_dst]).numpy()
        return truncating(data, src, dst, rounding_mode)

    patch_tensor = interp._patch_lang_tensor

    def patch_tensor_scalars(tensor: Any, scope: Any) -> None:
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0].item()))

    create_dot = interp.InterpreterBuilder.create_dot

    def create_dot_bf16(self: Any, a: Any, b: Any, d: Any, input_precision: Any, max_num_imprecise_acc: Any) -> Any:
        if a.dtype == tl.bfloat16 or b.dtype == tl.bfloat16:
            a, b = (interp.TensorHandle(truncating(t.data, t.dtype, tl.float32, None).view(np.float32), tl.float32)
                    if t.dtype == tl.bfloat16 else t for t in (a, b))  # fmt: skip
        return create_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    interp._convert_float = convert_float
    interp.InterpreterBuilder.create_dot = create_dot_bf16
    interp._patch_lang_tensor = patch_tensor_scalars
    _state["patched"] = True
