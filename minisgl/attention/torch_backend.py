"""Reference attention on torch SDPA over the paged pool: any device, page_size, GQA.

Prefill runs one SDPA per request (queries [cached_len, device_len) against keys
[0, device_len), causal with the cached-prefix offset). Decode gathers every request's keys into a
padded [B, max_len] block and runs one masked SDPA for the whole batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Tuple

import torch
import torch.nn.functional as F

from minisgl.attention.base import BaseAttnBackend, BaseAttnMetadata
from minisgl.core import Batch, Req
from minisgl.utils.device import make_device_tensor


@dataclass
class TorchPrefillSeq:
    q_start: int
    q_len: int
    slots: torch.Tensor  # [seq_len] pool slots of this request's keys
    mask: torch.Tensor | None  # [q_len, seq_len] bool, None when plainly causal (no cached prefix)


@dataclass
class TorchAttnMetadata(BaseAttnMetadata):
    # What attention reads, built on its first call (`TorchAttnBackend._views`): a step that
    # never reaches `attend` (the cpu backend's kernels took it) builds none of it.
    reqs: List[Req] = field(default_factory=list)
    is_decode: bool = False
    prefill: List[TorchPrefillSeq] | None = None
    decode_slots: torch.Tensor | None = None  # [B, max_len]
    decode_mask: torch.Tensor | None = None  # [B, 1, 1, max_len]
    built: bool = False


class TorchAttnBackend(BaseAttnBackend):
    kv_cache_dtypes: Tuple[str, ...] = ("auto", "fp8_e4m3", "int8")  # it dequantizes what it gathers (KVCachePool.gather)

    @property
    def _compute_dtype(self) -> torch.dtype:
        # CPU SDPA in bf16/fp16 is several times slower than in fp32 (docs/PERFORMANCE.md, "CPU
        # forward"), so CPU attends in fp32 on gathered (contiguous) keys.
        return torch.float32 if self.device.type == "cpu" else self.kv_cache.model_dtype

    def prepare_metadata(self, batch: Batch) -> None:
        reqs = batch.padded_reqs
        last = make_device_tensor(list(_cumsum([r.extend_len for r in reqs])), torch.int64, self.device) - 1
        batch.attn_metadata = TorchAttnMetadata(last, reqs=reqs, is_decode=batch.is_decode)

    def _views(self, meta: TorchAttnMetadata) -> TorchAttnMetadata:
        if meta.built:
            return meta
        reqs = meta.reqs
        if meta.is_decode:
            rows = make_device_tensor([r.table_idx for r in reqs], torch.int64, self.device)
            seq_lens = make_device_tensor([r.device_len for r in reqs], torch.int64, self.device)
            max_len = max(r.device_len for r in reqs)
            meta.decode_slots = self.page_table[rows, :max_len].long()
            valid = torch.arange(max_len, device=self.device)[None, :] < seq_lens[:, None]
            meta.decode_mask = valid[:, None, None, :]
        else:
            seqs: List[TorchPrefillSeq] = []
            start = 0
            for r in reqs:
                slots = self.page_table[r.table_idx, : r.device_len].long()
                mask = None
                if r.cached_len > 0:
                    q_pos = torch.arange(r.cached_len, r.device_len, device=self.device)
                    mask = torch.arange(r.device_len, device=self.device)[None, :] <= q_pos[:, None]
                seqs.append(TorchPrefillSeq(start, r.extend_len, slots, mask))
                start += r.extend_len
            meta.prefill = seqs
        meta.built = True
        return meta

    def attend(self, q: torch.Tensor, layer_id: int, batch: Batch) -> torch.Tensor:
        meta = self._views(batch.attn_metadata)
        cast = self._compute_dtype
        if meta.decode_slots is not None:
            keys, values = self.kv_cache.gather(layer_id, meta.decode_slots, cast)
            keys, values = keys.transpose(1, 2), values.transpose(1, 2)  # [B, Hk, S, D]
            o = F.scaled_dot_product_attention(q.unsqueeze(2).to(keys.dtype), keys, values, attn_mask=meta.decode_mask, enable_gqa=True)
            return o.squeeze(2).to(q.dtype)
        out = torch.empty_like(q)
        for s in meta.prefill or []:
            qi = q[s.q_start : s.q_start + s.q_len].transpose(0, 1)  # [Hq, L, D]
            ki, vi = self.kv_cache.gather(layer_id, s.slots, cast)
            ki, vi = ki.transpose(0, 1), vi.transpose(0, 1)  # [Hk, S, D]
            oi = F.scaled_dot_product_attention(qi.to(ki.dtype), ki, vi, attn_mask=s.mask, is_causal=s.mask is None, enable_gqa=True)
            out[s.q_start : s.q_start + s.q_len] = oi.transpose(0, 1).to(q.dtype)
        return out


def _cumsum(xs: List[int]) -> Tuple[int, ...]:
    total, out = 0, []
    for x in xs:
        total += x
        out.append(total)
    return tuple(out)
