"""Batch-invariant attention (`--deterministic`): every query's result depends only on its own
query vector and its keys, never on which other tokens share the step, how the prompt was
chunked, or whether its prefix came from the cache.

Why the other backends are not: they pick split sizes, tiles and kernels by batch shape (the
number of queries, the longest sequence), so a query's reduction order changes with the batch.
Here the reduction order is fixed per query: keys are visited in blocks of BLOCK positions
aligned to position 0, each block reduced at a fixed size (masked positions are exact no-ops:
a score of -inf adds 0 and rescales by exp(0) = 1), and the blocks are combined in order with an
online softmax in float32. Every sum and max is a fixed pairwise tree of elementwise ops
(`_tree`), not a library reduction or a matmul, whose thread split follows the tensor shapes
(on CUDA a reduction's block layout depends on how many outputs it has). One code path serves prefill, chunked prefill and decode, so a
token computed in a decode step equals the same token recomputed in a prefill.

Gemma's options (a per-layer sliding window, soft-capped scores, another scale) change only
which positions of a block are valid and each score, never the walk: blocks wholly before a
query's window are exact no-ops as well (hence a finite running max: a query may see no key of its
first blocks).

On CUDA the same walk runs as one Triton program per (query, head)
(`kernel/triton_deterministic.py`); the torch version here serves the CPU. It is slow (no key
reuse across queries) and meant for reproducibility, not speed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, List

import torch

from minisgl.attention.base import AttnCap, BaseAttnBackend, BaseAttnMetadata
from minisgl.core import Batch
from minisgl.models.config import ModelConfig
from minisgl.utils.device import make_device_tensor

BLOCK = 64  # key positions reduced together
QUERY_CHUNK = 128  # queries processed together (bounds the gathered blocks' memory)


@dataclass
class DeterministicAttnMetadata(BaseAttnMetadata):
    rows: torch.Tensor  # [T] page-table row of each query token
    positions: torch.Tensor  # [T] its position: it attends keys [0, position]
    chunk_blocks: List[int]  # per QUERY_CHUNK of queries: key blocks that chunk needs


class DeterministicAttnBackend(BaseAttnBackend):
    attention_features = ("sliding_window", "attn_logit_softcapping", "query_pre_attn_scalar")

    def prepare_metadata(self, batch: Batch) -> None:
        rows: List[int] = []
        positions: List[int] = []
        last: List[int] = []
        for r in batch.padded_reqs:
            rows += [r.table_idx] * r.extend_len
            positions += range(r.cached_len, r.device_len)
            last.append(len(positions) - 1)
        batch.attn_metadata = DeterministicAttnMetadata(
            last_indices=make_device_tensor(last, torch.int64, self.device),
            rows=make_device_tensor(rows, torch.int64, self.device),
            positions=make_device_tensor(positions, torch.int64, self.device),
            chunk_blocks=chunk_blocks(positions),
        )

    def attend(self, q: torch.Tensor, layer_id: int, batch: Batch, sinks: torch.Tensor | None = None) -> torch.Tensor:
        meta: DeterministicAttnMetadata = batch.attn_metadata
        k_cache, v_cache = self.kv_cache.k_cache(layer_id), self.kv_cache.v_cache(layer_id)
        window = self.model_config.window_of(layer_id)
        if q.is_cuda:
            from minisgl.kernel.triton_deterministic import deterministic_attention

            return deterministic_attention(
                q, k_cache, v_cache, self.page_table, meta.rows, meta.positions,
                sm_scale=self.model_config.softmax_scale, window=window, softcap=self.model_config.attn_logit_softcapping,
                translation=self.kv_cache.translation_of(layer_id),
            )  # fmt: skip
        return attend_walk(q, meta.rows, meta.positions, meta.chunk_blocks, k_cache, v_cache, self.page_table, self.model_config, window,
                           self.kv_cache.translation_of(layer_id))  # fmt: skip

    # ---- CUDA graphs of decode steps: the kernel reads each query's row and position from device
    # memory and derives its own key range, so one captured launch serves every batch of its size
    caps = AttnCap.DECODE_GRAPH

    def init_capture_graph(self, max_seq_len: int, bs_list: List[int]) -> None:
        max_bs = max(bs_list)
        self._graph_meta = torch.zeros((3, max_bs), dtype=torch.int64, device=self.device)  # rows, positions, last
        self._graph_meta[2] = torch.arange(max_bs, device=self.device)  # one token per row: static

    def prepare_for_capture(self, batch: Batch) -> None:
        bs = batch.padded_size
        rows, positions, last = self._graph_meta[:, :bs]
        rows.fill_(batch.padded_reqs[0].table_idx)  # the dummy request: position 0 on the dummy page
        positions.fill_(0)
        batch.attn_metadata = DeterministicAttnMetadata(last_indices=last, rows=rows, positions=positions, chunk_blocks=[1])

    def prepare_for_replay(self, batch: Batch) -> None:
        meta: DeterministicAttnMetadata = batch.attn_metadata
        bs = batch.padded_size
        assert meta.rows.numel() == bs, "prepare_metadata(batch) of a decode batch first"
        self._graph_meta[0, :bs].copy_(meta.rows)
        self._graph_meta[1, :bs].copy_(meta.positions)


def chunk_blocks(positions: List[int]) -> List[int]:
    """Per QUERY_CHUNK of queries: how many key blocks the walk visits for that chunk."""
    return [max(positions[i : i + QUERY_CHUNK]) // BLOCK + 1 for i in range(0, len(positions), QUERY_CHUNK)]


def attend_walk(q: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, blocks: List[int], k_cache: torch.Tensor,
                v_cache: torch.Tensor, page_table: torch.Tensor, cfg: ModelConfig, window: int | None,
                translation: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """The walk in torch ops (CPU): query token t ([T, Hq, D]) attends the keys of page-table row
    rows[t] at positions [0, positions[t]], QUERY_CHUNK queries at a time (`blocks`: chunk_blocks);
    `translation`: the page table's slot -> a slot of k/v_cache (a hybrid pool's sliding layer)."""
    out = torch.empty_like(q)
    for c, num_blocks in enumerate(blocks):
        lo, hi = c * QUERY_CHUNK, min((c + 1) * QUERY_CHUNK, q.shape[0])
        out[lo:hi] = _attend_chunk(q[lo:hi], rows[lo:hi], positions[lo:hi], num_blocks, k_cache, v_cache, page_table, cfg, window,
                                   translation)  # fmt: skip
    return out


def _attend_chunk(
    q: torch.Tensor,
    rows: torch.Tensor,
    positions: torch.Tensor,
    num_blocks: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cfg: ModelConfig,
    window: int | None = None,
    translation: torch.Tensor | None = None,
) -> torch.Tensor:
    n, hq, d = q.shape
    hk = k_cache.shape[1]
    sm_scale = cfg.attn_scale if cfg.attn_scale is not None else 1.0 / math.sqrt(d)
    cap = cfg.attn_logit_softcapping
    # [n, 1, Hk, G, D]: one key block broadcasts over the G query heads of its KV head
    qf = (q.float() * sm_scale).view(n, 1, hk, hq // hk, d)
    width = page_table.shape[1]
    offsets = torch.arange(BLOCK, device=q.device)
    # finite: a block wholly outside a query's window leaves it unchanged (exp(-inf) = 0,
    # rescale exp(0) = 1); without a window key 0 is always visible and no bit changes
    m = torch.full((n, hk, hq // hk), -1.0e30, device=q.device)
    denom = torch.zeros_like(m)
    acc = torch.zeros((n, hk, hq // hk, d), device=q.device)
    for j in range(num_blocks):
        cols = j * BLOCK + offsets
        valid = cols[None, :] <= positions[:, None]  # [n, BLOCK]
        if window is not None:
            valid &= cols[None, :] > positions[:, None] - window
        slots = page_table[rows[:, None], cols.clamp(max=width - 1)[None, :]].long()
        if translation is not None:
            slots = translation[slots]
        keys = k_cache[slots].float()  # [n, BLOCK, Hk, D]
        scores = _tree(qf * keys[:, :, :, None, :], -1, torch.add)  # [n, BLOCK, Hk, G]
        if cap is not None:
            scores = torch.tanh(scores / cap) * cap
        scores = torch.where(valid[:, :, None, None], scores, float("-inf"))
        m_new = torch.maximum(m, _tree(scores, 1, torch.maximum))
        probs = torch.exp(scores - m_new[:, None])
        scale = torch.exp(m - m_new)
        values = torch.where(valid[:, :, None, None], v_cache[slots].float(), 0.0)  # unwritten slots may hold nan
        denom = denom * scale + _tree(probs, 1, torch.add)
        acc = acc * scale[..., None] + _tree(probs[..., None] * values[:, :, :, None, :], 1, torch.add)
        m = m_new
    return (acc / denom[..., None]).view(n, hq, d).to(q.dtype)


def _tree(x: torch.Tensor, dim: int, op: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Reduce `dim` by halving: element i is combined with element i + size/2 until one is
    left. Elementwise ops only, so the result is the same bits whatever the other dims hold.
    A size that is not a power of two is padded with the op's identity (0 or -inf)."""
    size = x.shape[dim]
    width = 1 << (size - 1).bit_length()
    if width != size:
        fill = 0.0 if op is torch.add else float("-inf")
        pad_shape = list(x.shape)
        pad_shape[dim] = width - size
        x = torch.cat([x, x.new_full(pad_shape, fill)], dim)
    while width > 1:
        width //= 2
        x = op(x.narrow(dim, 0, width), x.narrow(dim, width, width))
    return x.squeeze(dim)
