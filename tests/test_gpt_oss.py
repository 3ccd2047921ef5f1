"""GPT-OSS (models/gpt_oss.py) on a tiny random checkpoint against Hugging Face (float32, eager
attention: HF's reference for sinks): prefill and decode logits, greedy tokens through `LLM`
(chunked prefill, 16-token pages, a warm radix cache), tp=2 against HF, an MXFP4 checkpoint of
the same experts, YaRN against transformers' rope init, the Triton attention kernels with sinks in
the interpreter against the torch reference, and the CUDA paths under MINISGL_TEST_DEVICE=cuda.

The model has 4 layers (sliding, full, sliding, full) with an 8-token window, prompts longer
than it; 4 experts, top-2. The sinks (zeros... in HF's init: `torch.empty`), biases and norms are
set to random values so every parameter changes the logits; the SwiGLU limit is lowered so the
clamp bites on the tiny model's activations.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch
from helpers import (
    LOGIT_ATOL,
    TEST_DEVICE,
    HFOracle,
    allocated_reqs,
    assert_greedy_match,
    assert_prefill_logits_match_hf,
    random_prompts,
    record_runners,
    running_engine,
    teacher_forced_logits,
)
from sched_helpers import running_llm

from minisgl.core import SamplingParams
from minisgl.models import ModelConfig
from minisgl.utils.hf import cached_load_hf_config

WINDOW = 8
CONFIG: Dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=WINDOW,
    max_position_embeddings=256,
    swiglu_limit=1.0,
    initializer_range=0.2,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 64,
    },  # fmt: skip
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)


def build_gpt_oss(out_dir: Path, seed: int, **extra: Any) -> Path:
    from transformers import AutoModelForCausalLM, GptOssConfig

    cfg = GptOssConfig(**{**CONFIG, **extra})
    cfg.architectures = ["GptOssForCausalLM"]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.copy_(torch.randn_like(p))
            elif "bias" in name or name.endswith(("gate_up_proj", "down_proj")):
                p.copy_(0.2 * torch.randn_like(p))
            elif "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
    model.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def oss_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_gpt_oss(tmp_path_factory.mktemp("gpt_oss"), seed=90)


@pytest.fixture(scope="module")
def oss_hf(oss_dir: Path) -> HFOracle:
    hf = HFOracle(oss_dir)
    hf.model.config._attn_implementation = "eager"
    return hf


def _prompts() -> List[List[int]]:
    return random_prompts([5, 13, 27, 40], seed=900)


def test_config(oss_dir):
    cfg = ModelConfig.from_hf(cached_load_hf_config(str(oss_dir)))
    assert cfg.layer_windows == (WINDOW, None, WINDOW, None) and cfg.context_cut_by_window is None
    assert cfg.attention_sinks and "attention_sinks" in cfg.attention_features()
    assert cfg.moe_features() == ["expert_bias", "clamped_swiglu"]
    assert cfg.num_experts == 4 and cfg.moe_intermediate_size == 32 and cfg.swiglu_limit == 1.0
    assert cfg.rotary_config.scaling is not None and cfg.rotary_config.scaling["rope_type"] == "yarn"


def test_config_in_the_transformers4_layout(tmp_path):
    """A config.json as the released checkpoints have it (rope_theta + rope_scaling, yarn with
    truncate false): the same windows, sinks and yarn parameters."""
    import json

    raw = {k: v for k, v in CONFIG.items() if k != "rope_parameters"}
    raw.update(architectures=["GptOssForCausalLM"], model_type="gpt_oss", rope_theta=150000.0, transformers_version="4.55.0",
               layer_types=["sliding_attention", "full_attention"] * 2,
               rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                             "original_max_position_embeddings": 4096})  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(raw))
    cfg = ModelConfig.from_hf(cached_load_hf_config(str(tmp_path)))
    assert cfg.layer_windows == (WINDOW, None, WINDOW, None) and cfg.attention_sinks
    scaling = cfg.rotary_config.scaling
    assert cfg.rotary_config.base == 150000.0 and scaling is not None
    assert (scaling["rope_type"], scaling["factor"], scaling["truncate"], scaling["original_max_position_embeddings"]) == (
        "yarn",
        32.0,
        False,
        4096,
    )


def test_prefill_logits_match_hf(oss_dir, oss_hf):
    assert_prefill_logits_match_hf(oss_dir, oss_hf, _prompts(), "gpt_oss")


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_decode_logits_match_hf(backend, oss_dir, oss_hf):
    """Decode steps fed HF's greedy tokens equal HF generate's step logits past the window (the
    CPU backend hands these layers to the torch code: sinks)."""
    prompts = _prompts()
    steps = 8
    refs = [oss_hf.greedy(ids, steps) for ids in prompts]
    with running_engine(oss_dir, page_size=4, attention_backend=backend) as engine:
        ours = teacher_forced_logits(engine, allocated_reqs(engine, prompts, steps), [t for t, _ in refs])
    for i, (_, ref_logits) in enumerate(refs):
        diff = (torch.stack([s[i] for s in ours]) - torch.stack(ref_logits)).abs().max().item()
        assert diff < LOGIT_ATOL, f"prompt {i}: max |decode logit diff| {diff:.3g}"


def test_every_parameter_matters(oss_dir, oss_hf):
    """Zeroing the sinks, the router bias or the experts' biases, or lifting the SwiGLU clamp,
    moves HF's logits well past the tolerance: the match above checks each of them."""
    model = oss_hf.model
    ids = _prompts()[2]
    base = oss_hf.logits(ids)
    layer = model.model.layers[1]
    for name, param in (("sinks", layer.self_attn.sinks), ("router bias", layer.mlp.router.bias),
                        ("gate_up bias", layer.mlp.experts.gate_up_proj_bias), ("down bias", layer.mlp.experts.down_proj_bias)):  # fmt: skip
        saved = param.data.clone()
        param.data.zero_()
        moved = (oss_hf.logits(ids) - base).abs().max().item()
        param.data.copy_(saved)
        assert moved > 100 * LOGIT_ATOL, f"{name}: {moved:.3g}"
    layer.mlp.experts.limit = 1e9
    moved = (oss_hf.logits(ids) - base).abs().max().item()
    layer.mlp.experts.limit = CONFIG["swiglu_limit"]
    assert moved > 100 * LOGIT_ATOL, f"swiglu limit: {moved:.3g}"


