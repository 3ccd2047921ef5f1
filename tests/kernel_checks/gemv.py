"""The skinny-M GEMV kernels (minisgl/kernel/triton_gemv.py) and the fused decoder layer
(minisgl/kernel/skinny.py) through Triton's interpreter: `TRITON_INTERPRET=1 python -m kernel_checks.gemv`
(tests/test_triton_gemv_interpret.py runs it); tools/gemv_tune.py checks and times them on a GPU."""

from __future__ import annotations

import sys


def main() -> int:
    """Every comparison printed; 1 when any failed."""
    import os

    assert os.environ.get("TRITON_INTERPRET") == "1"
    import torch
    import torch.nn.functional as F
    from torch import nn

    from minisgl.kernel.interpreter import patch_interpreter

    patch_interpreter()

    from minisgl.kernel import skinny
    from minisgl.kernel.triton_gemv import GemvConfig, gemv
    from minisgl.layers.activation import silu_and_mul_torch
    from minisgl.layers.norm import rms_norm_torch

    torch.manual_seed(0)
    failures = []

    def check(name, got, ref, dtype):
        got, ref = got.float(), ref.float()
        # float32: only the summation order differs. bf16: one rounding of the product, which
        # may land one ulp away from torch's; the gated path rounds twice more after it.
        atol, rtol = (1e-4, 1e-4) if dtype == torch.float32 else (2e-2, 2e-2)
        ok = got.shape == ref.shape and bool(torch.isfinite(got).all()) and torch.allclose(got, ref, atol=atol, rtol=rtol)
        err = (got - ref).abs().max().item() if got.shape == ref.shape else float("nan")
        print(f"{'ok  ' if ok else 'FAIL'} {name:56s} {str(dtype):15s} max|err| {err:.3g}")
        if not ok:
            failures.append(name)

    K_, N_ = 96, 40  # two K tiles of 64 (the second partial), N tiles of 16 (the last partial)
    for dtype in (torch.float32, torch.bfloat16):
        for m, cfg in (
            (1, GemvConfig(1, 16, 64, 4, 2)),
            (1, GemvConfig(1, 4, 32, 4, 1)),
            (3, GemvConfig(4, 2, 32, 4, 1)),
            (3, GemvConfig(16, 16, 64, 4, 2)),
        ):
            if cfg.block_m > 1 and dtype != torch.float32:
                continue  # the interpreter's bf16 tl.dot is broken; tools/gemv_tune.py checks these tiles on a GPU
            x = torch.randn(m, K_, dtype=dtype)
            r = torch.randn(m, K_, dtype=dtype)
            nw = (torch.rand(K_) + 0.5).to(dtype)
            w = (torch.randn(2 * N_, K_) / K_**0.5).to(dtype)
            tag = f"m={m} bm={cfg.block_m} bn={cfg.block_n} bk={cfg.block_k}"
            out, res = gemv(x, w, cfg)
            check(f"plain {tag}", out, F.linear(x, w), dtype)
            assert res is None
            s = x + r
            h = rms_norm_torch(s, nw, 1e-6)
            out, res = gemv(x, w, cfg, residual=r, norm_weight=nw, eps=1e-6)
            check(f"norm+residual {tag}", out, F.linear(h, w), dtype)
            check(f"norm+residual: new residual {tag}", res, s, dtype)
            out, res = gemv(x, w, cfg, norm_weight=nw, eps=1e-6)
            check(f"norm, no residual {tag}", out, F.linear(rms_norm_torch(x, nw, 1e-6), w), dtype)
            out, res = gemv(x, w, cfg, residual=r, norm_weight=nw, eps=1e-6, gated=True)
            check(f"norm+residual+silu gate {tag}", out, silu_and_mul_torch(F.linear(h, w)), dtype)
            check(f"gated: new residual {tag}", res, s, dtype)
            assert out.shape == (m, N_)

    # a tiny decoder layer: the fused composition against the layer's own module path
    from minisgl.distributed import set_tp_info
    from minisgl.models.base import DecoderLayer, GatedMLP
    from minisgl.models.config import ModelConfig

    set_tp_info(rank=0, size=1)

    class Attn(nn.Module):  # stands in for AttentionLayer: q columns of qkv, scaled
        def forward(self, qkv):
            return qkv[:, :64] * 0.5

    class SelfAttn(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv_proj = nn.Linear(96, 128, bias=False)
            self.o_proj = nn.Linear(64, 96, bias=False)
            self.attn = Attn()

        def forward(self, x):
            return self.o_proj(self.attn(self.qkv_proj(x)))

    model_cfg = ModelConfig.__new__(ModelConfig)
    object.__setattr__(model_cfg, "hidden_size", 96)
    object.__setattr__(model_cfg, "rms_norm_eps", 1e-6)
    for dtype in (torch.float32, torch.bfloat16):
        layer = DecoderLayer(model_cfg, SelfAttn(), GatedMLP(96, 40, "silu")).to(dtype)
        with torch.no_grad():
            for p in layer.parameters():
                p.copy_(torch.randn_like(p) * 0.2 + (1.0 if p.dim() == 1 else 0.0))
        plan = skinny.SkinnyPlan(max_m=16)
        for kind, lin in (
            ("norm", layer.self_attn.qkv_proj),
            ("plain", layer.self_attn.o_proj),
            ("gated", layer.mlp.gate_up_proj),
            ("plain", layer.mlp.down_proj),
        ):
            n_w, k = lin.weight.shape  # type: ignore[union-attr, misc]
            plan.table[(kind, n_w, k, 1)] = GemvConfig(1, 16, 32, 4, 1)
            plan.table[(kind, n_w, k, 4)] = GemvConfig(4, 2, 32, 4, 1)
        assert skinny.fusable_layer(layer)
        for m in (1, 3):
            x = torch.randn(m, 96, dtype=dtype)
            for residual in (None, torch.randn(m, 96, dtype=dtype)):
                skinny.set_plan(None)
                ref = layer(x, residual)
                skinny.set_plan(plan)
                layer._skinny_ok = True
                got = skinny.decoder_layer_forward(layer, x, residual)
                layer._skinny_ok = False
                assert got is not None
                name = f"decoder layer m={m} residual={'yes' if residual is not None else 'none'}"
                check(name + " (out)", got[0], ref[0], dtype)
                check(name + " (residual)", got[1], ref[1], dtype)
        skinny.set_plan(None)
        assert skinny.decoder_layer_forward(layer, x, None) is None  # no plan: the module path
    print("FAILURES:", failures)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
