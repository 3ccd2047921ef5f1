"""Step runners: the ways one forward step can run, tried in an order fixed at engine init.

Every runner executes the same model definition (models/ + layers/): CUDA graphs replay what the
module path captured, the CPU decode loop (engine/cpu_decode.py) runs the same layers' weights
through the same C kernels in one call. The engine keeps an ordered list and runs a step on the
first runner whose `can_run(batch)` holds; the module path accepts every batch, so it is always
last.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch
from torch import nn

from minisgl.core import Batch
from minisgl.layers.batch_invariant import BatchInvariantMode


class StepRunner(Protocol):
    def can_run(self, batch: Batch) -> bool: ...

    def run(self, batch: Batch) -> torch.Tensor:
        """Logits of the step's rows (one per padded request), inside ctx.forward_batch(batch)."""
        ...


class ModuleRunner:
    """The model's own forward, eagerly: every batch. With `gemm_tiles` (deterministic mode where
    some GEMM has no batch-invariant C kernel) F.linear runs as fixed-shape tiles
    (layers/batch_invariant.py)."""

    def __init__(self, model: nn.Module, gemm_tiles: bool = False) -> None:
        self.model, self.gemm_tiles = model, gemm_tiles

    def can_run(self, batch: Batch) -> bool:
        return True

    def run(self, batch: Batch) -> torch.Tensor:
        if self.gemm_tiles:
            with BatchInvariantMode():
                return self.model.forward()
        return self.model.forward()


def pick_runner(runners: Sequence[StepRunner], batch: Batch) -> StepRunner:
    for runner in runners:
        if runner.can_run(batch):
            return runner
    raise RuntimeError("no step runner accepts this batch (the module path should accept every batch)")
