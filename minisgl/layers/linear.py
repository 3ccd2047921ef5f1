"""Linear layers with Megatron-style sharding.

Column-parallel: the output features are split over ranks; no communication.
Row-parallel: the input features are split; partial outputs are summed with an all-reduce.
A column-parallel layer followed by a row-parallel one (qkv -> o, gate_up -> down) needs exactly
one all-reduce per block.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, List, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.distributed import all_reduce, get_tp_info
from minisgl.layers.activation import silu_and_mul
from minisgl.layers.base import ShardedModule, narrow_rank
from minisgl.utils.misc import div_even

if TYPE_CHECKING:
    from minisgl.kernel.skinny import Kind, SkinnyPlan
    from minisgl.layers.quant import QuantLinear


class _Linear(ShardedModule):
    # The CPU implementation of this op, bound once at engine init (engine/cpu_decode.py
    # bind_cpu_gemms, tp == 1): a `QuantLinear` over this module's own weight (bias included)
    # that picks the C GEMM per row count (skinny GEMV, AMX tiles, the quantized records), and
    # the only reader of a weight kept in the AMX tile layout, which F.linear cannot read.
    cpu_gemm: "QuantLinear | None" = None
    # How the owning block calls this projection: "plain" (forward), or through
    # layers.norm_linear with its pre-norm ("norm") and SiLU-and-mul ("gated"). The CUDA plan
    # (kernel/skinny.py) measures each projection in that role and, bound here as `skinny`, takes
    # the fused GEMV where it won.
    fused_kind: "Kind" = "plain"
    skinny: "SkinnyPlan | None" = None
    # An FP8 weight kept as FP8 (CUDA; layers/fp8.py): `weight` is float8_e4m3fn and these are
    # its float32 scales per (weight_block_n rows x 128 columns); the projection then runs the
    # W8A8 FP8 GEMM (kernel/triton_fp8.py) instead of F.linear. None: a dense weight.
    weight_scale: torch.Tensor | None = None
    weight_block_n: int = 0
    # An int4 weight kept as 4-bit codes (CUDA; layers/int4.py): `weight` is int32 [N, K / 8]
    # packed codes, `weight_scale` its scales per (row, weight_group columns) in the model dtype
    # and these its zero points; the projection then runs the W4A16 GEMM (kernel/triton_int4.py).
    weight_zero: torch.Tensor | None = None
    weight_group: int = 0

    def __init__(self, in_local: int, out_local: int, bias: bool) -> None:
        super().__init__()
        self.in_local, self.out_local = in_local, out_local
        self.weight = nn.Parameter(torch.empty(out_local, in_local), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_local), requires_grad=False) if bias else None

    def _fast(self, x: torch.Tensor) -> torch.Tensor | None:
        """The bound fast implementation's output (bias included), or None for F.linear.
        Both exist at tp == 1 only, so a row-parallel layer needs no all-reduce after them."""
        if self.cpu_gemm is not None:
            return self.cpu_gemm(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], -1)
        if self.skinny is not None and self.fused_kind == "plain":
            out = self.skinny.run("plain", x, self.weight)
            return out[0] if out is not None else None
        return None

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x W^T (+ bias) on this rank's weight: F.linear, the W4A16 GEMM for an int4 weight or
        the FP8 GEMM for an FP8 one."""
        if self.weight_zero is not None:
            from minisgl.layers.int4 import int4_linear

            assert self.weight_scale is not None
            return int4_linear(x, self.weight, self.weight_scale, self.weight_zero, self.weight_group, bias)
        if self.weight_scale is not None:
            from minisgl.layers.fp8 import fp8_linear

            return fp8_linear(x, self.weight, self.weight_scale, self.weight_block_n, bias)
        return F.linear(x, self.weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._fast(x)
        return y if y is not None else self._matmul(x, self.bias)

    def forward_silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of this [gate | up] projection of x: one pass over the weight where the
        bound CPU GEMM fuses the SiLU (the same bits as the two steps), else the two ops."""
        if self.cpu_gemm is not None:
            flat = x.reshape(-1, x.shape[-1])
            act = self.cpu_gemm.silu_and_mul(flat)
            if act is not None:
                return act.view(*x.shape[:-1], -1)
        return silu_and_mul(self(x))


class ReplicatedLinear(_Linear):
    """Every rank holds the whole matrix (small layers such as the MoE router)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, out_features, bias)


class ColumnParallelLinear(_Linear):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        tp = get_tp_info()
        super().__init__(in_features, div_even(out_features, tp.size), bias)

    def shard(self, param_name: str, full: torch.Tensor, part: Any = None) -> torch.Tensor:
        return narrow_rank(full, 0, self.out_local, get_tp_info().rank)


class MergedColumnParallelLinear(_Linear):
    """Several column-parallel outputs stored as one matrix, e.g. gate_proj and up_proj."""

    def __init__(self, in_features: int, out_features: List[int], bias: bool = False) -> None:
        tp = get_tp_info()
        self.part_sizes = [div_even(n, tp.size) for n in out_features]
        super().__init__(in_features, sum(self.part_sizes), bias)

    def parts(self, param_name: str) -> Sequence[Any]:
        return list(range(len(self.part_sizes)))

    def shard(self, param_name: str, full: torch.Tensor, part: Any = None) -> torch.Tensor:
        return narrow_rank(full, 0, self.part_sizes[part], get_tp_info().rank)


class QKVParallelLinear(_Linear):
    """q, k and v projections in one matrix, split by heads. When there are fewer KV heads than
    ranks, each rank keeps a replica of the KV head its query heads attend to."""

    def __init__(self, hidden: int, head_dim: int, num_q_heads: int, num_kv_heads: int, bias: bool) -> None:
        tp = get_tp_info()
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.local_q_heads = div_even(num_q_heads, tp.size)
        self.local_kv_heads = div_even(num_kv_heads, tp.size, allow_replicate=True)
        self.q_size = self.local_q_heads * head_dim
        self.kv_size = self.local_kv_heads * head_dim
        super().__init__(hidden, self.q_size + 2 * self.kv_size, bias)

    def parts(self, param_name: str) -> Sequence[Any]:
        return ("q", "k", "v")

    def shard(self, param_name: str, full: torch.Tensor, part: Any = None) -> torch.Tensor:
        tp = get_tp_info()
        if part == "q":
            return narrow_rank(full, 0, self.q_size, tp.rank)
        kv_index = tp.rank * self.num_kv_heads // tp.size if self.num_kv_heads < tp.size else tp.rank
        return narrow_rank(full, 0, self.kv_size, kv_index)


class RowParallelLinear(_Linear):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        tp = get_tp_info()
        super().__init__(div_even(in_features, tp.size), out_features, bias)

    def shard(self, param_name: str, full: torch.Tensor, part: Any = None) -> torch.Tensor:
        if param_name == "bias":
            return full  # added once, after the all-reduce
        return narrow_rank(full, 1, self.in_local, get_tp_info().rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._fast(x)
        if y is not None:
            return y
        y = all_reduce(self._matmul(x, None))
        return y + self.bias if self.bias is not None else y
