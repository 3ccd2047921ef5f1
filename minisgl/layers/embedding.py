"""Vocab-parallel embedding and LM head: each rank owns a contiguous slice of the vocabulary."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.distributed import all_gather_last_dim, all_reduce, get_tp_info
from minisgl.layers.base import ShardedModule, narrow_rank
from minisgl.utils.misc import div_ceil

if TYPE_CHECKING:
    from minisgl.layers.quant import QuantLinear


class VocabParallelEmbedding(ShardedModule):
    # Granite's embedding_multiplier (the embedding's output, times this)
    multiplier: float = 1.0

    def __init__(self, vocab_size: int, hidden: int) -> None:
        super().__init__()
        tp = get_tp_info()
        self.vocab_size = vocab_size
        self.local_vocab = div_ceil(vocab_size, tp.size)
        self.vocab_start = tp.rank * self.local_vocab
        self.weight = nn.Parameter(torch.empty(self.local_vocab, hidden), requires_grad=False)

    def shard(self, param_name: str, full: torch.Tensor, part: Any = None) -> torch.Tensor:
        return narrow_rank(full, 0, self.local_vocab, get_tp_info().rank)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = self._lookup(ids)
        return out if self.multiplier == 1.0 else out * self.multiplier

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if get_tp_info().size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.local_vocab)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return all_reduce(out.masked_fill(outside.unsqueeze(-1), 0.0))


class ParallelLMHead(VocabParallelEmbedding):
    """Projects hidden states to logits; ranks compute their vocab slice and gather."""

    # the CPU GEMM over this weight (tp == 1), bound at engine init as on the linear layers
    cpu_gemm: "QuantLinear | None" = None
    # Granite's logits_scaling: logits are divided by it. Here, inside the head, so every step
    # runner (the module path, graphs, the CPU loop, prompt logprobs) sees the same logits.
    logits_scaling: float = 1.0
    # Gemma 2's final_logit_softcapping: logits = tanh(logits / c) * c, here for the same reason
    softcap: float | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        logits = self._project(hidden)
        logits = logits if self.logits_scaling == 1.0 else logits / self.logits_scaling
        return logits if self.softcap is None else torch.tanh(logits / self.softcap) * self.softcap

    def _project(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.cpu_gemm is not None:
            return self.cpu_gemm(hidden.reshape(-1, hidden.shape[-1])).view(*hidden.shape[:-1], -1)
        logits = F.linear(hidden, self.weight)
        if get_tp_info().size == 1:
            return logits
        return all_gather_last_dim(logits)[..., : self.vocab_size]
