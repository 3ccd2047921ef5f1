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


_FP8 = """
import torch
from minisgl.kernel.interpreter import patch_interpreter

patch_interpreter()
from minisgl.kernel.triton_attention import decode_attention, extend_attention, store_kv
from minisgl.kvcache.pool import KVCachePool

torch.manual_seed(0)
Hq, Hk, D, slots = 4, 2, 64, 1024
fp8 = torch.float8_e4m3fn

# the store kernel writes the pool's reference bytes (saturation, subnormals, round to nearest)
for dt in (torch.float32, torch.bfloat16):
    k = (torch.randn(40, Hk, D) * 60).to(dt)
    k.view(-1)[:4] = torch.tensor([1000.0, -1000.0, float("inf"), 3e-3])
    v = (torch.randn(40, Hk, D) * 0.01).to(dt)
    loc = torch.randperm(slots)[:40]
    ref = KVCachePool(1, slots, Hk, D, torch.device("cpu"), dt, kv_cache_dtype="fp8_e4m3")
    ref.store_kv(k, v, loc, 0)
    kc, vc = torch.zeros(slots, Hk, D, dtype=fp8), torch.zeros(slots, Hk, D, dtype=fp8)
    store_kv(kc, vc, k, v, loc)
    assert torch.equal(kc.view(torch.uint8), ref.k_cache(0).view(torch.uint8)), dt
    assert torch.equal(vc.view(torch.uint8), ref.v_cache(0).view(torch.uint8)), dt

# attention over an fp8 pool == attention over its values widened (decode: bf16 q, fp16 dots;
# extend: float32), against a float32 reference
k8 = (torch.randn(slots, Hk, D) * 2).to(fp8)
v8 = torch.randn(slots, Hk, D).to(fp8)
lens = [37, 130, 5]
pt = torch.zeros(len(lens), 256, dtype=torch.int32)
perm = torch.randperm(slots)
for i, n in enumerate(lens):
    pt[i, :n] = perm[i * 300 : i * 300 + n]


def reference(q, i, n, first):  # queries of request i at positions first.. attend causally
    kk = k8[pt[i, :n].long()].float().repeat_interleave(Hq // Hk, 1)
    vv = v8[pt[i, :n].long()].float().repeat_interleave(Hq // Hk, 1)
    s = torch.einsum("qhd,khd->hqk", q.float(), kk) / D**0.5
    s = s.masked_fill(torch.arange(n)[None, None, :] > (first + torch.arange(q.shape[0]))[None, :, None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), vv)


import minisgl.kernel.triton_attention as TA

# every e4m3 magnitude class: subnormals, the largest finite (+-448), zeros of both signs
k8.view(-1)[:6] = torch.tensor([2.0**-9, -(2.0**-7), 448.0, -448.0, 0.0, -0.0]).to(fp8)
q = torch.randn(len(lens), Hq, D).to(torch.bfloat16)
ref = torch.stack([reference(q[i : i + 1], i, n, n - 1)[0] for i, n in enumerate(lens)])
# the tensor-core kernel (fp16 dots over fp8 bytes) and the CUDA-core kernel (1 to 4 keys per
# thread per tile; its int32 words are widened from their bits here), direct and split
for mode, tile, warps in (("dot", 32, 4), ("cc", 32, 4), ("cc", 64, 2), ("cc", 128, 4)):
    TA.FP8_DECODE, TA.CC_TILE = mode, (tile, warps)
    assert TA.use_cc_decode(q.dtype, fp8, Hq // Hk, D) == (mode == "cc")
    for S in (1, 4):
        out = torch.full_like(q, float("nan"))
        splits = torch.tensor([min(S, -(-n // 16)) for n in lens])
        mid_o, mid_lse = torch.full((len(lens), Hq, S, D), float("nan")), torch.full((len(lens), Hq, S), float("nan"))
        decode_attention(q, k8, v8, pt, torch.arange(len(lens)), torch.tensor(lens), splits, mid_o, mid_lse, out,
                         D**-0.5, block_n=tile, num_warps=warps, num_stages=2)
        err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
        assert err < 8e-3, (mode, tile, S, err)  # the bf16 output's rounding
TA.FP8_DECODE, TA.CC_TILE = "auto", (64, 4)
spec = [(30, 7), (0, 130)]  # (cached, new)
qe = torch.randn(sum(n for _, n in spec), Hq, D)
meta = [torch.tensor(x) for x in ([0, 1], [0, 7], [c for c, _ in spec], [n for _, n in spec])]
out = torch.full_like(qe, float("nan"))
extend_attention(qe, k8, v8, pt, *meta, 130, out, D**-0.5)
refe = torch.cat([reference(qe[:7], 0, 37, 30), reference(qe[7:], 1, 130, 0)])
err = ((out - refe).abs().max() / refe.abs().max()).item()
assert err < 1e-5, err
print("fp8 ok")
"""


def test_fp8_kv_kernels_in_interpreter() -> None:
    """The fp8_e4m3 pool through the triton kernels: stored bytes == the pool's reference store,
    decode (split and direct) and extend over fp8 keys/values against a float32 reference."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", _FP8], env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0 and "fp8 ok" in proc.stdout, proc.stderr[-4000:]
