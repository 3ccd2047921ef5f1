"""The Gumbel-max sampling kernel (minisgl/kernel/triton_sampling.py) through Triton's interpreter:
`TRITON_INTERPRET=1 python -m kernel_checks.sampling` (tests/test_triton_sampling_interpret.py runs it);
tests/test_sampling_cuda.py checks it on the GPU at V=151,936."""

from __future__ import annotations

import sys


def main() -> int:
    """Every check printed; 1 when any failed."""
    import os

    assert os.environ.get("TRITON_INTERPRET") == "1"
    import torch

    from minisgl.kernel.interpreter import patch_interpreter

    patch_interpreter()  # bf16 rounds to nearest like the GPU; numpy-2 scalar conversion

    import minisgl.engine.sample as S
    import minisgl.kernel.triton_sampling as K
    from minisgl.kernel.triton_sampling import GREEDY_T, TILE, gumbel_sample

    # The interpreter pays per program, not per element: let the default split merge rows freely
    # (the split never changes a draw, which is checked below with explicit splits).
    print("GPU default splits (rows, tiles) at V=151936, B=1/64/256:", [K._launch_split(b, 149) for b in (1, 64, 256)])
    K._MIN_PROGRAMS, K._MAX_ROWS = 1, 64
    BIG = (64, 1)

    torch.manual_seed(0)
    failures = []

    def check(name, ok, detail=""):
        print(f"{'ok  ' if ok else 'FAIL'} {name:60s} {detail}")
        if not ok:
            failures.append(name)

    def seeds(n):
        return torch.randint(0, 2**62, (n,), dtype=torch.int64)

    def check_frequencies(name, draws, p):
        # A correct sampler's total variation distance from p: mean 0.5 * sum sqrt(2 p (1 - p) / (pi n))
        # and sd below; allow 6 sd. A wrong temperature (0.7 for 1) is off by more than 0.1.
        n = draws.numel()
        freq = torch.bincount(draws, minlength=p.numel()).float() / n
        tv = 0.5 * (freq - p).abs().sum().item()
        pq = p * (1 - p)
        mean = 0.5 * (2 * pq / (torch.pi * n)).sqrt().sum().item()
        bound = mean + 6 * 0.5 * ((1 - 2 / torch.pi) * pq.sum().item() / n) ** 0.5
        check(f"frequencies {name}", tv < bound, f"TV {tv:.4f} (expected {mean:.4f}, bound {bound:.4f})")
        check(f"zero-probability entries never drawn {name}", bool((freq[p == 0] == 0).all()))

    # (a) frequencies against softmax(logits / T): three distributions (one with -inf entries) in
    # one launch of N rows each, every row its own seed. The 40 live entries sit on 10 lanes x the
    # 4 quarters of a tile, so all four Philox words feed the draws (reusing one word for two
    # columns would correlate them); the rest of the vocabulary is -inf. fp32 only: bf16 logits
    # give exactly the draws of their fp32 upcast (checked below).
    N = 7000
    lanes = torch.tensor([3, 50, 77, 120, 128, 170, 200, 230, 241, 250])
    live = (lanes[:, None] + torch.arange(4)[None, :] * (TILE // 4)).flatten()
    V = TILE
    decay = -0.3 * torch.randperm(live.numel()).float()  # geometric probabilities, shuffled
    base = torch.full((3, V), float("-inf"))
    base[:, live] = decay
    base[1, live[::7]] = float("-inf")  # (d) masked vocabulary entries among the live ones
    temps = torch.tensor([1.0, 0.7, 1.6])
    tok = gumbel_sample(base.repeat_interleave(N, dim=0), temps.repeat_interleave(N), seeds(3 * N), split=BIG)
    for i, draws in enumerate(tok.view(3, N)):
        check_frequencies(f"T={temps[i].item():.2f}", draws, torch.softmax(base[i] / temps[i], dim=-1))

    # (b) greedy rows are torch.argmax exactly, ties to the lowest index: within a lane, across
    # lanes where a later lane holds an earlier column, across tiles and chunks.
    V2 = 3 * TILE + 77
    g = torch.randn(8, V2)
    top = g.max() + 1
    g[0, [700, 1029, 2500]] = top  # lane 188 of tile 0 vs lane 5 of tile 1
    g[1, [1029, 2500]] = top  # tile 1 vs tile 2 (another chunk when tiles per program is 1)
    g[2] = 0.5  # all equal
    g[3] = float("-inf")
    g[3, V2 - 1] = 3.0  # only the last entry is finite
    g[4] = float("-inf")  # nothing finite: torch.argmax says 0
    g[5, [5, 6, V2 - 1]] = top  # neighbours in one lane group, and the last column
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = g.to(dtype)
        want = torch.argmax(x, dim=-1)
        t = torch.full((8,), GREEDY_T)
        for split in (None, (1, 1), (2, 4), (8, 2)):
            got = gumbel_sample(x, t, seeds(8), split=split)
            name = f"greedy == torch.argmax {str(dtype)[6:]} split {split}"
            check(name, torch.equal(got, want), f"{got.tolist()} vs {want.tolist()}")

    # greedy and sampled rows mixed in one batch: the greedy rows stay exact
    t = torch.tensor([GREEDY_T, 1.0, GREEDY_T, 0.5, GREEDY_T, 2.0, GREEDY_T, 1.0])
    got = gumbel_sample(g, t, seeds(8))
    greedy = t <= GREEDY_T
    check("greedy rows in a mixed batch", torch.equal(got[greedy], torch.argmax(g, dim=-1)[greedy]))

    # (d) one finite entry: every draw, at any temperature, picks it
    t = torch.tensor([1.0, 50.0, 0.05, 1.0])
    one = torch.full((4, V2), float("-inf"))
    one[torch.arange(4), torch.tensor([0, 1500, V2 - 1, 3000])] = torch.tensor([-1e4, 0.0, 7.0, 1e30])
    for _ in range(3):
        got = gumbel_sample(one, t, seeds(4), split=(1, 1))
        check("only finite entry is drawn", got.tolist() == [0, 1500, V2 - 1, 3000], str(got.tolist()))

    # (c) a row's draw depends only on its logits, temperature and seed: not on the other rows,
    # the batch size, the row order, the launch split, the row stride or a bf16 -> fp32 upcast.
    B = 12
    wide = torch.randn(B, V2 + 13) * 0.5  # flat-ish rows: draws vary a lot with the seed
    x = wide[:, 5 : 5 + V2]  # row stride V2 + 13, last dim contiguous
    t = torch.rand(B) + 0.5
    s = seeds(B)
    ref = gumbel_sample(x.contiguous(), t, s, split=(1, 1))
    check("same seed, same token (repeat)", torch.equal(gumbel_sample(x.contiguous(), t, s, split=(1, 1)), ref))
    check("strided rows == contiguous", torch.equal(gumbel_sample(x, t, s), ref))
    for split in ((4, 1), (2, 2), (16, 4), None):
        check(f"launch split {split} does not change draws", torch.equal(gumbel_sample(x, t, s, split=split), ref))
    perm = torch.randperm(B)[:5]
    check("subset, permuted: same draws", torch.equal(gumbel_sample(x[perm], t[perm], s[perm]), ref[perm]))
    other = torch.randn(B, V2)
    both = gumbel_sample(torch.cat([other, x]), torch.cat([t, t]), torch.cat([seeds(B), s]))
    check("other rows in the batch do not matter", torch.equal(both[B:], ref))
    xt = x.t().contiguous().t()  # column stride != 1: copied
    check("column-strided logits", torch.equal(gumbel_sample(xt, t, s), ref))
    xb = x.to(torch.bfloat16)
    check("bf16 == its fp32 upcast", torch.equal(gumbel_sample(xb, t, s), gumbel_sample(xb.float(), t, s)))
    diff = (gumbel_sample(x, t, seeds(B)) != ref).sum().item()
    check("another seed gives other draws", diff >= B // 2, f"{diff}/{B} rows differ")

    # The sampler's CUDA path, forced on (use_fused is false on CPU tensors).
    S.use_fused = lambda x: True
    sampler = S.Sampler(torch.device("cpu"), vocab_size=V2)
    logits = torch.randn(4, V2).to(torch.bfloat16)
    t = torch.tensor([1.0, 0.8, S.MIN_T, 1.2])
    seeded = [(0, 12345), (3, 777)]
    plain = sampler.sample(logits, S.BatchSamplingArgs(temperatures=t, seeded_rows=seeded))
    want = gumbel_sample(logits, t, torch.tensor([12345, 0, 0, 777]))
    check("sampler: seeded rows use their step seed", plain[[0, 3]].tolist() == want[[0, 3]].tolist())
    check("sampler: greedy row in a mixed batch", plain[2].item() == torch.argmax(logits[2]).item())
    top_k = torch.tensor([V2, 5, V2, V2], dtype=torch.int32)
    top_p = torch.tensor([1.0, 1.0, 1.0, 0.9])
    # row 3 asks for top-p, so this batch takes the filtered path; row 0 does not filter
    filt = sampler.sample(logits, S.BatchSamplingArgs(temperatures=t, top_k=top_k, top_p=top_p, seeded_rows=seeded))
    check("sampler: seeded unfiltered row, neighbour filters", filt[0].item() == plain[0].item())
    check("sampler: greedy row, filtered batch", filt[2].item() == plain[2].item())
    # greedy rows with their own top-k = 1 / top-p and tied maxima: the filters sort the ties in
    # any order, the greedy rows still take the lowest tied id (issue 31)
    args = S.BatchSamplingArgs(
        temperatures=torch.tensor([S.MIN_T, S.MIN_T, 1.0, 0.7]),
        top_k=torch.tensor([1, V2, V2, 4], dtype=torch.int32),
        top_p=torch.tensor([1.0, 0.5, 1.0, 1.0]),
        greedy_rows=torch.tensor([0, 1]),
    )
    gen = torch.Generator().manual_seed(3)
    wrong = 0
    for trial in range(12):
        tied = torch.randn(4, V2, generator=gen)
        for row in range(4):
            tied[row, torch.randperm(V2, generator=gen)[: 2 + trial % 3]] = tied.max() + 1.0
        wrong += int((sampler.sample(tied, args)[:2] != tied[:2].argmax(dim=-1)).sum())
    check("sampler: greedy rows with ties, own top-k/top-p: lowest id", wrong == 0, f"{wrong}/24 rows")
    alone = sampler.sample(logits[:1], S.BatchSamplingArgs(temperatures=t[:1], seeded_rows=[(0, 12345)]))
    check("sampler: seeded row alone", alone.item() == plain[0].item())
    # filtered draws stay inside the filter, with the renormalised probabilities
    n, V = 4000, 40
    row = torch.randn(V) * 2
    args = S.BatchSamplingArgs(temperatures=torch.full((n,), 0.9), top_k=torch.full((n,), 3, dtype=torch.int32))
    draws = S.Sampler(torch.device("cpu"), vocab_size=V).sample(row.expand(n, V), args)
    p = torch.softmax(row / 0.9, dim=-1)
    keep = p.topk(3).indices
    q = torch.zeros(V)
    q[keep] = p[keep] / p[keep].sum()
    check_frequencies("sampler, top-k=3", draws, q)

    print("FAILURES:", failures)

    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