def test_llm_greedy_matches_hf(oss_dir, oss_hf):
    """Greedy tokens through the offline API (16-token prefill chunks, 16-token pages, the radix
    cache cold, then warm: each conversation continued, where the sliding layers still hold the
    window's K/V, kvcache/window.py) equal HF generate's, tie-aware; on a CPU every decode step
    ran on the module path."""
    prompts = random_prompts([3, 9, 20, 37], seed=910)
    max_tokens = 10
    kw = dict(page_size=16, max_extend_tokens=16, cache_type="radix", max_running_req=4, max_seq_len_override=128)
    with running_llm(oss_dir, **kw) as llm:
        log = record_runners(llm.scheduler.engine)
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        results = llm.generate(prompts, params)
        turns = [p + r.token_ids for p, r in zip(prompts, results)]
        results += llm.generate(turns, params)
    if TEST_DEVICE == "cpu":
        assert {cls for cls, phase in log if phase == "decode"} == {"ModuleRunner"}
    assert sum(r.cached_tokens for r in results[len(prompts) :]) >= 16, "the warm run hit no cache"
    compared = 0
    for i, res in enumerate(results):
        ref, ref_logits = oss_hf.greedy((prompts + turns)[i], max_tokens)
        compared += assert_greedy_match(res.token_ids, ref, ref_logits, label=f"prompt {i}")
    assert compared >= 0.8 * max_tokens * len(results)


