"""What the decode graphs (graph.py) and the mixed-step graphs (mixed_graph.py) share.

`GraphInputs`: a graph replays on fixed addresses, so each step's token ids, positions and KV
slots are copied into these buffers. Rows past the step's own are the dummy request's (token 0 at
position 0, KV written to the dummy page), as they are at capture, so padding never touches a real
request's pages. `capture_forward`: one graph of the model's forward over a bound batch.
"""

from __future__ import annotations

from typing import Any, Tuple

import torch
from torch import nn

from minisgl.core import Batch, Req, get_global_ctx


class GraphInputs:
    def __init__(self, rows: int, dummy_req: Req, device: torch.device) -> None:
        page_table = get_global_ctx().page_table
        assert page_table is not None
        self.dummy_slot = int(page_table[dummy_req.table_idx, 0].item())
        self.input_ids = torch.zeros(rows, dtype=torch.int32, device=device)
        self.positions = torch.zeros(rows, dtype=torch.int32, device=device)
        self.out_loc = torch.full((rows,), self.dummy_slot, dtype=torch.int32, device=device)

    def bind(self, batch: Batch, rows: int) -> Batch:
        """Point `batch`'s fields at the first `rows` rows (for capture)."""
        batch.input_ids, batch.positions, batch.out_loc = self.input_ids[:rows], self.positions[:rows], self.out_loc[:rows]
        return batch

    def load(self, batch: Batch, rows: int) -> None:
        """Copy `batch`'s fields in; rows from its length up to `rows` become the dummy's."""
        n = batch.input_ids.shape[0]
        self.input_ids[:n].copy_(batch.input_ids, non_blocking=True)
        self.positions[:n].copy_(batch.positions, non_blocking=True)
        self.out_loc[:n].copy_(batch.out_loc, non_blocking=True)
        if n < rows:  # a larger earlier step may have left its tokens there
            self.input_ids[n:rows].zero_()
            self.positions[n:rows].zero_()
            self.out_loc[n:rows].fill_(self.dummy_slot)


def capture_forward(model: nn.Module, batch: Batch, stream: Any, pool: Any) -> Tuple[Any, torch.Tensor, Any]:
    """(graph, its output, the memory pool) for `batch`, whose fields are bound buffers and whose
    attention metadata the caller prepared; `pool` None starts a new one. The first forward runs
    outside the capture, so lazy inits and autotuning do not land in the graph."""
    with get_global_ctx().forward_batch(batch):
        model.forward()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            out = model.forward()
    return graph, out, graph.pool() if pool is None else pool
