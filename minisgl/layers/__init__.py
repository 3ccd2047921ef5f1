"""Model building blocks, each with a tensor-parallel sharding contract.

Contract for every layer holding weights: parameters are created at their *local* (per-rank)
shape, and `shard(param_name, full, part)` returns this rank's slice of a checkpoint tensor.
`full` is a lazy `models.weight.CheckpointTensor` (shape, dtype, narrow, new_zeros, read): slice
it with `narrow`/`narrow_rank`, which read only that slice from the file, or return it whole
(replicated). Layers whose parameter merges several checkpoint tensors (q/k/v, gate/up, experts) list
them in `parts(param_name)` and concatenate them with `merge(param_name, {part: shard})`.
"""

from minisgl.layers.activation import silu_and_mul
from minisgl.layers.attention import AttentionLayer
from minisgl.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from minisgl.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from minisgl.layers.norm import RMSNorm
from minisgl.layers.rotary import RotaryEmbedding, get_rope, set_rope_device

__all__ = [
    "silu_and_mul",
    "AttentionLayer",
    "ParallelLMHead",
    "VocabParallelEmbedding",
    "ColumnParallelLinear",
    "MergedColumnParallelLinear",
    "QKVParallelLinear",
    "ReplicatedLinear",
    "RowParallelLinear",
    "RMSNorm",
    "RotaryEmbedding",
    "get_rope",
    "set_rope_device",
]