@pytest.mark.skipif(TEST_DEVICE.startswith("cuda") and torch.cuda.device_count() < 2, reason="tp=2 on CUDA needs two GPUs")
def test_tp2_matches_hf(oss_dir, oss_hf):
    """tp=2 (2 of 4 query heads and their sinks, one KV head, half of each expert's intermediate
    dim per rank; the down bias added once after the all-reduce): HF's greedy tokens."""
    prompts = random_prompts([4, 19, 30], seed=920)
    max_tokens = 8
    kw = dict(max_running_req=4, page_size=4, max_seq_len_override=96, num_page_override=4 * 96 // 4 + 8)
    with running_llm(oss_dir, tp=2, **kw) as llm:
        out = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens))
        attn = llm.scheduler.engine.model.model.layers[0].self_attn
        assert attn.sinks.shape == (2,) and attn.qkv_proj.weight.shape[0] == (2 + 2) * 16
    for i, res in enumerate(out):
        ref, ref_logits = oss_hf.greedy(prompts[i], max_tokens)
        assert assert_greedy_match(res.token_ids, ref, ref_logits, label=f"tp2 prompt {i}") >= max_tokens // 2


@pytest.mark.skipif(TEST_DEVICE != "cpu", reason="the CPU step runners")
def test_cpu_bf16_decode_runs_the_module_path(oss_dir):
    """bf16 on a CPU: the C decode loop does not describe GPT-OSS's layers (its attention and MoE
    blocks are other classes), the CPU attention kernels decline the sink layers, and every decode
    step ran on ModuleRunner."""
    from minisgl.core import get_global_ctx
    from minisgl.engine.cpu_decode import _describe

    with running_llm(oss_dir, dtype="bfloat16", max_running_req=2, max_seq_len_override=64) as llm:
        engine = llm.scheduler.engine
        assert engine.cpu_runner is None
        backend = get_global_ctx().attn_backend
        why = _describe(engine.model, backend, 1)[1]
        assert why in ("layer 0 is DecoderLayer(GptOssAttention, GptOssMoe)", "the attention backend is not the CPU kernels'"), why
        if getattr(backend, "kernels", None) is not None:
            assert not backend.takes(engine.model.model.layers[1].self_attn.attn)  # a full layer, but with sinks
        log = record_runners(engine)
        llm.generate([random_prompts([20], seed=940)[0]], SamplingParams(temperature=0.0, max_tokens=4))
    assert {cls for cls, phase in log if phase == "decode"} == {"ModuleRunner"}


