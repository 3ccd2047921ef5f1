"""The Gumbel-max sampling kernel (minisgl/kernel/triton_sampling.py) on CUDA at Qwen3's vocabulary
(V = 151,936, bf16 logits):

- draws follow softmax(logits / T): one launch of many copies of a row, each with its own seed; the
  frequencies of the top tokens (and of the rest, pooled) against float64 softmax, within a correct
  sampler's spread (mean + 6 sd of the total variation distance);
- greedy rows (T = MIN_T, mixed with sampled rows, planted ties, -inf rows) equal torch.argmax;
- a row's draw depends only on its logits, temperature and seed (not on the batch, the launch
  split or the row stride); a row with one finite entry always draws it;
- Sampler.sample on CUDA: seeded rows keep their draw when a neighbour filters; the draw replays
  inside a CUDA graph, and the captured draw takes fresh seeds on every replay.

Skipped unless MINISGL_TEST_DEVICE=cuda; tests/test_triton_sampling_interpret.py runs the kernel
through Triton's interpreter on the CPU."""

from __future__ import annotations

import math
from typing import Tuple

import pytest
import torch
from helpers import TEST_DEVICE

pytestmark = pytest.mark.skipif(TEST_DEVICE != "cuda", reason="the sampling kernel on the GPU (MINISGL_TEST_DEVICE=cuda)")

DEV = torch.device("cuda")
VOCAB = 151936


def seeds(n: int) -> torch.Tensor:
    return torch.randint(0, 2**62, (n,), dtype=torch.int64, device=DEV)


def tv_bound(p: torch.Tensor, n: int) -> Tuple[float, float]:
    """Mean and mean + 6 sd of the total variation distance of n correct draws from p (buckets)."""
    pq = p * (1 - p)
    mean = 0.5 * torch.sqrt(2 * pq / (math.pi * n)).sum().item()
    sd = 0.5 * math.sqrt((1 - 2 / math.pi) * pq.sum().item() / n)
    return mean, mean + 6 * sd


@pytest.mark.parametrize("t", [0.6, 1.0, 1.5])
def test_draws_follow_the_softmax(t: float) -> None:
    """A realistic shape: a few strong tokens, then a long tail holding a sizeable share."""
    from minisgl.kernel.triton_sampling import gumbel_sample

    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(VOCAB, generator=gen) * 1.5
    strong = torch.randperm(VOCAB, generator=gen)[:12]
    logits[strong] += torch.linspace(11.0, 6.0, 12)
    logits = logits.to(torch.bfloat16)
    top, copies, launches = 20, 4096, 16
    p = torch.softmax(logits.double() / t, dim=-1)
    order = p.argsort(descending=True)[:top]
    buckets = torch.cat([p[order], (1 - p[order].sum()).reshape(1)])
    counts = torch.zeros(VOCAB, dtype=torch.float64)
    rows = logits.to(DEV).expand(copies, VOCAB)  # stride-0 rows: one row read `copies` times
    temps = torch.full((copies,), t, device=DEV)
    for _ in range(launches):
        counts += torch.bincount(gumbel_sample(rows, temps, seeds(copies)).cpu(), minlength=VOCAB).double()
    n = copies * launches
    freq = counts / n
    got = torch.cat([freq[order], (1 - freq[order].sum()).reshape(1)])
    tv = 0.5 * (got - buckets).abs().sum().item()
    mean, bound = tv_bound(buckets, n)
    assert tv < bound, f"TV {tv:.4f} (expected {mean:.4f}, bound {bound:.4f}); tail mass {buckets[-1]:.3f} got {got[-1]:.3f}"


