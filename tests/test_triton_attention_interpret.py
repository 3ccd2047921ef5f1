"""The Triton attention backend on a CPU machine, through Triton's interpreter (TRITON_INTERPRET=1).

benchmark/gpu_check.py --quick compares the triton backend's decode (split-K and single-chunk,
longest-first program order, mixed lengths, GQA/MHA, page_size 1 and 16) and extend-over-a-cached-
prefix kernels with the torch backend on random paged inputs, and drives a tiny random Qwen3
Engine with the triton backend against HF generate (float32, token-exact). The interpreter must be
on before triton is first imported, so it runs in a subprocess; float32 only (the interpreter's
bf16 tl.dot is broken). On the H200 the same script runs the bf16 cases and CUDA graphs.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

ROOT = Path(__file__).resolve().parents[1]


def test_triton_attention_backend_in_interpreter() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmark" / "gpu_check.py"), "--parts", "kernels,engine", "--quick", "--out", ""],
        env=env, capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    print(proc.stdout[-6000:])
    assert proc.returncode == 0, f"attention checks failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-4000:]}"
    assert "kernels: 12/12 ok" in proc.stdout and "errors: 0" in proc.stdout, proc.stdout[-3000:]
    assert proc.stdout.count("== HF fp32: True") == 4, proc.stdout[-3000:]


_TILES = """
import torch
from minisgl.kernel.interpreter import patch_interpreter

patch_interpreter()
from minisgl.kernel.triton_attention import extend_attention

torch.manual_seed(0)
Hq, Hk, D, slots = 4, 2, 64, 2048
k, v = torch.randn(slots, Hk, D), torch.randn(slots, Hk, D)
spec = [(200, 300), (0, 130), (37, 5)]  # (cached, new) per request
pt = torch.zeros(len(spec), 1024, dtype=torch.int32)
perm = torch.randperm(slots)
q_start, pos = [], 0
for i, (c, n) in enumerate(spec):
    pt[i, : c + n] = perm[i * 600 : i * 600 + c + n]
    q_start.append(pos)
    pos += n
q = torch.randn(pos, Hq, D)
ref = torch.empty_like(q)
for i, (c, n) in enumerate(spec):
    keys = pt[i, : c + n].long()
    kk, vv = k[keys].repeat_interleave(Hq // Hk, 1), v[keys].repeat_interleave(Hq // Hk, 1)
    s = torch.einsum("qhd,khd->hqk", q[q_start[i] : q_start[i] + n], kk) / D**0.5
    s = s.masked_fill(torch.arange(c + n)[None, None, :] > (c + torch.arange(n))[None, :, None], float("-inf"))
    ref[q_start[i] : q_start[i] + n] = torch.einsum("hqk,khd->qhd", s.softmax(-1), vv)
meta = [torch.tensor(x, dtype=torch.int64) for x in (list(range(len(spec))), q_start, [c for c, _ in spec], [n for _, n in spec])]
for cfg in ((128, 64, 4, 3), (64, 64, 4, 3)):
    for heavy in (True, False):
        out = torch.full_like(q, float("nan"))
        extend_attention(q, k, v, pt, *meta, max(n for _, n in spec), out, D**-0.5, config=cfg, heavy_first=heavy)
        err = ((out - ref).abs().max() / ref.abs().max()).item()
        assert err < 1e-5, (cfg, heavy, err)
print("tiles ok")
"""


def test_extend_tiles_in_interpreter() -> None:
    """The extend kernel's long-chunk tile (128 query rows) and both block orders, against a
    torch reference (causal over a cached prefix, scattered slots, NaN-poisoned output)."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", _TILES], env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0 and "tiles ok" in proc.stdout, proc.stderr[-4000:]
