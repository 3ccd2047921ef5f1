"""Batch-invariant matrix products for `--deterministic`.

A GEMM library picks its kernel, tiling and split of the reduction by the problem's shape, so
row i of `x @ W.T` can round differently when x has 1, 7 or 300 rows (measured on this CPU in
fp32; cuBLAS does the same on CUDA). On CUDA every product is one launch of a Triton GEMM whose
tiles and reduction order are fixed per weight, never by the row count
(kernel/triton_bi_matmul.py); a CUDA graph captures it like any kernel. On the CPU every product
runs at one fixed shape: the rows are cut into tiles of ROWS (the last one zero-padded), and each
tile is one call of the same [ROWS, K] x [K, N] problem, so every row goes through the same
kernel with the same reduction order wherever it sits and whatever shares the batch.

Installed as a TorchFunctionMode around the model's forward (F.linear is the only matrix
product of the decoder layers and the LM head), so the layers stay unchanged.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Sequence

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

ROWS = 32  # CPU: oneDNN/MKL tile; small, as batch-1 decode pads to it


def batch_invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if x.is_cuda:
        from minisgl.kernel.triton_bi_matmul import bi_matmul

        return bi_matmul(x, weight, bias)
    lead = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1])
    m = flat.shape[0]
    rows = ROWS
    pad = (-m) % rows
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad, flat.shape[1])])
    out = torch.empty((flat.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
    for start in range(0, flat.shape[0], rows):
        torch.mm(flat[start : start + rows], weight.t(), out=out[start : start + rows])
    if bias is not None:
        out += bias  # elementwise: exact per row
    return out[:m].view(*lead, weight.shape[0])


class BatchInvariantMode(TorchFunctionMode):
    def __torch_function__(
        self, func: Callable, types: Sequence[type], args: Sequence[Any] = (), kwargs: Dict[str, Any] | None = None
    ) -> Any:
        if func is F.linear:
            return batch_invariant_linear(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))
