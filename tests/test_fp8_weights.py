"""FP8 weights kept as FP8 (layers/fp8.py), the CPU half: the layout's math and the loader's
sharding and merging (the forward runs on CUDA only: tests/test_fp8_cuda.py).

- `Fp8Weight` narrowing and concatenation are exact restatements of the dense weight, including
  cuts inside a 128-row scale block (the scales repeat per row) and per-tensor / per-channel forms;
  a cut off the 128-column activation groups is refused (`Fp8Unaligned`);
- tp = 2 with `keep_fp8`: each rank's FP8 weight times its scales equals that rank's shard of
  the dense oracle checkpoint (exactly), for 128x128 blocks, per-channel and per-tensor FP8; layers
  whose local in_features is not a multiple of 128 (o_proj here) are dequantized instead, and the
  48x80-block checkpoint is dequantized entirely;
- online `--quantization fp8`: per-row absmax / 448 scales, e4m3 codes; refused on the CPU.
"""

from __future__ import annotations

import pytest
import torch

from minisgl.layers.fp8 import FP8_E4M3, Fp8Unaligned, Fp8Weight, quantize_per_row

CPU = torch.device("cpu")


def _random_blocks(n: int, k: int, seed: int) -> Fp8Weight:
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=gen) * 100).clamp(-448, 448).to(FP8_E4M3)
    return Fp8Weight(w, torch.rand(-(-n // 128), k // 128, generator=gen) + 0.1, 128)


def test_narrow_and_cat_restate_the_dense_weight():
    a, b = _random_blocks(192, 256, 0), _random_blocks(128, 256, 1)
    for w in (a, b):
        dense = w.dense()
        for start, length in ((0, 128), (64, 64), (100, 28), (128, w.shape[0] - 128)):
            part = w.narrow(0, start, length)
            assert torch.equal(part.dense(), dense[start : start + length]), (start, length)
        assert torch.equal(w.narrow(1, 128, 128).dense(), dense[:, 128:])
        with pytest.raises(Fp8Unaligned, match="128-column groups"):
            w.narrow(1, 64, 128)
    # a first part of 192 rows ends inside a scale block: the merged scales go per row
    merged = Fp8Weight.cat([a, b])
    assert merged.block_n == 1 and torch.equal(merged.dense(), torch.cat([a.dense(), b.dense()]))
    aligned = Fp8Weight.cat([b, a])
    assert aligned.block_n == 128 and torch.equal(aligned.dense(), torch.cat([b.dense(), a.dense()]))
    # per-channel and per-tensor forms, and a per-channel part merged with a blocked one
    ch = Fp8Weight.from_blocks(a.weight, torch.rand(192), (1, 256))
    t = Fp8Weight.from_blocks(a.weight, torch.tensor(0.5), (192, 256))
    assert t.block_n == 1 and torch.equal(t.dense(), a.weight.float() * 0.5)
    mixed = Fp8Weight.cat([b, ch, t])
    assert torch.equal(mixed.dense(), torch.cat([b.dense(), ch.dense(), t.dense()]))
    with pytest.raises(Fp8Unaligned, match="48x80"):
        Fp8Weight.from_blocks(a.weight, torch.ones(4, 4), (48, 80))
    with pytest.raises(Fp8Unaligned, match="in_features 200"):
        Fp8Weight.from_blocks(torch.zeros(4, 200, dtype=FP8_E4M3), torch.ones(1, 2), (128, 128))


@pytest.mark.parametrize("name", ["fp8_block", "ct_fp8_channel", "fp8_tensor_static", "fp8_block_ragged"])
def test_tp2_fp8_shards_are_the_dense_checkpoints_shards(name, quant_checkpoint):
    from transformers import AutoConfig

    from minisgl.distributed import set_tp_info
    from minisgl.distributed.info import clear_tp_info
    from minisgl.layers.linear import _Linear
    from minisgl.layers.rotary import rope_tables
    from minisgl.models import ModelConfig, create_model
    from minisgl.models.weight import load_weights
    from minisgl.utils.torch_utils import torch_dtype

    ck = quant_checkpoint(name)
    cfg = ModelConfig.from_hf(AutoConfig.from_pretrained(ck.dense))
    try:
        for rank in range(2):
            set_tp_info(rank, 2)
            with rope_tables(CPU), torch.device("meta"), torch_dtype(torch.float32):
                model = create_model(cfg)
            ours = load_weights(model, str(ck.quantized), CPU, torch.float32, keep_fp8=True)
            ref = load_weights(model, str(ck.dense), CPU, torch.float32)
            assert ours.keys() == ref.keys()
            kept = 0
            for path, mod in model.named_modules():
                if not isinstance(mod, _Linear) or f"{path}.weight" not in ref:
                    continue
                key = f"{path}.weight"
                fp8_ok = name != "fp8_block_ragged" and ref[key].shape[1] % 128 == 0 and "lm_head" not in path
                if fp8_ok:
                    assert ours[key].dtype == FP8_E4M3 and mod.weight_scale is not None, f"rank {rank} {key} was not kept FP8"
                    got = Fp8Weight(ours[key], mod.weight_scale, mod.weight_block_n).dense()
                    kept += 1
                else:
                    assert ours[key].dtype == torch.float32 and mod.weight_scale is None, f"rank {rank} {key} should be dense"
                    got = ours[key]
                torch.testing.assert_close(got, ref[key], rtol=0, atol=1e-6, msg=f"rank {rank} {key}")
            for key in ref:
                if ours[key].dtype != FP8_E4M3:
                    torch.testing.assert_close(ours[key], ref[key], rtol=0, atol=1e-6, msg=f"rank {rank} {key}")
            assert kept > 0 or name == "fp8_block_ragged"
    finally:
        clear_tp_info()


def test_online_fp8_is_per_row_absmax_over_448():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(64, 256, generator=gen)
    q = quantize_per_row(w)
    assert q.weight.dtype == FP8_E4M3 and q.block_n == 1 and q.scale.shape == (64, 1)
    torch.testing.assert_close(q.scale, w.abs().amax(1, keepdim=True) / 448, rtol=1e-6, atol=0)
    assert torch.equal(q.weight.float(), (w / q.scale).clamp(-448, 448).to(FP8_E4M3).float())
    assert float(q.weight.float().abs().amax()) == 448.0  # each row's absmax lands on the top code


def test_online_fp8_is_refused_on_the_cpu(tiny_dir):
    from helpers import running_engine

    with pytest.raises(ValueError, match="quantization='fp8'.*needs a CUDA device"):
        with running_engine(tiny_dir, device="cpu", quantization="fp8"):
            pass


@pytest.mark.parametrize("name", ["fp8_block", "ct_fp8_channel", "fp8_tensor_static", "fp8_block_moe"])
def test_kept_fp8_weights_run_the_fp8_op(name, quant_checkpoint, monkeypatch):
    """The kept-FP8 path end to end on the CPU, the op's torch implementation standing in for the
    CUDA kernels (the same arithmetic, tests/test_fp8_kernels_interpret.py): every projection
    holds float8_e4m3fn weights and runs the FP8 op (activations quantized per 128 columns), and
    each greedy token is in HF float32's top 5 (on the dequantized weights, fed our tokens) until
    the first divergence from HF's argmax. Qwen3-MoE: the experts' FP8 tensors are dequantized
    (the MoE GEMM has no FP8 path), the router stays dense as in the checkpoint."""
    from helpers import HFOracle, allocated_reqs, run_generation, running_engine

    from minisgl.engine import engine as engine_mod
    from minisgl.layers import fp8
    from minisgl.layers.linear import _Linear

    ck = quant_checkpoint(name)
    calls = []
    op = fp8.fp8_linear
    monkeypatch.setattr(engine_mod, "keeps_fp8", lambda device, deterministic, quantization: True)
    monkeypatch.setattr(fp8, "fp8_linear", lambda x, *a: calls.append(x.shape[0]) or op(x, *a))
    prompts = [[3, 17, 99, 4, 250, 8, 61], [40, 2, 2, 180, 77, 5, 13, 90, 11]]
    steps = 6
    with running_engine(ck.quantized, device="cpu", cpu_fast_decode=False) as engine:
        mods = [m for n, m in engine.model.named_modules() if isinstance(m, _Linear) and not n.endswith("mlp.gate")]
        for m in mods:  # K not a multiple of 128 (the MoE model's o_proj, 4 heads of 16): dequantized
            kept = m.weight.shape[1] % 128 == 0
            assert (m.weight.dtype == FP8_E4M3) == kept and (m.weight_scale is not None) == kept
        mods = [m for m in mods if m.weight_scale is not None]
        assert mods
        others = [p for n, p in engine.model.named_parameters() if p.dtype == FP8_E4M3 and not any(m.weight is p for m in mods)]
        assert not others, "only linear layers keep FP8 weights"
        outs = run_generation(engine, allocated_reqs(engine, prompts, steps), steps)
    assert len(calls) >= len(mods) * steps, "the projections did not run the FP8 op"
    hf = HFOracle(ck.dense)
    for ids, out in zip(prompts, outs):
        ref = hf.logits(list(ids) + out[:-1])[len(ids) - 1 :]
        for j, tok in enumerate(out):
            assert tok in ref[j].topk(5).indices.tolist(), f"{name}: token {j} ({tok}) not in HF's top 5"
            if tok != int(ref[j].argmax()):
                break


def test_online_fp8_layers_run_the_fp8_op(quant_checkpoint):
    """`--quantization fp8`'s conversion (models/weight.quantize_linears_fp8) on a dense model, run
    on the CPU through the op's torch implementation: every linear layer per-row FP8, each greedy
    token in HF float32's top 5 until the first divergence (the CUDA run: tests/test_fp8_cuda.py)."""
    from helpers import HFOracle, allocated_reqs, run_generation, running_engine

    from minisgl.layers.linear import _Linear
    from minisgl.models.weight import quantize_linears_fp8

    ck = quant_checkpoint("fp8_block")
    prompts = [[3, 17, 99, 4, 250, 8, 61]]
    steps = 6
    with running_engine(ck.dense, device="cpu", cpu_fast_decode=False) as engine:
        done = quantize_linears_fp8(engine.model)
        mods = [m for m in engine.model.modules() if isinstance(m, _Linear)]
        assert len(done) == len(mods) and all(m.weight.dtype == FP8_E4M3 and m.weight_block_n == 1 for m in mods)
        outs = run_generation(engine, allocated_reqs(engine, prompts, steps), steps)
    hf = HFOracle(ck.dense)
    ref = hf.logits(prompts[0] + outs[0][:-1])[len(prompts[0]) - 1 :]
    for j, tok in enumerate(outs[0]):
        assert tok in ref[j].topk(5).indices.tolist(), f"token {j} ({tok}) not in HF's top 5"
        if tok != int(ref[j].argmax()):
            break
