"""The FlashInfer backend's per-step page metadata (minisgl/attention/flashinfer_backend.py
`_kv_indices`), on the CPU: FlashInfer itself is not installed in CI, so a stand-in module takes
its name for the import; only the backend's own host/torch code runs. The oracle is slicing each
request's row of the page table: page j of a request is its slot j*ps divided by ps."""

from __future__ import annotations

import importlib
import sys
import types

import pytest
import torch


@pytest.fixture
def backend_cls(monkeypatch):
    fake = types.ModuleType("flashinfer")
    fake.decode = types.ModuleType("flashinfer.decode")  # type: ignore[attr-defined]
    fake.prefill = types.ModuleType("flashinfer.prefill")  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    monkeypatch.setitem(sys.modules, "flashinfer.decode", fake.decode)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flashinfer.prefill", fake.prefill)  # type: ignore[attr-defined]
    monkeypatch.delitem(sys.modules, "minisgl.attention.flashinfer_backend", raising=False)
    module = importlib.import_module("minisgl.attention.flashinfer_backend")
    yield module.FlashInferAttnBackend
    sys.modules.pop("minisgl.attention.flashinfer_backend", None)  # the real import stays possible


def _backend(cls, page_size: int, rows: int = 6, max_pages: int = 40):
    """The attributes `_kv_indices` reads, over a page table of whole, shuffled pages."""
    gen = torch.Generator().manual_seed(page_size)
    table = torch.zeros(rows, max_pages * page_size + 8, dtype=torch.int32)
    for r in range(rows):
        pages = torch.randperm(4 * max_pages, generator=gen)[:max_pages].int()
        table[r, : max_pages * page_size] = (pages[:, None] * page_size + torch.arange(page_size, dtype=torch.int32)).flatten()
    b = cls.__new__(cls)
    b.page_table, b.page_size, b.device = table, page_size, torch.device("cpu")
    b._page_starts = table[:, ::page_size]
    b._ones = torch.ones(0, dtype=torch.int32)
    return b


@pytest.mark.parametrize("page_size", [1, 16])
def test_kv_indices_match_page_table_slicing(backend_cls, page_size):
    b = _backend(backend_cls, page_size)
    rows = [4, 0, 5, 2]
    lens = [1, page_size * 7, page_size * 3 + 5, page_size * 40]  # one token, whole pages, a partial page, the row's end
    indptr, indices, last = b._kv_indices(rows, lens)
    npages = [-(-n // page_size) for n in lens]
    ref = torch.cat([b.page_table[r, ::page_size][:p] // page_size for r, p in zip(rows, npages)])
    assert indices.dtype == torch.int32 and torch.equal(indices, ref)
    assert indptr.dtype == torch.int32 and indptr.tolist() == [sum(npages[:i]) for i in range(len(rows) + 1)]
    assert last.dtype == torch.int32 and last.tolist() == [n - (p - 1) * page_size for n, p in zip(lens, npages)]
    assert all(1 <= x <= page_size for x in last.tolist())


def test_prefill_plan_gets_query_offsets_and_last_rows(backend_cls):
    """A prefill step: FlashInfer's plan() gets the query rows' CSR offsets (prefix sums of the
    extend lengths) and the metadata names each request's last query row."""
    b = _backend(backend_cls, 16)
    planned = {}

    class Wrapper:
        def plan(self, qo_indptr, kv_indptr, indices, last_page_len, *args, **kwargs):
            planned.update(qo=qo_indptr, kv=kv_indptr, causal=kwargs["causal"])

    b.prefill_wrapper = Wrapper()
    b.num_qo_heads, b.num_kv_heads, b.head_dim = 4, 2, 8
    b.dtype = b.kv_dtype = torch.bfloat16
    b.sm_scale = 8**-0.5
    ext = [5, 1, 17]  # tokens fed this step
    reqs = [types.SimpleNamespace(table_idx=r, device_len=d, extend_len=e) for r, d, e in zip([3, 1, 0], [5, 40, 100], ext)]
    batch = types.SimpleNamespace(padded_reqs=reqs, is_decode=False)
    b._prepare_metadata(batch)
    offsets = [0, 5, 6, 23]  # prefix sums of ext, computed by hand
    assert planned["qo"].dtype == torch.int32 and planned["qo"].tolist() == offsets and planned["causal"] is True
    assert batch.attn_metadata.last_indices.tolist() == [o - 1 for o in offsets[1:]]
    assert batch.attn_metadata.wrapper is b.prefill_wrapper
