"""Reference attention on torch SDPA over the paged pool: any device, page_size, GQA.

Prefill runs one SDPA per request (queries [cached_len, device_len) against keys
[0, device_len), causal with the cached-prefix offset). Decode gathers every request's keys into a
padded [B, max_len] block and runs one masked SDPA for the whole batch.

It is the reference for the per-layer options of ModelConfig (Gemma): a sliding window (a query
at position p sees keys at positions > p - window, transformers' `sliding_window_overlay`), the
score scale, tanh soft-capping of the scores and GPT-OSS's attention sinks (a learned logit per
query head that joins the softmax denominator and weighs no value); with a soft-cap or sinks
attention is spelled out (SDPA has neither), softmax in float32 as transformers' eager attention.

Latent attention (DeepSeek's MLA, "latent_attention") is MQA over the latent pool: one key
"head" per token, [c_kv | k_pe], whose first kv_lora_rank values are also the value; the model
hands in queries already absorbed into latent space ([q_nope W_UK | q_pe]) and gets back
[T, Hq, kv_lora_rank], which it expands through W_UV itself (models/deepseek.py). On CUDA, over
a pool in the model dtype or fp8_e4m3, its decode steps read the latent in place through a Triton kernel
(kernel/triton_mla.py) instead of gathering it, and replay CUDA graphs (AttnCap.DECODE_GRAPH, for
latent pools only: the hooks keep the rows and lengths the kernel reads in static buffers);
prefill and the CPU take SDPA.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Tuple

import torch
import torch.nn.functional as F

from minisgl.attention.base import AttnCap, BaseAttnBackend, BaseAttnMetadata
from minisgl.core import Batch, Req
from minisgl.kernel.fused import use_fused_on
from minisgl.models.config import ModelConfig
from minisgl.utils.device import make_device_tensor


@dataclass
class TorchPrefillSeq:
    q_start: int
    q_len: int
    slots: torch.Tensor  # [seq_len] pool slots of this request's keys
    mask: torch.Tensor | None  # [q_len, seq_len] bool, None when plainly causal (no cached prefix)
    # the masks of windowed layers, by window, made on first use
    window_masks: Dict[int, torch.Tensor] = field(default_factory=dict)


def window_mask(q_pos: torch.Tensor, k_len: int, window: int | None) -> torch.Tensor:
    """[len(q_pos), k_len] bool: key j is visible to the query at position p when j <= p and,
    with a window, j > p - window (so each query sees at most `window` keys, itself included)."""
    k_pos = torch.arange(k_len, device=q_pos.device)[None, :]
    mask = k_pos <= q_pos[:, None]
    if window is not None:
        mask &= k_pos > q_pos[:, None] - window
    return mask


@dataclass
class TorchAttnMetadata(BaseAttnMetadata):
    # What attention reads, built on its first call (`TorchAttnBackend._views`): a step that
    # never reaches `attend` (the cpu backend's kernels took it) builds none of it.
    reqs: List[Req] = field(default_factory=list)
    is_decode: bool = False
    prefill: List[TorchPrefillSeq] | None = None
    decode_slots: torch.Tensor | None = None  # [B, max_len]
    decode_mask: torch.Tensor | None = None  # [B, 1, 1, max_len]
    decode_lens: torch.Tensor | None = None  # [B]
    decode_rows: torch.Tensor | None = None  # [B] page-table rows
    decode_window_masks: Dict[int, torch.Tensor] = field(default_factory=dict)
    built: bool = False


class TorchAttnBackend(BaseAttnBackend):
    kv_cache_dtypes: Tuple[str, ...] = ("auto", "fp8_e4m3", "int8")  # it dequantizes what it gathers (KVCachePool.gather)
    attention_features: Tuple[str, ...] = (
        "sliding_window", "attn_logit_softcapping", "query_pre_attn_scalar", "attention_sinks", "latent_attention",
    )  # fmt: skip

    def __init__(self, model_config: ModelConfig) -> None:
        super().__init__(model_config)
        # Latent decode on CUDA runs the MLA kernel, whose launch depends on the batch size alone
        # (its chunk count too, `_latent_decode`): those steps can replay CUDA graphs.
        pool_ok = self.kv_cache.dtype in (self.kv_cache.model_dtype, torch.float8_e4m3fn)
        self._mla = self.kv_cache.latent and use_fused_on(self.device) and pool_ok
        if self._mla:
            self.caps = AttnCap.DECODE_GRAPH
        self._graph: Dict[str, torch.Tensor] = {}
        self._num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count if self._mla else 0

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
            meta.decode_lens, meta.decode_rows = seq_lens, rows
            if not self._mla:  # (the MLA kernel reads the page table itself)
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

    def _decode_mask(self, meta: TorchAttnMetadata, window: int | None) -> torch.Tensor:
        assert meta.decode_mask is not None and meta.decode_lens is not None
        if window is None:
            return meta.decode_mask
        if window not in meta.decode_window_masks:  # the query is at position len - 1
            k_pos = torch.arange(meta.decode_mask.shape[-1], device=self.device)[None, :]
            recent = k_pos >= meta.decode_lens[:, None] - window
            meta.decode_window_masks[window] = meta.decode_mask & recent[:, None, None, :]
        return meta.decode_window_masks[window]

    @staticmethod
    def _prefill_mask(s: TorchPrefillSeq, window: int | None) -> torch.Tensor | None:
        if window is None:
            return s.mask
        if window not in s.window_masks:
            k_len = s.slots.shape[0]
            s.window_masks[window] = window_mask(torch.arange(k_len - s.q_len, k_len, device=s.slots.device), k_len, window)
        return s.window_masks[window]

    # ---- latent decode on CUDA: kernel/triton_mla.py (the CPU gathers and runs SDPA) ----
    def _latent_decode(self, q: torch.Tensor, layer_id: int, meta: TorchAttnMetadata) -> torch.Tensor:
        from minisgl.kernel.triton_mla import mla_decode, num_splits_for

        assert meta.decode_rows is not None and meta.decode_lens is not None and self.kv_cache.v_dim is not None
        # chunks by the batch size and the longest possible context, so an eager step and the
        # graph replay of the same batch compute the same sums
        splits = num_splits_for(q.shape[0], self.page_table.shape[1], self._num_sms)
        return mla_decode(q, self.kv_cache.k_cache(layer_id), self.page_table, meta.decode_rows, meta.decode_lens,
                          self.model_config.softmax_scale, self.kv_cache.v_dim, splits)  # fmt: skip

    def init_capture_graph(self, max_seq_len: int, bs_list: List[int]) -> None:
        """DecodeGraphHooks (AttnCap.DECODE_GRAPH, latent pools on CUDA): static rows / lengths."""
        max_bs = max(bs_list)
        self._graph = {
            "rows": torch.zeros(max_bs, dtype=torch.int64, device=self.device),
            "lens": torch.ones(max_bs, dtype=torch.int64, device=self.device),
            "last": torch.arange(max_bs, dtype=torch.int64, device=self.device),
        }

    def prepare_for_capture(self, batch: Batch) -> None:
        bs, g = batch.padded_size, self._graph
        g["rows"][:bs].fill_(batch.padded_reqs[0].table_idx)  # the dummy request: one token on the dummy page
        g["lens"][:bs].fill_(1)
        batch.attn_metadata = TorchAttnMetadata(
            g["last"][:bs], reqs=batch.padded_reqs, is_decode=True, decode_rows=g["rows"][:bs], decode_lens=g["lens"][:bs], built=True
        )

    def prepare_for_replay(self, batch: Batch) -> None:
        bs, reqs = batch.padded_size, batch.padded_reqs
        self._graph["rows"][:bs].copy_(make_device_tensor([r.table_idx for r in reqs], torch.int64, self.device))
        self._graph["lens"][:bs].copy_(make_device_tensor([r.device_len for r in reqs], torch.int64, self.device))

    def attend(self, q: torch.Tensor, layer_id: int, batch: Batch, sinks: torch.Tensor | None = None) -> torch.Tensor:
        meta = self._views(batch.attn_metadata)
        cast = self._compute_dtype
        cfg = self.model_config
        # (scale None: SDPA's own default, the bits every other model had before)
        window, scale, cap = cfg.window_of(layer_id), cfg.attn_scale, cfg.attn_logit_softcapping
        if meta.is_decode:
            if self._mla:  # latent decode on CUDA: the Triton kernel reads the pool in place
                return self._latent_decode(q, layer_id, meta)
            assert meta.decode_slots is not None
            keys, values = self.kv_cache.gather(layer_id, meta.decode_slots, cast)
            keys, values = keys.transpose(1, 2), values.transpose(1, 2)  # [B, Hk, S, D]
            o = _attention(q.unsqueeze(2).to(keys.dtype), keys, values, self._decode_mask(meta, window), scale, cap, sinks)
            return o.squeeze(2).to(q.dtype)
        out = q.new_empty(*q.shape[:-1], self.kv_cache.v_dim or q.shape[-1])  # (latent: V is narrower than K)
        for s in meta.prefill or []:
            qi = q[s.q_start : s.q_start + s.q_len].transpose(0, 1)  # [Hq, L, D]
            ki, vi = self.kv_cache.gather(layer_id, s.slots, cast)
            ki, vi = ki.transpose(0, 1), vi.transpose(0, 1)  # [Hk, S, D]
            oi = _attention(qi.to(ki.dtype), ki, vi, self._prefill_mask(s, window), scale, cap, sinks)
            out[s.q_start : s.q_start + s.q_len] = oi.transpose(0, 1).to(q.dtype)
        return out


def _attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float | None,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [..., Hq, L, D] over k, v [..., Hk, S, D]; mask [..., L, S] bool (True: attend) or None
    for plain causal; scale None: D^-0.5; sinks [Hq]: one more logit per head in the softmax."""
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True)
    group = q.shape[-3] // k.shape[-3]
    k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    scores = torch.matmul(q, k.transpose(-1, -2)) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype), v)
    sink = sinks.to(scores.dtype).view(-1, 1, 1).expand(*scores.shape[:-1], 1)  # [..., Hq, L, 1]
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1, dtype=torch.float32)[..., :-1]
    return torch.matmul(probs.to(v.dtype), v)


def _cumsum(xs: List[int]) -> Tuple[int, ...]:
    total, out = 0, []
    for x in xs:
        total += x
        out.append(total)
    return tuple(out)
