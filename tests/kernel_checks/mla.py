"""The MLA decode kernel (kernel/triton_mla.py) against a dense float64 reference on random paged
latent pools: request lengths from 1 to past several key tiles, one chunk and several (split-K,
empty chunks included), head counts below and above one 16-head block, and two latent shapes
(the tiny test models' 32 + 8 and a 64 + 16 one); the output is NaN-poisoned scratch free.

Run by tests/test_deepseek.py under Triton's interpreter (`TRITON_INTERPRET=1 python -m
kernel_checks.mla`; prints "mla kernels ok" when every case passed), and on the GPU
(MINISGL_TEST_DEVICE=cuda) by importing `check_kernels` (bf16 too there).
"""

from __future__ import annotations

import sys
from typing import List

import torch

HOST = torch.device("cpu")


def dense(q: torch.Tensor, rows: torch.Tensor, scale: float, v_dim: int) -> torch.Tensor:
    """One request's absorbed queries [H, D] over its latent rows [n, D], float64: [H, v_dim]."""
    s = (q.double() @ rows.double().T) * scale
    return torch.softmax(s, dim=-1) @ rows.double()[:, :v_dim]


def check_kernels(dev: torch.device = HOST, dtypes: tuple = (torch.float32,)) -> List[str]:
    from minisgl.kernel.triton_mla import mla_decode

    gen = torch.Generator().manual_seed(21)
    errors: List[str] = []
    slots, width = 512, 160
    lens = [1, 7, 33, 150]
    for lat, rope, heads in ((32, 8, 4), (64, 16, 20)):
        pool = torch.randn(slots, 1, lat + rope, generator=gen)
        table = torch.stack([torch.randperm(slots, generator=gen)[:width] for _ in lens]).int()
        q = torch.randn(len(lens), heads, lat + rope, generator=gen)
        scale = (lat + rope) ** -0.5
        ref = torch.stack([dense(q[i], pool[table[i, :n].long(), 0], scale, lat) for i, n in enumerate(lens)])
        rows = torch.tensor([2, 0, 3, 1])  # the batch's page-table rows, not in order
        # an fp8 pool: the reference reads the same e4m3 values, widened
        pool8 = pool.clamp(-448, 448).to(torch.float8_e4m3fn)
        ref8 = torch.stack([dense(q[i], pool8.float()[table[i, :n].long(), 0], scale, lat) for i, n in enumerate(lens)])
        for dtype in dtypes:
            for fp8 in (False, True):
                for splits in (1, 3, 8):
                    kv = pool8.to(dev) if fp8 else pool.to(dev, dtype)
                    t, r = table[torch.argsort(rows)], rows  # row rows[i] holds request i's slots
                    out = mla_decode(q.to(dev, dtype), kv, t.to(dev), r.to(dev), torch.tensor(lens).to(dev), scale, lat, splits)
                    tol = 1e-5 if dtype == torch.float32 else 3e-2
                    err = (out.double().cpu() - (ref8 if fp8 else ref)).abs().max().item()
                    tag = f"lat={lat} rope={rope} heads={heads} {dtype} fp8={fp8} splits={splits}"
                    if not err < tol or out.shape != (len(lens), heads, lat):
                        errors.append(f"{tag}: max err {err:.3g}, shape {tuple(out.shape)}")
    return errors


def main() -> int:
    from minisgl.kernel.interpreter import patch_interpreter

    patch_interpreter()  # numpy-2 scalar conversion of the loop bounds
    errors = check_kernels()
    for e in errors:
        print(e)
    if errors:
        return 1
    print("mla kernels ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
