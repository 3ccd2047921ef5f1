"""GPT-OSS's attention sinks in the Triton kernels: decode (split-K, where the reduce adds the
sink, and direct, where the first stage does) and extend (over a cached prefix), with and without
a sliding window, against a dense float64 reference on random paged inputs; the triton MoE with
the experts' gate/up bias and clamped SwiGLU against the torch MoE backend; then an Engine on the
tiny GPT-OSS checkpoint of tests/test_gpt_oss.py with the triton backend against HF (float32
logits, a prompt prefilled in two chunks, then decode steps).

Run by tests/test_gpt_oss.py under Triton's interpreter (`TRITON_INTERPRET=1 python -m
kernel_checks.gpt_oss`; prints "gpt_oss kernels ok" when every case passed), and on the GPU
(MINISGL_TEST_DEVICE=cuda) by importing `check_kernels` and `check_engine`.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import List

import torch

HOST = torch.device("cpu")


def dense(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: int, window: int | None, scale: float,
          sinks: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """One query [Hq, D] at position `pos` over keys/values [S, Hk, D], float64: softmax over the
    visible scores and the head's sink logit, the sink's share dropped."""
    first = 0 if window is None else max(0, pos - window + 1)
    k, v = keys[first : pos + 1].double(), values[first : pos + 1].double()
    group = q.shape[0] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # [n, Hq, D]
    s = (k * q.double()[None]).sum(-1) * scale  # [n, Hq]
    p = torch.softmax(torch.cat([s, sinks.double()[None]], 0), 0)[:-1]
    return (p[..., None] * v).sum(0)


def _on(dev: torch.device, *ts: torch.Tensor) -> List[torch.Tensor]:
    return [t.to(dev) for t in ts]


def check_kernels(dev: torch.device = HOST) -> List[str]:
    from minisgl.kernel.triton_attention import decode_attention, extend_attention

    gen = torch.Generator().manual_seed(11)
    hq, hk, d, scale = 4, 2, 16, 0.3
    slots, width = 384, 96
    k = torch.randn(slots, hk, d, generator=gen)
    v = torch.randn(slots, hk, d, generator=gen)
    sinks = 2 * torch.randn(hq, generator=gen)  # some above the scores, some below
    lens = [1, 9, 40, 90]
    table = torch.stack([torch.randperm(slots, generator=gen)[:width] for _ in lens]).int()
    rows = torch.arange(len(lens))
    errors: List[str] = []
    for window in (None, 8):
        tag = f"window={window} sinks"
        q = torch.randn(len(lens), hq, d, generator=gen)
        ref = torch.stack([dense(q[i], k[table[i, :n].long()], v[table[i, :n].long()], n - 1, window, scale, sinks)
                           for i, n in enumerate(lens)])  # fmt: skip
        for splits in (1, 3):
            out = torch.full_like(q, float("nan"), device=dev)
            mid_o = torch.empty(len(lens), hq, splits, d, device=dev)
            mid_lse = torch.empty(len(lens), hq, splits, device=dev)
            args = _on(dev, q, k, v, table, rows, torch.tensor(lens), torch.full((len(lens),), splits))
            decode_attention(*args, mid_o, mid_lse, out, scale, window=window, sinks=sinks.to(dev))
            err = (out.cpu().double() - ref).abs().max().item()
            if not err < 1e-4:
                errors.append(f"decode {tag} splits={splits}: max err {err:.3g}")
        cached = [0, 4, 10, 70]
        new = [n - c for n, c in zip(lens, cached)]
        starts = torch.tensor([sum(new[:i]) for i in range(len(new))])
        qe = torch.randn(sum(new), hq, d, generator=gen)
        out = torch.full_like(qe, float("nan"), device=dev)
        args = _on(dev, qe, k, v, table, rows, starts, torch.tensor(cached), torch.tensor(new))
        extend_attention(*args, max(new), out, scale, window=window, sinks=sinks.to(dev))
        pos = [p for n, c in zip(lens, cached) for p in range(c, n)]
        row_of = [i for i, m in enumerate(new) for _ in range(m)]
        ref = torch.stack([dense(qe[t], k[table[row_of[t], : pos[t] + 1].long()], v[table[row_of[t], : pos[t] + 1].long()],
                                 pos[t], window, scale, sinks) for t in range(len(pos))])  # fmt: skip
        err = (out.cpu().double() - ref).abs().max().item()
        if not err < 1e-4:
            errors.append(f"extend {tag}: max err {err:.3g}")
        print(f"kernels {tag}: checked")
    return errors


def check_moe(dev: torch.device = HOST) -> List[str]:
    """The triton MoE with GPT-OSS's gate/up bias and clamped SwiGLU against the torch MoE
    backend (float32; the limit low enough to clamp), decode-sized and prefill-sized."""
    from minisgl.moe.base import ClampedSwiglu
    from minisgl.moe.torch_moe import TorchMoeBackend
    from minisgl.moe.triton_moe import TritonMoeBackend

    gen = torch.Generator().manual_seed(12)
    act = ClampedSwiglu(1.702, 0.7)
    errors: List[str] = []
    for tokens, hidden, inter, experts, top_k in ((1, 32, 16, 4, 2), (20, 64, 48, 4, 2)):
        x = torch.randn(tokens, hidden, generator=gen)
        w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5
        b13 = torch.randn(experts, 2 * inter, generator=gen)
        w2 = torch.randn(experts, hidden, inter, generator=gen) / inter**0.5
        tw, ti = torch.topk(torch.randn(tokens, experts, generator=gen), top_k, dim=-1)
        tw = torch.softmax(tw, -1)
        want = TorchMoeBackend().forward(x, w13, w2, tw, ti, b13, act)
        got = TritonMoeBackend().forward(*_on(dev, x, w13, w2, tw, ti, b13), act).cpu()
        err = (got - want).abs().max().item()
        if not err < 1e-4:
            errors.append(f"moe T={tokens} bias + clamped swiglu: max err {err:.3g}")
        print(f"moe T={tokens} bias + clamped swiglu: max err {err:.3g}")
    return errors


def check_engine() -> List[str]:
    """On the tests' device (MINISGL_TEST_DEVICE), float32."""
    from helpers import HFOracle, PageAllocator, make_req, random_prompts, running_engine, teacher_forced_logits
    from test_gpt_oss import build_gpt_oss

    errors: List[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        path = build_gpt_oss(Path(tmp) / "gpt_oss", seed=91)
        hf = HFOracle(path)
        hf.model.config._attn_implementation = "eager"
        ids = random_prompts([30], seed=950)[0]
        steps = 6
        tokens, ref_logits = hf.greedy(ids, steps)
        with running_engine(path, page_size=4, attention_backend="triton", moe_backend="triton") as engine:
            assert engine.config.attention_backend == "triton"
            assert type(engine.moe_backend).__name__ == "TritonMoeBackend"
            PageAllocator(engine).allocate(0, len(ids) + steps)
            first = make_req(ids[:12], 0, output_len=1)  # 12 tokens alone, the rest over that cached prefix
            teacher_forced_logits(engine, [first], [[0]])
            req = make_req(ids, 0, output_len=steps, cached_len=12)
            ours = teacher_forced_logits(engine, [req], [tokens])
        err = (torch.stack([s[0] for s in ours]) - torch.stack(ref_logits)).abs().max().item()
        print(f"engine gpt_oss triton: max |logit diff| vs HF {err:.3g}")
        if not err < 1e-4:
            errors.append(f"engine gpt_oss: max logit diff {err:.3g}")
    return errors


def main() -> int:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run under TRITON_INTERPRET=1"
    from minisgl.kernel.interpreter import patch_interpreter

    patch_interpreter()
    errors = check_kernels() + check_moe() + check_engine()
    for e in errors:
        print("ERROR", e)
    print("gpt_oss kernels ok" if not errors else f"gpt_oss kernels: {len(errors)} errors")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
