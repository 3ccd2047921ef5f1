"""The CPU attention backend ("cpu", what "auto" picks on a CPU): the paged C kernels behind the
attention backend's interface.

A layer hands it the qkv rows of its projection (`forward_qkv`): one C call
applies the optional q/k RMSNorm and the rotary in place and stores K/V into the pool
(`rope_store`, kernels.c; the int8 pool's codes and scales: kv_int8.c), then

- decode rows and small prefill chunks attend through the paged kernel, which reads each
  request's keys in place by slot (one query row per token, causal over the cached prefix);
- a larger prefill request attends through AMX tiles (attn_amx.c) where it has no cached
  prefix and the CPU has them (AVX2 + FMA without AVX512-BF16: attn_avx2.c), else torch's SDPA on 4-D bf16 inputs with enable_gqa (oneDNN's
  flash kernel; 3-D inputs or repeated KV heads take the much slower math path).

Where the kernels do not apply (no C compiler, an fp16 model, partial rotary, a head size or
GQA group the kernels were not built for, a sliding window, soft-capping or another score scale
or Gemma's (1 + w) q/k norms) it is the torch backend it derives from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Tuple

import torch
import torch.nn.functional as F

from minisgl.attention.torch_backend import TorchAttnBackend, TorchAttnMetadata
from minisgl.core import Batch
from minisgl.kernel.cpu import SUFFIX, cpu_kernels
from minisgl.models.config import ModelConfig

# A request feeding at most this many tokens (a decode row of a mixed batch, a small prefill
# chunk) attends through the paged kernel, which reads its cached keys in place; SDPA would
# gather and cast its whole prefix in every layer first.
PAGED_MAX_EXTEND = 32


@dataclass
class _Segment:
    """Consecutive fed tokens attended by one call: the paged kernel (`plan` empty) or, for one
    large request, SDPA / AMX tiles (`plan`: start, length, cached_len, device_len, table row)."""

    start: int
    count: int
    plan: Tuple[int, int, int, int, int] | None = None


@dataclass
class CpuAttnMetadata(TorchAttnMetadata):
    # per fed token: its page-table row and how many keys it sees (causal, cached prefix included)
    table_row: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    kv_len: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    segments: List[_Segment] = field(default_factory=list)  # prefill only
    # the step's positions (int32) and K/V slots (int64) as the kernels read them, made once
    step_args: Tuple[torch.Tensor, torch.Tensor] | None = None


def _segments(reqs: List[Any], paged_max_extend: int = PAGED_MAX_EXTEND) -> List[_Segment]:
    out: List[_Segment] = []
    start = 0
    for r in reqs:
        n = r.extend_len
        if n <= paged_max_extend:
            if out and out[-1].plan is None and out[-1].start + out[-1].count == start:
                out[-1].count += n
            else:
                out.append(_Segment(start, n))
        else:
            out.append(_Segment(start, n, (start, n, r.cached_len, r.device_len, r.table_idx)))
        start += n
    return out


class CpuAttnBackend(TorchAttnBackend):
    kv_cache_dtypes: Tuple[str, ...] = ("auto", "int8")
    paged_max_extend = PAGED_MAX_EXTEND  # requests feeding more tokens attend through AMX tiles / SDPA

    def __init__(self, model_config: ModelConfig) -> None:
        super().__init__(model_config)
        dtype = self.kv_cache.model_dtype
        k = cpu_kernels() if dtype in SUFFIX else None
        self.kernels = k
        self.nthreads = torch.get_num_threads()
        self._tables: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}
        if k is None:
            return
        q8 = self.kv_cache.scales is not None
        self._rope = k.get("rope_store_q8" if q8 else "rope_store", dtype)
        self._attend = k.get("paged_attention_q8" if q8 else "paged_attention", dtype)
        # a large prompt's attention: AMX tiles, else AVX2 FMAs (attn_avx2.c), else SDPA
        self._prefill_kernel = None
        if dtype == torch.bfloat16:
            self._prefill_kernel = k.lib.prefill_attention_amx_bf16 if k.has_amx else None
            self._prefill_kernel = k.lib.prefill_attention_avx2_bf16 if k.has_avx2_gemm else self._prefill_kernel

    def takes(self, layer: Any) -> bool:
        """Whether the kernels run this attention layer (full rotate-half rotary, the default
        scale: `AttentionLayer.plain`; a head size and GQA group they were built for; plain causal
        attention at the default scale in the config, plain q/k RMSNorm). They mask no sliding
        window and soft-cap nothing: such layers (Gemma) attend through the torch backend this
        one derives from."""
        k = self.kernels
        d, hq, hk = layer.head_dim, layer.num_q_heads, layer.num_kv_heads
        norms = layer._qk_norm or ()
        return (
            k is not None and layer.plain and d % 2 == 0 and d <= k.max_head_dim
            and hq % hk == 0 and hq // hk <= k.max_group and hk == self.kv_cache.num_kv_heads
            and self.model_config.plain_attention(layer.layer_id) and not any(n.unit_offset for n in norms)
        )  # fmt: skip

    def rope_tables(self, rotary: Any) -> Tuple[torch.Tensor, torch.Tensor]:
        """The rotary's cos/sin in the model dtype (the kernels' inputs), cast once per table."""
        key = id(rotary)
        if key not in self._tables:
            dtype = self.kv_cache.model_dtype
            self._tables[key] = (rotary.cos.to(dtype).contiguous(), rotary.sin.to(dtype).contiguous())
        return self._tables[key]

    def pool_args(self, layer_id: int) -> Tuple[int, ...]:
        """The pool pointers the rope/store and attention kernels take for one layer."""
        kv = self.kv_cache
        ptrs = (kv.k_cache(layer_id).data_ptr(), kv.v_cache(layer_id).data_ptr())
        if kv.scales is None:
            return ptrs
        return ptrs + (kv.k_scale(layer_id).data_ptr(), kv.v_scale(layer_id).data_ptr())

    def prepare_metadata(self, batch: Batch) -> None:
        reqs = batch.padded_reqs
        if batch.is_decode:
            rows = [r.table_idx for r in reqs]
            lens = [r.device_len for r in reqs]
            last = list(range(len(reqs)))
            segments: List[_Segment] = []
        else:
            rows, lens, last = [], [], []
            for r in reqs:
                rows += [r.table_idx] * r.extend_len
                lens += range(r.cached_len + 1, r.device_len + 1)
                last.append(len(lens) - 1)
            segments = _segments(reqs, self.paged_max_extend)
        i64 = torch.int64
        batch.attn_metadata = CpuAttnMetadata(
            torch.tensor(last, dtype=i64), reqs=reqs, is_decode=batch.is_decode,
            table_row=torch.tensor(rows, dtype=i64), kv_len=torch.tensor(lens, dtype=i64), segments=segments,
        )  # fmt: skip

    def step_args(self, batch: Batch) -> Tuple[torch.Tensor, torch.Tensor]:
        meta = batch.attn_metadata
        assert isinstance(meta, CpuAttnMetadata)
        if meta.step_args is None:
            pos = batch.positions if batch.positions.dtype == torch.int32 else batch.positions.int()
            meta.step_args = (pos.contiguous(), batch.out_loc.long().contiguous())
        return meta.step_args

    def forward_qkv(self, qkv: torch.Tensor, layer: Any, batch: Batch) -> torch.Tensor | None:
        """[T, Hq * D] attention output of a layer's qkv rows [T, (Hq + 2 Hk) * D], which this
        normalises and rotates in place (q and k) while storing K/V; None where the kernels do
        not take this layer or these rows (the caller then runs the torch ops)."""
        if not self.takes(layer) or qkv.dtype != self.kv_cache.model_dtype or not qkv.is_contiguous() or qkv.dim() != 2:
            return None
        meta = batch.attn_metadata
        if not isinstance(meta, CpuAttnMetadata):
            return None
        hq, hk, d = layer.num_q_heads, layer.num_kv_heads, layer.head_dim
        t, width = qkv.shape
        cos, sin = self.rope_tables(layer.rotary)
        positions, out_loc = self.step_args(batch)
        norm = layer._qk_norm
        qn = norm[0].weight.data_ptr() if norm else None
        kn = norm[1].weight.data_ptr() if norm else None
        eps = norm[0].eps if norm else 0.0
        pool = self.pool_args(layer.layer_id)
        self._rope(qkv.data_ptr(), positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), qn, kn, eps, *pool,
                   out_loc.data_ptr(), t, hq, hk, d)  # fmt: skip
        out = qkv.new_empty(t, hq * d)
        scale = d**-0.5
        pt = self.page_table
        esz = qkv.element_size()
        if meta.is_decode:
            segments = [_Segment(0, t)]
        else:
            segments = meta.segments
        for seg in segments:
            if seg.plan is None:  # decode rows and small chunks: the paged kernel, keys read in place
                s = seg.start
                self._attend(qkv.data_ptr() + s * width * esz, width, *pool, pt.data_ptr(), pt.stride(0),
                             meta.table_row.data_ptr() + 8 * s, meta.kv_len.data_ptr() + 8 * s,
                             out.data_ptr() + s * hq * d * esz, seg.count, hq, hk, d, scale, self.nthreads)  # fmt: skip
            else:
                self._prefill(qkv, out, layer, seg.plan, scale)
        return out

    def _prefill(self, qkv: torch.Tensor, out: torch.Tensor, layer: Any, plan: Tuple[int, int, int, int, int],
                 scale: float) -> None:  # fmt: skip
        """One large request of a prefill: AMX tiles / AVX2 FMAs or SDPA (keys from its own rows
        when nothing is cached, else all of them from the pool, which holds this step's already)."""
        hq, hk, d = layer.num_q_heads, layer.num_kv_heads, layer.head_dim
        qs, ks = hq * d, hk * d
        start, n, cached, total, row = plan
        rows = qkv[start : start + n]
        if cached == 0 and self._prefill_kernel is not None:
            o_rows = out[start : start + n]
            if self._prefill_kernel(rows.data_ptr(), qkv.stride(0), n, hq, hk, d, scale, o_rows.data_ptr(), out.stride(0),
                         self.nthreads):  # fmt: skip
                return
        q = rows[:, :qs].view(n, hq, d).transpose(0, 1).unsqueeze(0)
        if cached == 0:
            k = rows[:, qs : qs + ks].view(n, hk, d)
            v = rows[:, qs + ks :].view(n, hk, d)
            mask = None
        else:
            slots = self.page_table[row, :total].long()
            k, v = self.kv_cache.gather(layer.layer_id, slots, rows.dtype)
            pos = torch.arange(cached, total)
            mask = torch.arange(total)[None, :] <= pos[:, None]
        k, v = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True)
        out[start : start + n] = o[0].transpose(0, 1).reshape(n, qs)


