"""Gemma's attention options in the Triton kernels: a sliding window and score soft-capping in the
triton backend's decode (split-K and direct; over an fp8 pool too, both of its kernels) and extend
(over a cached prefix) kernels and in the
deterministic kernel, against a dense float64 reference on random paged inputs, and the same
kernels reading a sliding layer's window pool through its translation; then an Engine
on the tiny Gemma 2 and Gemma 3 checkpoints of tests/test_gemma.py with the triton backend
against HF (float32 logits, a prompt prefilled in two chunks, then decode steps).

Run by tests/test_gemma.py under Triton's interpreter (`TRITON_INTERPRET=1 python -m
kernel_checks.gemma`; prints "gemma kernels ok" when every case passed), and on the GPU
(MINISGL_TEST_DEVICE=cuda) by importing `check_kernels` and `check_engine`.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import List

import torch

NO = None
HOST = torch.device("cpu")


def dense(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: int, window: int | None, scale: float,
          cap: float | None) -> torch.Tensor:  # fmt: skip
    """One query [Hq, D] at position `pos` over keys/values [S, Hk, D] (positions 0..S-1), float64."""
    first = 0 if window is None else max(0, pos - window + 1)
    k, v = keys[first : pos + 1].double(), values[first : pos + 1].double()
    group = q.shape[0] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # [n, Hq, D]
    s = (k * q.double()[None]).sum(-1) * scale  # [n, Hq]
    if cap is not None:
        s = torch.tanh(s / cap) * cap
    return (torch.softmax(s, 0)[..., None] * v).sum(0)


def _on(dev: torch.device, *ts: torch.Tensor) -> List[torch.Tensor]:
    return [t.to(dev) for t in ts]


def check_kernels(dev: torch.device = HOST) -> List[str]:
    """The inputs and references are made on the host; the kernels run on `dev`."""
    from minisgl.kernel.triton_attention import decode_attention, extend_attention
    from minisgl.kernel.triton_deterministic import deterministic_attention

    gen = torch.Generator().manual_seed(7)
    hq, hk, d, scale = 4, 2, 16, 0.3
    slots, width = 512, 160
    k = torch.randn(slots, hk, d, generator=gen)
    v = torch.randn(slots, hk, d, generator=gen)
    lens = [1, 9, 40, 110]
    table = torch.stack([torch.randperm(slots, generator=gen)[:width] for _ in lens]).int()
    rows = torch.arange(len(lens))
    errors: List[str] = []
    for window, cap in ((NO, NO), (NO, 5.0), (8, NO), (8, 5.0), (37, 5.0)):
        tag = f"window={window} softcap={cap}"
        # decode: the last position of each row, split-K (3 chunks) and direct (1)
        q = torch.randn(len(lens), hq, d, generator=gen)
        ref = torch.stack([dense(q[i], k[table[i, :n].long()], v[table[i, :n].long()], n - 1, window, scale, cap)
                           for i, n in enumerate(lens)])  # fmt: skip
        for splits in (1, 3):
            out = torch.full_like(q, float("nan"), device=dev)
            mid_o = torch.empty(len(lens), hq, splits, d, device=dev)
            mid_lse = torch.empty(len(lens), hq, splits, device=dev)
            args = _on(dev, q, k, v, table, rows, torch.tensor(lens), torch.full((len(lens),), splits))
            decode_attention(*args, mid_o, mid_lse, out, scale, window=window, softcap=cap)
            err = (out.cpu().double() - ref).abs().max().item()
            if not err < 1e-4:
                errors.append(f"decode {tag} splits={splits}: max err {err:.3g}")
        # extend: new tokens [cached, len) of each row, cached prefixes of 0, 4, 10 and 75 (kv blocks before the window skipped)
        cached = [0, 4, 10, 75]
        new = [n - c for n, c in zip(lens, cached)]
        starts = torch.tensor([sum(new[:i]) for i in range(len(new))])
        qe = torch.randn(sum(new), hq, d, generator=gen)
        out = torch.full_like(qe, float("nan"), device=dev)
        args = _on(dev, qe, k, v, table, rows, starts, torch.tensor(cached), torch.tensor(new))
        extend_attention(*args, max(new), out, scale, window=window, softcap=cap)
        pos = torch.tensor([p for n, c in zip(lens, cached) for p in range(c, n)])
        row_of = torch.tensor([i for i, m in enumerate(new) for _ in range(m)])
        ref = torch.stack([dense(qe[t], k[table[row_of[t], : pos[t] + 1].long()], v[table[row_of[t], : pos[t] + 1].long()],
                                 int(pos[t]), window, scale, cap) for t in range(len(pos))])  # fmt: skip
        err = (out.cpu().double() - ref).abs().max().item()
        if not err < 1e-4:
            errors.append(f"extend {tag}: max err {err:.3g}")
        det = deterministic_attention(*_on(dev, qe, k, v, table, row_of, pos), sm_scale=scale, window=window, softcap=cap)
        err = (det.cpu().double() - ref).abs().max().item()
        if not err < 1e-4:
            errors.append(f"deterministic {tag}: max err {err:.3g}")
        print(f"kernels {tag}: checked")
    errors += check_fp8_decode(k, v, table, lens, hq, scale, dev)
    errors += check_translation(k, v, table, lens, hq, scale, dev)
    return errors


def check_translation(k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, lens: List[int], hq: int, scale: float,
                      dev: torch.device = HOST) -> List[str]:  # fmt: skip
    """A hybrid pool's sliding layer (kvcache/window.py): K/V in a window pool twice the size,
    each page-table slot reached through a translation (main slot -> window slot, a random
    injection), the other window slots poisoned. Decode (split and direct), extend and the
    deterministic kernel give the bits of the same kernels over the untranslated pool."""
    from minisgl.kernel.triton_attention import decode_attention, extend_attention
    from minisgl.kernel.triton_deterministic import deterministic_attention

    gen = torch.Generator().manual_seed(11)
    table, lens = table[1:3], lens[1:3]  # (9 and 40 tokens: the interpreter is slow)
    slots, d = k.shape[0], k.shape[2]
    trans = torch.randperm(2 * slots, generator=gen)[:slots]
    kw = torch.full((2 * slots, *k.shape[1:]), 1.0e4)
    vw = torch.full_like(kw, 1.0e4)
    kw[trans], vw[trans] = k, v
    rows = torch.arange(len(lens))
    errors: List[str] = []
    window, cap = 8, 5.0
    q = torch.randn(len(lens), hq, d, generator=gen)
    for splits in (3,):  # (the direct kernel is the same loop)
        outs = []
        for kk, vv, tr in ((k, v, None), (kw, vw, trans)):
            out = torch.empty_like(q, device=dev)
            mid_o = torch.empty(len(lens), hq, splits, d, device=dev)
            mid_lse = torch.empty(len(lens), hq, splits, device=dev)
            args = _on(dev, q, kk, vv, table, rows, torch.tensor(lens), torch.full((len(lens),), splits))
            decode_attention(*args, mid_o, mid_lse, out, scale, window=window, softcap=cap,
                             translation=None if tr is None else tr.to(dev))  # fmt: skip
            outs.append(out.cpu())
        if not torch.equal(*outs):
            errors.append(f"decode through a translation, splits={splits}: differs by {(outs[0] - outs[1]).abs().max():.3g}")
    cached = [4, 20]
    new = [n - c for n, c in zip(lens, cached)]
    starts = torch.tensor([sum(new[:i]) for i in range(len(new))])
    qe = torch.randn(sum(new), hq, d, generator=gen)
    pos = torch.tensor([p for n, c in zip(lens, cached) for p in range(c, n)])
    row_of = torch.tensor([i for i, m in enumerate(new) for _ in range(m)])
    ext, det = [], []
    for kk, vv, tr in ((k, v, None), (kw, vw, trans)):
        t = None if tr is None else tr.to(dev)
        out = torch.empty_like(qe, device=dev)
        args = _on(dev, qe, kk, vv, table, rows, starts, torch.tensor(cached), torch.tensor(new))
        extend_attention(*args, max(new), out, scale, window=window, softcap=cap, translation=t)
        ext.append(out.cpu())
        det.append(deterministic_attention(*_on(dev, qe, kk, vv, table, row_of, pos), sm_scale=scale, window=window,
                                           softcap=cap, translation=t).cpu())  # fmt: skip
    if not torch.equal(*ext):
        errors.append(f"extend through a translation: differs by {(ext[0] - ext[1]).abs().max():.3g}")
    if not torch.equal(*det):
        errors.append(f"deterministic through a translation: differs by {(det[0] - det[1]).abs().max():.3g}")
    print("kernels through a window translation: checked")
    return errors


def check_fp8_decode(k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, lens: List[int], hq: int,
                     scale: float, dev: torch.device = HOST) -> List[str]:  # fmt: skip
    """Decode over an fp8_e4m3 pool with a bf16 query, window 8 and soft-cap 5: the tensor-core
    kernel (fp16 dots) and the CUDA-core one (its words widened from their bits here), direct
    and split, against float64 over the pool's widened values (bf16 output: relative 8e-3)."""
    import minisgl.kernel.triton_attention as TA

    k8, v8 = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
    q = torch.randn(len(lens), hq, k.shape[-1], generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    ref = torch.stack([dense(q[i].float(), k8[table[i, :n].long()].float(), v8[table[i, :n].long()].float(), n - 1, 8, scale, 5.0)
                       for i, n in enumerate(lens)])  # fmt: skip
    errors: List[str] = []
    try:
        for mode in ("dot", "cc"):
            TA.FP8_DECODE = mode
            for splits in (1, 3):
                out = torch.full_like(q, float("nan"), device=dev)
                mid_o = torch.empty(len(lens), hq, splits, k.shape[-1], device=dev)
                mid_lse = torch.empty(len(lens), hq, splits, device=dev)
                args = _on(dev, q, k8, v8, table, torch.arange(len(lens)), torch.tensor(lens), torch.full((len(lens),), splits))
                TA.decode_attention(*args, mid_o, mid_lse, out, scale, num_stages=2, window=8, softcap=5.0)
                err = ((out.cpu().double() - ref).abs().max() / ref.abs().max()).item()
                if not err < 8e-3:
                    errors.append(f"fp8 decode {mode} splits={splits}: relative err {err:.3g}")
    finally:
        TA.FP8_DECODE = "auto"
    print("kernels fp8 decode: checked")
    return errors


def check_engine() -> List[str]:
    """On the tests' device (MINISGL_TEST_DEVICE), float32."""
    from helpers import HFOracle, PageAllocator, make_req, random_prompts, running_engine, teacher_forced_logits
    from test_gemma import NAMES, build_gemma

    errors: List[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in NAMES:
            path = build_gemma(name, Path(tmp) / name, seed=90 + NAMES.index(name))
            hf = HFOracle(path)
            hf.model.config._attn_implementation = "eager"
            ids = random_prompts([30], seed=450)[0]
            steps = 6
            tokens, ref_logits = hf.greedy(ids, steps)
            with running_engine(path, page_size=4, attention_backend="triton") as engine:
                assert engine.config.attention_backend == "triton"
                PageAllocator(engine).allocate(0, len(ids) + steps)
                # the first 12 tokens alone, then the rest as an extend over that cached prefix
                first = make_req(ids[:12], 0, output_len=1)
                teacher_forced_logits(engine, [first], [[0]])
                req = make_req(ids, 0, output_len=steps, cached_len=12)
                ours = teacher_forced_logits(engine, [req], [tokens])
            err = (torch.stack([s[0] for s in ours]) - torch.stack(ref_logits)).abs().max().item()
            print(f"engine {name} triton: max |logit diff| vs HF {err:.3g}")
            if not err < 1e-4:
                errors.append(f"engine {name}: max logit diff {err:.3g}")
    return errors


def main() -> int:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run under TRITON_INTERPRET=1"
    from minisgl.kernel.interpreter import patch_interpreter

    patch_interpreter()
    errors = check_kernels() + check_engine()
    for e in errors:
        print("ERROR", e)
    print("gemma kernels ok" if not errors else f"gemma kernels: {len(errors)} errors")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
