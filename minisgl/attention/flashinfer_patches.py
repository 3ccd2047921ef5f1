"""Host-time mends for FlashInfer 0.7's Python planning code (imported without flashinfer, so the
CPU tests check them).

`plan()` of the decode and prefill wrappers takes `max(kv_lens_arr_host).item()` of a host tensor
of batch size. Python's max iterates the tensor element by element: one 0-d tensor and one
comparison op per request, which at large batches costs more host time per decode step than the
rest of the backend's per-step metadata (cProfile of the offline recipe, docs/PERFORMANCE.md). Those modules look `max` up in their own globals before the
builtins, so pointing that name at `tensor_max` there changes nothing else.
"""

from __future__ import annotations

import builtins
from types import ModuleType
from typing import Any

import torch


def tensor_max(*args: Any, **kwargs: Any) -> Any:
    """builtins.max, except that one non-empty 1-D tensor is reduced by Tensor.max(): the same
    value (a 0-d tensor, as max() of its elements gives) in one op instead of one per element."""
    if len(args) == 1 and not kwargs and isinstance(args[0], torch.Tensor) and args[0].dim() == 1 and args[0].numel() > 0:
        return args[0].max()
    return builtins.max(*args, **kwargs)


def patch_tensor_max(*modules: ModuleType) -> None:
    """Make `max` inside each module `tensor_max` (idempotent)."""
    for module in modules:
        module.max = tensor_max  # type: ignore[attr-defined]
