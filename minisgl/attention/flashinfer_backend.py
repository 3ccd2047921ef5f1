"""FlashInfer attention over the paged pool (CUDA, optional: used when `flashinfer` imports).

FlashInfer sees the engine's real pages: the pool's [num_slots, Hk, D] K and V, viewed as
[num_pages, page_size, Hk, D], are its NHD paged layout, and a request's page indices are
`page_table[row, ::page_size] // page_size` (the scheduler maps whole pages, so entry j*ps of a
row is the first slot of the row's page j), with `last_page_len = len - (npages - 1) * ps`. Its
kernels load K/V page by page and its planner splits work in pages, so larger pages mean fewer
indirect loads and fewer, larger work units (docs/PERFORMANCE.md, "FlashInfer over real pages").
Page size 1 is the per-token special case (page index = slot). Each step is planned once, host
side, in `prepare_metadata` (one prefill wrapper, one decode wrapper, reused by every layer).
FlashInfer's plan() gets a `max` that reduces a tensor in one op instead of iterating it
(attention/flashinfer_patches.py: less host time per offline run, docs/PERFORMANCE.md). The host is not what limits this
backend offline (it waits on the device most of a run); the 4-7% it trails triton by is
FlashInfer's decode kernel and graph-mode merge (docs/PERFORMANCE.md, "FlashInfer, round four";
a one-launch Triton build of the page ids was measured there and dropped).

CUDA graphs: one decode wrapper per captured batch size, built with `use_cuda_graph=True` over
fixed index buffers (sized in pages). Decode batches of a captured size are planned on that
wrapper, in eager runs too, so a replayed step computes exactly what the eager step computes;
planning rewrites the fixed buffers and the wrapper's plan in place, which is what the captured
kernels read.

Decode runs FlashInfer's tensor-core kernel (`use_tensor_cores=True`, its prefill kernel with one
query row per request) for every GQA group: its CUDA-core kernel was 16% slower per call than
triton's at Qwen3's group of 2 on the H200, and the tensor-core one is 4% faster offline
(docs/PERFORMANCE.md). `disable_split_kv` is not passed: with
`use_cuda_graph` FlashInfer 0.7 pads the grid past the planned work units and masks the padding
only in split plans, so unsplit graph plans run CTAs on stale indices (a CUDA error in
tests/test_flashinfer_cuda.py's first version). An fp8_e4m3 pool is passed as FlashInfer's
`kv_data_type` with unit scales (q stays in the model dtype).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Dict, List, Tuple

import flashinfer  # ImportError here: the backend is unavailable (resolve_attention_backend picks another)
import flashinfer.decode
import flashinfer.prefill
import torch

from minisgl.attention.base import AttnCap, BaseAttnBackend, BaseAttnMetadata
from minisgl.attention.flashinfer_patches import patch_tensor_max
from minisgl.core import Batch
from minisgl.distributed import get_tp_info
from minisgl.models.config import ModelConfig
from minisgl.utils.device import make_device_tensor
from minisgl.utils.misc import div_even

WORKSPACE_BYTES = 128 << 20


@dataclass
class FlashInferAttnMetadata(BaseAttnMetadata):
    wrapper: Any  # the planned prefill or decode wrapper


class FlashInferAttnBackend(BaseAttnBackend):
    caps = AttnCap.DECODE_GRAPH
    kv_cache_dtypes = ("auto", "fp8_e4m3")
    # Not sliding windows: a step would need one plan per window (window_left), each on its own
    # workspace, and soft-capping serves only models that also have windows (Gemma 2).
    attention_features = ("query_pre_attn_scalar",)

    def __init__(self, model_config: ModelConfig) -> None:
        super().__init__(model_config)
        if self.kv_cache.model_dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(
                f"the flashinfer attention backend needs a float16/bfloat16 model, got {self.kv_cache.model_dtype}; "
                "use --dtype bfloat16 or --attention-backend triton"
            )
        self.num_qo_heads = div_even(model_config.num_qo_heads, get_tp_info().size)
        self.num_kv_heads = self.kv_cache.num_kv_heads
        self.head_dim = model_config.head_dim
        self.dtype = self.kv_cache.model_dtype  # q and the output
        self.kv_dtype = self.kv_cache.dtype  # the pool's: the model dtype or float8_e4m3fn
        self.sm_scale = model_config.softmax_scale
        self.use_tensor_cores = True  # for every GQA group (see the module docstring)
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self.prefill_wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self.decode_wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD", use_tensor_cores=self.use_tensor_cores)
        self.graph_wrappers: Dict[int, Any] = {}
        self._ones: torch.Tensor = torch.ones(0, dtype=torch.int32)
        ps, kv = self.page_size, self.kv_cache
        # entry j of this view is the first slot of a row's page j (pages are whole, see above)
        self._page_starts = self.page_table[:, ::ps]
        # per layer, K and V as FlashInfer's NHD pages [num_pages, ps, Hk, D]: views, made once
        # rather than per layer per step (host time)
        self._paged_kv: List[Tuple[torch.Tensor, torch.Tensor]] = [
            (kv.k_cache(i).view(-1, ps, *kv.k_cache(i).shape[1:]), kv.v_cache(i).view(-1, ps, *kv.v_cache(i).shape[1:]))
            for i in range(kv.num_layers)
        ]
        self._plan_done: Any = None
        patch_tensor_max(flashinfer.decode, flashinfer.prefill)
        try:  # one launch for K and V instead of three
            from minisgl.kernel.triton_attention import store_kv

            self._store_kv = store_kv
        except ImportError:
            from minisgl.kernel import store_kv as torch_store_kv

            self._store_kv = torch_store_kv

    # ---- metadata ------------------------------------------------------------------------------
    def _kv_indices(self, rows: List[int], lens: List[int]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(page indptr on the host, page indices on the device, last_page_len on the host) for
        the requests' first `lens` tokens."""
        ps = self.page_size
        npages = [-(-n // ps) for n in lens]
        starts = list(itertools.accumulate(npages, initial=0))
        indptr = torch.tensor(starts, dtype=torch.int32)
        indices = self._page_indices(rows, npages, starts)
        if ps == 1:
            return indptr, indices, self._ones_of(len(lens))
        last = torch.tensor([n - (p - 1) * ps for n, p in zip(lens, npages)], dtype=torch.int32)
        return indptr, indices, last

    def _page_indices(self, rows: List[int], npages: List[int], starts: List[int]) -> torch.Tensor:
        """Each row's first `npages` page ids, concatenated (one pinned copy of the per-row numbers)."""
        total, dev = starts[-1], self.device
        packed = make_device_tensor([rows, npages, starts[:-1]], torch.int64, dev)
        row_of = torch.repeat_interleave(packed[0], packed[1], output_size=total)
        pos = torch.arange(total, device=dev) - torch.repeat_interleave(packed[2], packed[1], output_size=total)
        first_slots = self._page_starts[row_of, pos]  # int32, as the page table
        return first_slots if self.page_size == 1 else first_slots // self.page_size  # page 1: a page is a slot

    def _ones_of(self, bs: int) -> torch.Tensor:
        if self._ones.numel() < bs:
            self._ones = torch.ones(max(bs, 2 * self._ones.numel()), dtype=torch.int32)
        return self._ones[:bs]

    def _plan_decode(self, wrapper: Any, rows: List[int], lens: List[int]) -> None:
        indptr, indices, last = self._kv_indices(rows, lens)
        wrapper.plan(
            indptr, indices, last, self.num_qo_heads, self.num_kv_heads, self.head_dim, self.page_size,
            q_data_type=self.dtype, kv_data_type=self.kv_dtype, sm_scale=self.sm_scale,
        )  # fmt: skip

    def prepare_metadata(self, batch: Batch) -> None:
        # plan() stages its int workspace in one pinned host buffer and copies it without
        # blocking; with overlap scheduling, step N+1 is planned while step N may still be
        # queued, so wait for the previous plan's copy before the buffer is overwritten.
        if self._plan_done is not None:
            self._plan_done.synchronize()
        self._prepare_metadata(batch)
        self._plan_done = torch.cuda.Event()
        self._plan_done.record()

    def _prepare_metadata(self, batch: Batch) -> None:
        reqs = batch.padded_reqs
        bs = len(reqs)
        rows = [r.table_idx for r in reqs]
        lens = [r.device_len for r in reqs]
        if batch.is_decode:
            wrapper = self.graph_wrappers.get(bs, self.decode_wrapper)
            self._plan_decode(wrapper, rows, lens)
            last = torch.arange(bs, device=self.device)
            batch.attn_metadata = FlashInferAttnMetadata(last_indices=last, wrapper=wrapper)
            return
        ends = list(itertools.accumulate(r.extend_len for r in reqs))  # each request's query rows end here
        qo_indptr = torch.tensor([0, *ends], dtype=torch.int32)
        kv_indptr, indices, last_page_len = self._kv_indices(rows, lens)
        self.prefill_wrapper.plan(
            qo_indptr, kv_indptr, indices, last_page_len, self.num_qo_heads, self.num_kv_heads,
            self.head_dim, self.page_size, causal=True, q_data_type=self.dtype, kv_data_type=self.kv_dtype, sm_scale=self.sm_scale,
        )  # fmt: skip
        last = make_device_tensor([e - 1 for e in ends], torch.int64, self.device)
        batch.attn_metadata = FlashInferAttnMetadata(last_indices=last, wrapper=self.prefill_wrapper)

    # ---- compute -------------------------------------------------------------------------------
    def store_kv(self, k: torch.Tensor, v: torch.Tensor | None, layer_id: int, batch: Batch) -> None:
        assert v is not None  # (a latent pool: this backend refuses latent_attention at init)
        self._store_kv(self.kv_cache.k_cache(layer_id), self.kv_cache.v_cache(layer_id), k, v, batch.out_loc)

    def attend(self, q: torch.Tensor, layer_id: int, batch: Batch, sinks: torch.Tensor | None = None) -> torch.Tensor:
        meta: FlashInferAttnMetadata = batch.attn_metadata
        q = q.contiguous().to(self.dtype)
        return meta.wrapper.run(q, self._paged_kv[layer_id])

    # ---- CUDA graphs (decode) ------------------------------------------------------------------
    def init_capture_graph(self, max_seq_len: int, bs_list: List[int]) -> None:
        max_bs = max(bs_list)
        dev = self.device
        # one page-indices buffer shared by every graph wrapper: one step runs at a time
        max_pages = -(-max_seq_len // self.page_size)
        self._graph_indices = torch.zeros(max_bs * max_pages, dtype=torch.int32, device=dev)
        for bs in bs_list:
            self.graph_wrappers[bs] = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=self.use_tensor_cores,
                paged_kv_indptr_buffer=torch.zeros(bs + 1, dtype=torch.int32, device=dev),
                paged_kv_indices_buffer=self._graph_indices,
                paged_kv_last_page_len_buffer=torch.ones(bs, dtype=torch.int32, device=dev),
            )  # fmt: skip

    def prepare_for_capture(self, batch: Batch) -> None:
        bs = batch.padded_size
        wrapper = self.graph_wrappers[bs]
        self._plan_decode(wrapper, [r.table_idx for r in batch.padded_reqs], [1] * bs)  # the dummy: one token
        last = torch.arange(bs, device=self.device)
        batch.attn_metadata = FlashInferAttnMetadata(last_indices=last, wrapper=wrapper)

    def prepare_for_replay(self, batch: Batch) -> None:
        meta: FlashInferAttnMetadata = batch.attn_metadata
        bs = batch.padded_size
        if meta.wrapper is not self.graph_wrappers[bs]:  # planned before the graphs existed: plan again
            self._plan_decode(self.graph_wrappers[bs], [r.table_idx for r in batch.padded_reqs],
                              [r.device_len for r in batch.padded_reqs])  # fmt: skip
