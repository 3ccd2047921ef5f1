"""Page indices of a batch for FlashInfer, in one Triton launch (CUDA only; imported by the
FlashInfer backend).

FlashInfer reads a request's K/V through a flat list of page ids (CSR, `indptr` on the host).
The engine's page table holds one pool slot per token and the scheduler maps whole pages, so a
request's page j is `page_table[row, j * page_size] // page_size`. Built with torch ops this is
two repeat_interleaves, an arange, a subtraction, a gather and a division per step: host time
that, at FlashInfer's per-step planning cost, no longer hides behind small decode steps
(docs/PERFORMANCE.md, "FlashInfer, round three"). Here it is one copy of the per-request
metadata and one launch.
"""

from __future__ import annotations

from typing import List

import torch
import triton
import triton.language as tl

from minisgl.utils.device import make_device_tensor

BLOCK = 128  # page ids per program


# `bs` changes every step: unspecialised, so batch sizes of 1 or multiples of 16 do not compile
# another variant in the middle of serving
@triton.jit(do_not_specialize=["bs"])
def _page_indices_kernel(page_table, row_stride, meta, out, bs, PAGE_SIZE: tl.constexpr, BLOCK: tl.constexpr):
    # grid (requests, page blocks); meta rows: table row, pages, first index in `out`
    r = tl.program_id(0)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    row = tl.load(meta + r)
    npages = tl.load(meta + bs + r)
    start = tl.load(meta + 2 * bs + r)
    mask = j < npages
    slot = tl.load(page_table + row * row_stride + j * PAGE_SIZE, mask=mask, other=0)
    tl.store(out + start + j, (slot // PAGE_SIZE).to(tl.int32), mask=mask)


def page_indices(page_table: torch.Tensor, rows: List[int], npages: List[int], starts: List[int], page_size: int) -> torch.Tensor:
    """The int32 page ids of requests at page-table `rows` holding `npages` pages each, request i's
    at `starts[i]` (the CSR offsets: starts[i] = sum(npages[:i])), on the page table's device."""
    bs = len(rows)
    total = starts[-1] + npages[-1] if bs else 0
    out = torch.empty(total, dtype=torch.int32, device=page_table.device)
    if total == 0:
        return out
    meta = make_device_tensor([rows, npages, starts], torch.int64, page_table.device)  # [3, bs], contiguous
    grid = (bs, triton.cdiv(max(npages), BLOCK))
    _page_indices_kernel[grid](page_table, page_table.stride(0), meta, out, bs, PAGE_SIZE=page_size, BLOCK=BLOCK)
    return out