class CpuDeterministicAttnBackend(CpuAttnBackend):
    """`--deterministic` on the CPU ("cpu_deterministic"): the paged kernel for every row, decode
    and prefill alike. Its reduction order is fixed per query row: keys 0 .. kv_len - 1 in blocks
    of 16 from position 0, one online softmax, no split over keys, the threads split over
    (row, KV head) tasks only. So a row's output depends on its query and keys alone, not on the
    rows beside it, the chunking or the cache; and a prompt token re-scored in a prefill attends
    exactly as it did when it was decoded. (The AMX tiles and SDPA of large prefill requests tile
    the keys by the prompt's length: not used here.) A layer the kernels do not take (a sliding
    window, soft-capping, another scale) attends through the torch walk of the deterministic
    backend (attention/deterministic_backend.py), itself batch-invariant."""

    kv_cache_dtypes: Tuple[str, ...] = ("auto",)
    attention_features = ("sliding_window", "attn_logit_softcapping", "query_pre_attn_scalar")
    paged_max_extend = 1 << 62

    def attend(self, q: torch.Tensor, layer_id: int, batch: Batch, sinks: torch.Tensor | None = None) -> torch.Tensor:
        from minisgl.attention.deterministic_backend import attend_walk, chunk_blocks

        meta = batch.attn_metadata
        assert isinstance(meta, CpuAttnMetadata)
        positions = meta.kv_len - 1
        k_cache, v_cache = self.kv_cache.k_cache(layer_id), self.kv_cache.v_cache(layer_id)
        window = self.model_config.window_of(layer_id)
        blocks = chunk_blocks(positions.tolist())
        return attend_walk(q, meta.table_row, positions, blocks, k_cache, v_cache, self.page_table, self.model_config, window,
                           self.kv_cache.translation_of(layer_id))  # fmt: skip