# ---- MXFP4 experts -----------------------------------------------------------------------------
FP4 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def mxfp4_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The OCP MX writer for [..., out, in] (in % 32 == 0): per 32 values an E8M0 exponent
    (floor(log2 amax) - 2: E2M1's largest magnitude is 1.5 * 2^2) and each value's nearest E2M1
    code, two per byte, the even column in the low nibble. Returns (blocks, scales, decoded)."""
    g = w.reshape(*w.shape[:-1], w.shape[-1] // 32, 32).double()
    amax = g.abs().amax(-1, keepdim=True).clamp(min=2.0**-100)
    exp = (torch.floor(torch.log2(amax)) - 2).clamp(-127, 127)
    x = g / torch.exp2(exp)
    mags = torch.tensor(FP4, dtype=torch.float64)
    idx = (x.abs()[..., None] - mags).abs().argmin(-1)  # nearest magnitude
    codes = idx + 8 * (x < 0).long()
    decoded = (mags[idx] * torch.where(x < 0, -1.0, 1.0) * torch.exp2(exp)).reshape(w.shape)
    pairs = codes.reshape(*codes.shape[:-1], 16, 2)
    blocks = (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)
    return blocks, (exp.squeeze(-1) + 127).to(torch.uint8), decoded.float()


@pytest.fixture(scope="module")
def mxfp4_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(an MXFP4 checkpoint of a tiny GPT-OSS with 64-wide experts, the same model in float32 with
    the experts' dequantized values: HF's reference)."""
    import json

    from safetensors.torch import load_file, save_file

    dense = build_gpt_oss(tmp_path_factory.mktemp("oss_dense"), seed=93, intermediate_size=64)
    quant = tmp_path_factory.mktemp("oss_mxfp4")
    state = load_file(str(dense / "model.safetensors"))
    out: Dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales, decoded = mxfp4_quantize(t.transpose(-1, -2).contiguous())  # stored [E, out, in]
            out[name + "_blocks"], out[name + "_scales"] = blocks, scales
            state[name] = decoded.transpose(-1, -2).contiguous()
        else:
            out[name] = t
    save_file(state, str(dense / "model.safetensors"), metadata={"format": "pt"})
    save_file(out, str(quant / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((dense / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "lm_head"]}
    (quant / "config.json").write_text(json.dumps(cfg))
    return quant, dense


def test_mxfp4_dequant_equals_transformers(mxfp4_dirs):
    """Our MXFP4 decode of the checkpoint's blocks equals transformers' own converter's."""
    from safetensors.torch import load_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from minisgl.models.checkpoint_quant import Mxfp4Blocks

    quant, dense = mxfp4_dirs
    q, d = load_file(str(quant / "model.safetensors")), load_file(str(dense / "model.safetensors"))
    for stem in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.3.mlp.experts.down_proj"):
        ours = Mxfp4Blocks(q[stem + "_blocks"], q[stem + "_scales"]).dense()
        theirs = convert_moe_packed_tensors(q[stem + "_blocks"], q[stem + "_scales"], dtype=torch.float32)
        assert torch.equal(ours, theirs.float()) and torch.equal(ours, d[stem])


def test_mxfp4_checkpoint_matches_hf_on_dequantized_weights(mxfp4_dirs):
    quant, dense = mxfp4_dirs
    hf = HFOracle(dense)
    hf.model.config._attn_implementation = "eager"
    assert_prefill_logits_match_hf(quant, hf, _prompts(), "gpt_oss mxfp4")


def test_mxfp4_tensors_without_a_quantization_config_are_refused(mxfp4_dirs, tmp_path):
    import json
    import shutil

    quant, _ = mxfp4_dirs
    shutil.copy(quant / "model.safetensors", tmp_path / "model.safetensors")
    cfg = json.loads((quant / "config.json").read_text())
    del cfg["quantization_config"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"_blocks \(torch.uint8\) is quantized but config.json has no quantization_config"):
        with running_engine(tmp_path):
            pass


# ---- YaRN, refusals ----------------------------------------------------------------------------
@pytest.mark.parametrize("truncate", [True, False])
@pytest.mark.parametrize("extra", [{}, {"attention_factor": 0.8}, {"mscale": 1.0, "mscale_all_dim": 0.5}])
def test_yarn_table_equals_transformers(truncate, extra):
    """cos/sin from layers/rotary.py equal transformers' yarn inv_freq and attention factor."""
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from minisgl.layers.rotary import RotaryConfig, RotaryEmbedding

    params = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
              "truncate": truncate, "original_max_position_embeddings": 4096, **extra}  # fmt: skip
    hf_cfg = GptOssConfig(head_dim=64, num_attention_heads=4, hidden_size=256, max_position_embeddings=131072, rope_parameters=params)
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg, "cpu")
    rope = RotaryEmbedding(RotaryConfig(64, 64, 4096, 150000.0, dict(params)))
    pos = torch.arange(4096, dtype=torch.float32)
    freqs = torch.outer(pos, inv_freq.float())
    assert torch.allclose(rope.cos[:, :32], freqs.cos() * factor, atol=1e-6)
    assert torch.allclose(rope.sin[:, 32:], freqs.sin() * factor, atol=1e-6)


def test_backends_without_sinks_refuse_by_name(oss_dir):
    """The deterministic attention backend (no sinks) is refused at init naming what it lacks;
    `auto` on CUDA never resolves to FlashInfer (no sinks) for this model."""
    from minisgl.attention.registry import resolve_attention_backend

    with pytest.raises(ValueError, match=r"does not implement attention_sinks \(GptOssForCausalLM\)"):
        with running_engine(oss_dir, attention_backend="deterministic"):
            pass
    cfg = ModelConfig.from_hf(cached_load_hf_config(str(oss_dir)))
    assert resolve_attention_backend("auto", torch.device("cuda"), cfg.attention_features()) in ("triton", "torch")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_moe_backend_choice_follows_the_expert_features(oss_dir, monkeypatch):
    """`auto` on CUDA takes the triton MoE (it computes the bias and the clamped SwiGLU); a
    backend without them is passed over by `auto` (for torch) and refused by name when asked for."""
    from minisgl.moe import triton_moe
    from minisgl.moe.registry import create_moe_backend

    features = ModelConfig.from_hf(cached_load_hf_config(str(oss_dir))).moe_features()
    cuda = torch.device("cuda")
    assert type(create_moe_backend("auto", cuda, features)).__name__ == "TritonMoeBackend"
    monkeypatch.setattr(triton_moe.TritonMoeBackend, "expert_features", ())
    assert type(create_moe_backend("auto", cuda, features)).__name__ == "TorchMoeBackend"
    with pytest.raises(ValueError, match=r"MoE backend 'triton' does not implement expert_bias, clamped_swiglu"):
        create_moe_backend("triton", cuda, features)


# ---- the Triton kernels, in Triton's interpreter -----------------------------------------------
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_sinks_in_interpreter() -> None:
    """tests/kernel_checks/gpt_oss.py: decode (split and direct) and extend with sinks against a
    dense float64 reference, the triton MoE with bias + clamped SwiGLU against the torch MoE, and
    an Engine on the triton attention and MoE backends against HF."""
    from kernel_checks import run_module

    proc = run_module("gpt_oss")
    assert proc.returncode == 0 and "gpt_oss kernels ok" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


# ---- CUDA (MINISGL_TEST_DEVICE=cuda) -----------------------------------------------------------
CUDA = pytest.mark.skipif(TEST_DEVICE != "cuda", reason="CUDA paths (MINISGL_TEST_DEVICE=cuda)")


@CUDA
def test_cuda_kernels_with_sinks_and_expert_bias():
    from kernel_checks import gpt_oss as G

    dev = torch.device("cuda")
    errors = G.check_kernels(dev) + G.check_moe(dev) + G.check_engine()
    assert not errors, errors


@CUDA
def test_cuda_graph_replay_equals_eager(oss_dir, oss_hf):
    """On CUDA (triton attention with sinks, triton MoE with the biases): decode steps replay CUDA
    graphs (GraphRunner, no fall-off to the module path), and their greedy tokens and logprobs
    equal the eager run's; both equal HF's tokens, tie-aware."""
    prompts = random_prompts([3, 9, 20, 37], seed=930)
    max_tokens = 10
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=2)
    kw = dict(page_size=16, max_extend_tokens=16, cache_type="radix", max_running_req=4, max_seq_len_override=128)
    runs: Dict[str, Any] = {}
    for path, extra in (("graphs", {}), ("eager", dict(cuda_graph_bs=[], cuda_graph_max_tokens=0))):
        with running_llm(oss_dir, **kw, **extra) as llm:
            engine = llm.scheduler.engine
            assert type(engine.moe_backend).__name__ == "TritonMoeBackend"
            assert type(engine.attn_backend).__name__ == "TritonAttnBackend"
            log = record_runners(engine)
            runs[path] = llm.generate(prompts, params)
        want = "GraphRunner" if path == "graphs" else "ModuleRunner"
        assert {cls for cls, phase in log if phase == "decode"} == {want}, (path, log)
    for a, b in zip(runs["graphs"], runs["eager"]):
        assert a.token_ids == b.token_ids
        assert (torch.tensor(a.logprobs) - torch.tensor(b.logprobs)).abs().max().item() < 1e-4
    for i, res in enumerate(runs["eager"]):
        ref, ref_logits = oss_hf.greedy(prompts[i], max_tokens)
        assert_greedy_match(res.token_ids, ref, ref_logits, label=f"cuda prompt {i}")
