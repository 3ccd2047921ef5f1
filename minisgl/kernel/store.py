"""Write this step's K/V into their pool slots."""

from __future__ import annotations

import torch


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out_loc: torch.Tensor) -> None:
    # index_copy_ is one kernel per tensor on both CPU and CUDA and is capturable in a graph.
    idx = out_loc.long() if out_loc.dtype != torch.int64 else out_loc
    k_cache.index_copy_(0, idx, k.to(k_cache.dtype))
    v_cache.index_copy_(0, idx, v.to(v_cache.dtype))