def test_greedy_rows_are_torch_argmax() -> None:
    from minisgl.engine.sample import MIN_T
    from minisgl.kernel.triton_sampling import gumbel_sample

    torch.manual_seed(0)
    rows = 64
    x = torch.randn(rows, VOCAB, device=DEV).to(torch.bfloat16)
    m = x.float().max().item() + 1
    x[0, [7, VOCAB // 2, VOCAB - 1]] = m  # ties across chunks
    x[1, [1029, 700]] = m  # a later lane holding an earlier column
    x[2] = 0.25  # all equal
    x[3] = float("-inf")
    x[3, VOCAB - 3] = 1.0
    x[4] = float("-inf")  # nothing finite: torch.argmax says 0
    want = torch.argmax(x, dim=-1)
    greedy_t = torch.full((rows,), MIN_T, device=DEV)
    for split in (None, (1, 1), (4, 8)):
        got = gumbel_sample(x, greedy_t, seeds(rows), split=split)
        assert torch.equal(got, want), f"split {split}: {int((got != want).sum())} rows differ"
    mixed_t = torch.where(torch.arange(rows, device=DEV) % 2 == 0, MIN_T, 1.0).float()
    assert torch.equal(gumbel_sample(x, mixed_t, seeds(rows))[::2], want[::2]), "greedy rows in a mixed batch"


def test_a_draw_depends_only_on_its_row_and_seed() -> None:
    from minisgl.kernel.triton_sampling import gumbel_sample

    torch.manual_seed(0)
    rows = 256
    wide = torch.randn(rows, VOCAB + 64, device=DEV).to(torch.bfloat16)
    x = wide[:, 32 : 32 + VOCAB]  # row stride VOCAB + 64
    t = torch.rand(rows, device=DEV) + 0.5
    s = seeds(rows)
    ref = gumbel_sample(x.contiguous(), t, s)
    assert torch.equal(gumbel_sample(x.contiguous(), t, s), ref), "same seeds, same tokens"
    assert torch.equal(gumbel_sample(x, t, s), ref), "strided rows == contiguous"
    for split in ((1, 1), (2, 4), (4, 8)):
        assert torch.equal(gumbel_sample(x, t, s, split=split), ref), f"split {split}"
    pick = torch.randperm(rows, device=DEV)[: rows // 2]
    assert torch.equal(gumbel_sample(x[pick], t[pick], s[pick]), ref[pick]), "a subset, permuted"
    assert torch.equal(gumbel_sample(x[5:6], t[5:6], s[5:6]), ref[5:6]), "one row alone"
    differ = int((gumbel_sample(x, t, seeds(rows)) != ref).sum())
    assert differ > rows // 2, f"other seeds give other draws: {differ}/{rows} differ"
    one = torch.full((8, VOCAB), float("-inf"), device=DEV, dtype=torch.bfloat16)
    cols = torch.randint(0, VOCAB, (8,), device=DEV)
    one[torch.arange(8, device=DEV), cols] = 0.0
    for _ in range(20):
        assert torch.equal(gumbel_sample(one, torch.full((8,), 2.0, device=DEV), seeds(8)), cols), "the single finite entry"


def test_sampler_seeded_rows_and_graph_replay() -> None:
    from minisgl.engine.sample import BatchSamplingArgs, Sampler, _gumbel_draw
    from minisgl.kernel.triton_sampling import gumbel_sample

    torch.manual_seed(0)
    sampler = Sampler(DEV, vocab_size=VOCAB)
    rows = 16
    logits = torch.randn(rows, VOCAB, device=DEV).to(torch.bfloat16)
    t = torch.rand(rows, device=DEV) + 0.5
    seeded = [(0, 123), (5, 456)]
    plain = sampler.sample(logits, BatchSamplingArgs(temperatures=t, seeded_rows=seeded))
    top_p = torch.ones(rows, device=DEV)
    top_p[3] = 0.9  # a neighbour filters: the batch takes the filtered path
    filt = sampler.sample(logits, BatchSamplingArgs(temperatures=t, top_p=top_p, seeded_rows=seeded))
    assert torch.equal(plain[[0, 5]], filt[[0, 5]]), "seeded rows keep their draw when a neighbour filters"
    alone = sampler.sample(logits[5:6], BatchSamplingArgs(temperatures=t[5:6], seeded_rows=[(0, 456)]))
    assert torch.equal(alone, plain[5:6]), "a seeded row alone draws the same"

    s = seeds(rows)
    gumbel_sample(logits, t, s)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gumbel_sample(logits, t, s)
    for _ in range(3):
        logits.copy_(torch.randn(rows, VOCAB, device=DEV))
        s.copy_(seeds(rows))
        graph.replay()
        assert torch.equal(out, gumbel_sample(logits, t, s)), "graph replay == eager, new inputs"
    # the sampler's whole draw, seed generation included, captured: each replay draws anew
    flat = torch.zeros(rows, VOCAB, device=DEV)  # uniform rows: draws vary with the seeds
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        drawn = _gumbel_draw(flat, t, None)
    replays = []
    for _ in range(2):
        graph.replay()
        replays.append(drawn.clone())
    fresh = int((replays[0] != replays[1]).sum())
    assert fresh > rows // 2, f"captured sampler draw: {fresh}/{rows} rows differ between replays"
