"""Where a GEMM program's output tile lies: shared by the Triton GEMMs (FP8, int4, the
batch-invariant one, the fused MoE)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def grouped_tile(pid, num_m, num_n, GROUP_M: tl.constexpr):
    """(row tile, column tile) of program `pid` in grouped launch order: GROUP_M row tiles walk one
    band of column tiles together, so each weight tile is read while it is still in L2. Only the
    order of programs changes: no output's arithmetic depends on it."""
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    rows = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % rows, (pid % per_group) // rows
