"""Triton attention over the paged pool (CUDA): split-K decode and causal extend over a cached
prefix, any page size, GQA. Needs only torch + triton; the default on CUDA without FlashInfer.

Per-step metadata is one small int64 tensor copied to the device once (rows, lengths, split
counts, the decode kernel's start order, last indices as its rows), so a decode step costs one
host-to-device copy. For CUDA graphs the backend keeps static copies of that tensor and of the
split-K scratch, sized for the largest captured batch; replay copies the step's metadata into them.

A prefill step may start with decode rows (a mixed batch, `Batch.num_decode_rows`): those rows
attend through the decode kernel (one chunk per request, no split-K scratch) and the prompt
chunks through the extend kernel, eager or replayed alike. Both launches take their grid from a
bound, not from the step (programs past the step's rows exit at once), so one CUDA graph per
padded token count replays any mix of decode rows and chunks (engine/mixed_graph.py).

An fp8_e4m3 pool (`kv_cache_dtype`) is read and written by the same kernels: the store saturates
and rounds as `KVCachePool._store_quantized` does (the same bytes); attention widens each loaded
K/V tile exactly (every e4m3 value is a bf16 and an fp16 value), to the model dtype in extend and
to fp16 in a bf16 model's decode (kernel/triton_attention.py says why); decode with a GQA group of
at most 2 runs a CUDA-core kernel over the pool's int32 words instead (`use_cc_decode`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Tuple

import torch

from minisgl.attention.base import AttnCap, BaseAttnBackend, BaseAttnMetadata
from minisgl.core import Batch, Req
from minisgl.distributed import get_tp_info
from minisgl.kernel.triton_attention import decode_attention, decode_tile, extend_attention, store_kv
from minisgl.models.config import ModelConfig
from minisgl.utils.device import make_device_tensor
from minisgl.utils.misc import div_ceil, div_even

# Upper bound of KV chunks per request in decode. grid_splits keeps about two programs per SM,
# so this binds only at batch 1 (33 chunks with 8 KV heads on 132 SMs) and 2 (17): at 32k tokens
# of context 16 chunks left one program per SM streaming 2k tokens each (docs/PERFORMANCE.md,
# "Long context").
MAX_SPLITS = 64
MIN_SPLIT_LEN = 64  # a chunk shorter than this costs more in the reduction than it saves
# The rows of a prefill step's packed metadata: the decode rows' (mixed batch) then the chunks'.
# A mixed batch's decode rows use the decode kernel's large-batch tile whatever their number.
MIXED_DECODE_TILE_BS = 256
DEC_ROWS, DEC_LENS, DEC_SPLITS, DEC_ORDER, EXT_ROWS, EXT_LENS, EXT_START, EXT_CACHED, EXT_LEN, LAST = range(10)


@dataclass
class TritonAttnMetadata(BaseAttnMetadata):
    rows: torch.Tensor  # [B] page-table row of each request
    seq_lens: torch.Tensor  # [B] device_len
    # decode
    num_splits: torch.Tensor | None = None  # [B] KV chunks per request (<= grid_splits)
    order: torch.Tensor | None = None  # [B] batch rows by decreasing length: the kernel's start order
    grid_splits: int = 1
    mid_o: torch.Tensor | None = None  # [B, Hq, grid_splits, D] float32
    mid_lse: torch.Tensor | None = None  # [B, Hq, grid_splits] float32
    # extend
    q_start: torch.Tensor | None = None  # [B] first row of each request in the flat batch
    cached_lens: torch.Tensor | None = None  # [B]
    extend_lens: torch.Tensor | None = None  # [B]
    max_extend_len: int = 0
    # a mixed batch's decode rows (the first num_decode token rows): decode kernel, one chunk each
    num_decode: int = 0
    dec_rows: torch.Tensor | None = None
    dec_seq_lens: torch.Tensor | None = None
    dec_num_splits: torch.Tensor | None = None  # 1 per row; 0 for a graph's padding rows (skipped)
    dec_order: torch.Tensor | None = None
    # the packed device tensor all of the above are views of (rows of one [K, B] int64 tensor)
    packed: torch.Tensor | None = None


class TritonAttnBackend(BaseAttnBackend):
    caps = AttnCap.DECODE_GRAPH | AttnCap.MIXED_GRAPH
    # fp8_e4m3: the kernels store as the pool's reference store does and widen exactly as they
    # load, so decode reads half the bytes
    kv_cache_dtypes = ("auto", "fp8_e4m3")
    attention_features = ("sliding_window", "attn_logit_softcapping", "query_pre_attn_scalar", "attention_sinks")

    def __init__(self, model_config: ModelConfig) -> None:
        super().__init__(model_config)
        tp = get_tp_info().size
        self.num_qo_heads = div_even(model_config.num_qo_heads, tp)
        self.num_kv_heads = self.kv_cache.num_kv_heads
        self.head_dim = model_config.head_dim
        # the kernels take each layer's window and the score soft-cap (Gemma) as arguments
        self.sm_scale = model_config.softmax_scale
        self.softcap = model_config.attn_logit_softcapping
        # (the CPU branch only serves Triton's interpreter, TRITON_INTERPRET=1, in kernel tests)
        cuda = self.device.type == "cuda"
        self.num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count if cuda else 8
        self._graph_buffers: Dict[str, torch.Tensor] = {}
        self._scratch: Dict[str, torch.Tensor] = {}

    # ---- split-K sizing ------------------------------------------------------------------------
    def grid_splits(self, bs: int) -> int:
        """The split bound for a batch of `bs` requests: about two programs per SM. Measured on the
        H200: one chunk per request is fastest once batch x KV heads fills the GPU twice over (batch
        64 and 256 at Qwen3-0.6B's 8 heads), while batch 1 wants the most chunks."""
        want = div_ceil(2 * self.num_sms, bs * self.num_kv_heads)
        return max(1, min(MAX_SPLITS, want))

    def _num_splits(self, seq_lens: List[int], grid_splits: int) -> List[int]:
        return [max(1, min(grid_splits, div_ceil(n, MIN_SPLIT_LEN))) for n in seq_lens]

    # ---- metadata ------------------------------------------------------------------------------
    def _packed(self, rows: List[List[int]], bs: int) -> torch.Tensor:
        """The metadata rows as one [K, bs] device tensor. Its row stride is padded to an even
        length so every row starts 16-byte aligned: Triton specialises kernels on pointer
        alignment, and a batch of odd size would otherwise compile a second variant of each
        kernel the first time an even one comes (a JIT compile in the middle of serving)."""
        pad = [0] * (bs % 2)
        return make_device_tensor([r + pad for r in rows], torch.int64, self.device)[:, :bs]

    def prepare_metadata(self, batch: Batch) -> None:
        reqs = batch.padded_reqs
        bs = len(reqs)
        rows = [r.table_idx for r in reqs]
        seq_lens = [r.device_len for r in reqs]
        if batch.is_decode:
            grid = self.grid_splits(bs)
            order = sorted(range(bs), key=seq_lens.__getitem__, reverse=True)  # longest first
            packed = self._packed([rows, seq_lens, self._num_splits(seq_lens, grid), order, list(range(bs))], bs)
            batch.attn_metadata = TritonAttnMetadata(
                last_indices=packed[4], rows=packed[0], seq_lens=packed[1], num_splits=packed[2],
                order=packed[3], grid_splits=grid, packed=packed,
            )  # fmt: skip
            return
        self._prepare_prefill(batch, reqs, rows, seq_lens)

    def _prepare_prefill(self, batch: Batch, reqs: List[Req], rows: List[int], seq_lens: List[int]) -> None:
        """Prefill metadata: row DEC_* for the decode rows of a mixed batch, EXT_* for the chunks,
        LAST for every request; each row padded to the batch size with values that make a graph's
        padding programs exit (0 splits, 0 extend tokens)."""
        nd = batch.num_decode_rows
        bs = len(reqs)
        ext = [r.extend_len for r in reqs[nd:]]
        q_start, last, total = [], list(range(nd)), nd
        for n in ext:
            q_start.append(total)
            total += n
            last.append(total - 1)
        dummy_row = self.page_table.shape[0] - 1
        pad_d, pad_e = [0] * (bs - nd), [0] * nd
        order = sorted(range(nd), key=seq_lens.__getitem__, reverse=True) + list(range(nd, bs))
        packed = self._packed([
            rows[:nd] + [dummy_row] * (bs - nd), seq_lens[:nd] + [1] * (bs - nd), [1] * nd + pad_d, order,
            rows[nd:] + [dummy_row] * nd, seq_lens[nd:] + [1] * nd, q_start + pad_e, [r.cached_len for r in reqs[nd:]] + pad_e,
            ext + pad_e, last,
        ], bs)  # fmt: skip
        ne = bs - nd
        batch.attn_metadata = self._prefill_metadata(packed, nd, ne, max(ext, default=0), packed.shape[1])

    @staticmethod
    def _prefill_metadata(packed: torch.Tensor, nd: int, ne: int, max_ext: int, nlast: int) -> TritonAttnMetadata:
        return TritonAttnMetadata(
            last_indices=packed[LAST, :nlast], rows=packed[EXT_ROWS, :ne], seq_lens=packed[EXT_LENS, :ne],
            q_start=packed[EXT_START, :ne], cached_lens=packed[EXT_CACHED, :ne], extend_lens=packed[EXT_LEN, :ne],
            max_extend_len=max_ext, num_decode=nd, dec_rows=packed[DEC_ROWS, :nd], dec_seq_lens=packed[DEC_LENS, :nd],
            dec_num_splits=packed[DEC_SPLITS, :nd], dec_order=packed[DEC_ORDER, :nd], packed=packed,
        )  # fmt: skip

    # ---- compute -------------------------------------------------------------------------------
    def store_kv(self, k: torch.Tensor, v: torch.Tensor | None, layer_id: int, batch: Batch) -> None:
        assert v is not None  # (a latent pool: this backend refuses latent_attention at init)
        trans = self.kv_cache.translation_of(layer_id)
        # a sliding layer of a hybrid pool stores at the window slots of this step's main slots
        # (a gather on the device: captured by CUDA graphs like the rest of the step)
        loc = batch.out_loc if trans is None else trans[batch.out_loc.long()]
        store_kv(self.kv_cache.k_cache(layer_id), self.kv_cache.v_cache(layer_id), k, v, loc)

    def attend(self, q: torch.Tensor, layer_id: int, batch: Batch, sinks: torch.Tensor | None = None) -> torch.Tensor:
        k_cache, v_cache = self.kv_cache.k_cache(layer_id), self.kv_cache.v_cache(layer_id)
        meta: TritonAttnMetadata = batch.attn_metadata
        window, cap = self.model_config.window_of(layer_id), self.softcap
        trans = self.kv_cache.translation_of(layer_id)  # (a hybrid pool's sliding layer: kvcache/window.py)
        q = q if q.stride(-1) == 1 else q.contiguous()
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if meta.num_splits is not None:
            if meta.mid_o is None:  # eager: scratch shared by every layer of this step
                B, Hq, D = q.shape
                meta.mid_o = torch.empty((B, Hq, meta.grid_splits, D), dtype=torch.float32, device=q.device)
                meta.mid_lse = torch.empty((B, Hq, meta.grid_splits), dtype=torch.float32, device=q.device)
            assert meta.mid_lse is not None
            decode_attention(
                q, k_cache, v_cache, self.page_table, meta.rows, meta.seq_lens, meta.num_splits,
                meta.mid_o, meta.mid_lse, out, self.sm_scale, order=meta.order, window=window, softcap=cap, sinks=sinks,
                translation=trans,
            )  # fmt: skip
            return out
        if meta.num_decode > 0:
            # A mixed batch's decode rows: one chunk per row (DIRECT: `out` is written in place),
            # a fixed tile, so eager and graph steps run the same kernel.
            nd = meta.num_decode
            assert meta.dec_num_splits is not None and meta.dec_rows is not None and meta.dec_seq_lens is not None
            mid_o, mid_lse = self._no_split_scratch(q.device)
            decode_attention(
                q[:nd], k_cache, v_cache, self.page_table, meta.dec_rows, meta.dec_seq_lens, meta.dec_num_splits,
                mid_o, mid_lse, out[:nd], self.sm_scale,
                block_n=decode_tile(MIXED_DECODE_TILE_BS, q.dtype), order=meta.dec_order, window=window, softcap=cap,
                sinks=sinks, translation=trans,
            )  # fmt: skip
        if meta.max_extend_len > 0:
            assert meta.q_start is not None and meta.cached_lens is not None and meta.extend_lens is not None
            extend_attention(
                q, k_cache, v_cache, self.page_table, meta.rows, meta.q_start, meta.cached_lens,
                meta.extend_lens, meta.max_extend_len, out, self.sm_scale, window=window, softcap=cap, sinks=sinks,
                translation=trans,
            )  # fmt: skip
        return out

    def _no_split_scratch(self, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
        """(mid_o, mid_lse) placeholders: a split bound of 1 makes decode_attention write `out`
        directly, so the scratch is never read."""
        if "no_split_o" not in self._scratch:
            self._scratch["no_split_o"] = torch.empty((1, 1, 1, 1), dtype=torch.float32, device=device)
            self._scratch["no_split_lse"] = torch.empty((1, 1, 1), dtype=torch.float32, device=device)
        return self._scratch["no_split_o"], self._scratch["no_split_lse"]

    # ---- CUDA graphs (decode) ------------------------------------------------------------------
    def init_capture_graph(self, max_seq_len: int, bs_list: List[int]) -> None:
        max_bs = max(bs_list)
        max_grid = max(self.grid_splits(bs) for bs in bs_list)
        Hq, D = self.num_qo_heads, self.head_dim
        packed = torch.zeros((5, max_bs), dtype=torch.int64, device=self.device)
        packed[3] = torch.arange(max_bs, device=self.device)  # order (replay overwrites it)
        packed[4] = torch.arange(max_bs, device=self.device)  # last_indices: static
        self._graph_buffers.update(
            {  # (the mixed-step buffers, if captured, stay)
                "packed": packed,
                "mid_o": torch.empty((max_bs, Hq, max_grid, D), dtype=torch.float32, device=self.device),
                "mid_lse": torch.empty((max_bs, Hq, max_grid), dtype=torch.float32, device=self.device),
            }
        )

    def prepare_for_capture(self, batch: Batch) -> None:
        bs = batch.padded_size
        grid = self.grid_splits(bs)
        buf = self._graph_buffers
        packed = buf["packed"][:, :bs]
        packed[0].fill_(batch.padded_reqs[0].table_idx)  # the dummy request: one token on the dummy page
        packed[1].fill_(1)
        packed[2].fill_(1)
        packed[3].copy_(packed[4])
        batch.attn_metadata = TritonAttnMetadata(
            last_indices=packed[4], rows=packed[0], seq_lens=packed[1], num_splits=packed[2], order=packed[3],
            grid_splits=grid, mid_o=buf["mid_o"][:bs, :, :grid], mid_lse=buf["mid_lse"][:bs, :, :grid],
            packed=packed,
        )  # fmt: skip

    def prepare_for_replay(self, batch: Batch) -> None:
        meta: TritonAttnMetadata = batch.attn_metadata
        bs = batch.padded_size
        assert meta.packed is not None and meta.num_splits is not None, "prepare_metadata(batch) first"
        assert meta.grid_splits == self.grid_splits(bs), "metadata was prepared for another batch size"
        self._graph_buffers["packed"][:4, :bs].copy_(meta.packed[:4])

    # ---- CUDA graphs (steps that carry prompt tokens) -------------------------------------------
    def init_mixed_graph(self, max_requests: int) -> None:
        """Static prefill metadata for graphs of up to `max_requests` requests (decode rows plus
        chunks). The template holds what a graph's padding columns must read: the dummy row, no
        splits, no extend tokens, identity start order, last index 0."""
        cols = max_requests + max_requests % 2  # even: every row 16-byte aligned, as in _packed
        t = torch.zeros((LAST + 1, cols), dtype=torch.int64, device=self.device)
        dummy_row = self.page_table.shape[0] - 1
        t[DEC_ROWS] = t[EXT_ROWS] = dummy_row
        t[DEC_LENS] = t[EXT_LENS] = 1
        t[DEC_ORDER] = torch.arange(cols, device=self.device)
        self._graph_buffers["mixed_template"] = t
        self._graph_buffers["mixed"] = t.clone()

    def prepare_for_mixed_capture(self, batch: Batch, num_decode: int, num_extend: int, num_tokens: int) -> None:
        """Metadata views over the static buffer: the decode launch covers `num_decode` rows, the
        extend launch `num_extend` requests of up to `num_tokens` tokens."""
        packed = self._graph_buffers["mixed"]
        assert num_decode + num_extend <= packed.shape[1]
        batch.attn_metadata = self._prefill_metadata(packed, num_decode, num_extend, num_tokens, num_decode + num_extend)

    def prepare_for_mixed_replay(self, batch: Batch) -> None:
        meta: TritonAttnMetadata = batch.attn_metadata
        assert meta.packed is not None and meta.q_start is not None, "prepare_metadata(batch) first"
        static, width = self._graph_buffers["mixed"], meta.packed.shape[1]
        static[:, width:].copy_(self._graph_buffers["mixed_template"][:, width:])  # a larger step's columns
        static[:, :width].copy_(meta.packed)
