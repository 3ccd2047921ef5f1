"""DeepSeek-V2 / V3 (models/deepseek.py: MLA over a latent KV pool, DeepSeek MoE) on tiny random
checkpoints against Hugging Face (float32, eager attention): prefill and decode logits, greedy
tokens through `LLM` (16-token chunks and pages, a warm radix cache; CPU decode on ModuleRunner),
tp=2, the pool's bytes per token, config parsing in both layouts and the refusals.

Three models, 3 layers each (layer 0 dense: first_k_dense_replace=1), 4 heads, kv_lora_rank 32,
nope/rope/v head dims 16/8/12 (all different, so a mixed-up split fails), 8 experts top-2, YaRN
rope with mscale_all_dim (the softmax scale correction bites):
- V2: q_lora_rank 24, group-limited greedy routing (2 groups, 1 kept), 2 shared experts;
- V2-Lite shape: no q_lora_rank (plain q_proj), greedy routing, 1 shared expert;
- V3: sigmoid scores with e_score_correction_bias (noaux_tc, 2 groups, 1 kept), norm_topk_prob,
  1 shared expert, rope_interleave.
Every norm is perturbed from HF's ones and the correction bias from its zeros;
`test_every_parameter_matters` shows that each routing option moves HF's logits.
"""

from __future__ import annotations

import importlib.util
import json
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
from minisgl.kvcache.pool import KVCachePool, model_kv_bytes_per_slot, quantize_int8_per_head
from minisgl.models import ModelConfig
from minisgl.utils.hf import cached_load_hf_config

COMMON: Dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    q_lora_rank=24,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    first_k_dense_replace=1,
    max_position_embeddings=256,
    initializer_range=0.2,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 0.8,
    },  # fmt: skip
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
VARIANTS: Dict[str, Dict[str, Any]] = {
    "v2": dict(topk_method="group_limited_greedy", n_group=2, topk_group=1, n_shared_experts=2, routed_scaling_factor=1.5),
    "v2_lite": dict(q_lora_rank=None, topk_method="greedy", n_shared_experts=1),
    "v3": dict(n_group=2, topk_group=1, n_shared_experts=1, norm_topk_prob=True, routed_scaling_factor=2.5),
}


def build_deepseek(name: str, out_dir: Path, seed: int) -> Path:
    from transformers import AutoModelForCausalLM, DeepseekV2Config, DeepseekV3Config

    v3 = name == "v3"
    cfg = (DeepseekV3Config if v3 else DeepseekV2Config)(**{**COMMON, **VARIANTS[name]})
    cfg.architectures = ["DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM"]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:  # HF initialises every norm to ones
                p.copy_(1 + 0.3 * torch.randn_like(p))
        for bname, b in model.named_buffers():
            if bname.endswith("e_score_correction_bias"):  # (zeros in HF's init)
                b.copy_(0.3 * torch.randn_like(b))
    model.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Path]:
    return {name: build_deepseek(name, tmp_path_factory.mktemp(f"deepseek_{name}"), seed=70 + i) for i, name in enumerate(VARIANTS)}


@pytest.fixture(scope="module")
def oracles(dirs: Dict[str, Path]) -> Dict[str, HFOracle]:
    out = {}
    for name, d in dirs.items():
        out[name] = HFOracle(d)
        out[name].model.config._attn_implementation = "eager"
    return out


def _prompts() -> List[List[int]]:
    return random_prompts([5, 13, 27, 40], seed=700)


def test_config(dirs):
    v2 = ModelConfig.from_hf(cached_load_hf_config(str(dirs["v2"])))
    mla, moe = v2.latent_attention, v2.deepseek_moe
    assert mla is not None and moe is not None
    assert (mla.kv_lora_rank, mla.q_lora_rank, mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim) == (32, 24, 16, 8, 12)
    assert (moe.scoring, moe.topk_method, moe.n_group, moe.topk_group, moe.n_shared_experts) == ("softmax", "group_limited_greedy", 2, 1, 2)
    assert v2.attention_features() == ["latent_attention"] and v2.num_experts == 8 and v2.is_moe
    assert [v2.layer_is_moe(i) for i in range(3)] == [False, True, True]
    assert v2.rotary_config.interleaved and v2.rotary_config.head_dim == 8
    # qk_head_dim^-0.5 * mscale(4, 0.8)^2 (transformers' yarn_apply_mscale)
    import math

    assert v2.attn_scale == pytest.approx(24**-0.5 * (0.1 * 0.8 * math.log(4.0) + 1) ** 2, rel=1e-12)
    v3 = ModelConfig.from_hf(cached_load_hf_config(str(dirs["v3"])))
    assert v3.deepseek_moe is not None and (v3.deepseek_moe.scoring, v3.deepseek_moe.topk_method) == ("sigmoid", "noaux_tc")
    assert v3.norm_topk_prob and v3.deepseek_moe.routed_scaling_factor == 2.5
    lite = ModelConfig.from_hf(cached_load_hf_config(str(dirs["v2_lite"])))
    assert lite.latent_attention is not None and lite.latent_attention.q_lora_rank is None


V2_LITE = Path(__file__).resolve().parents[1] / "benchmark" / "models" / "deepseek-v2-lite"
# DeepSeek-V3's shape (its released config.json, transformers-4 layout, the fields that matter here)
V3_RAW: Dict[str, Any] = dict(
    architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", hidden_size=7168, intermediate_size=18432,
    moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1,
    n_routed_experts=256, num_experts_per_tok=8, first_k_dense_replace=3, moe_layer_freq=1, kv_lora_rank=512, q_lora_rank=1536,
    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, topk_method="noaux_tc", n_group=8, topk_group=4,
    scoring_func="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5, num_nextn_predict_layers=1, vocab_size=129280,
    max_position_embeddings=163840, rms_norm_eps=1e-6, rope_theta=10000,
    rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
                  "mscale": 1.0, "mscale_all_dim": 1.0},
    tie_word_embeddings=False, hidden_act="silu", bos_token_id=0, eos_token_id=1, torch_dtype="bfloat16",
)  # fmt: skip


def _raw_config(tmp_path: Path, raw: Dict[str, Any]) -> ModelConfig:
    folder = tmp_path / f"config{len(list(tmp_path.iterdir()))}"  # (configs are cached by folder)
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(raw))
    return ModelConfig.from_hf(cached_load_hf_config(str(folder)))


def test_config_in_the_transformers4_layout(tmp_path):
    """The released checkpoints' config.json (rope_theta + rope_scaling type yarn, n_routed_experts,
    scoring_func, topk_method): DeepSeek-V2-Lite (benchmark/models/) and DeepSeek-V3."""
    import math

    lite = ModelConfig.from_hf(cached_load_hf_config(str(V2_LITE)))
    assert lite.latent_attention is not None and lite.latent_attention.q_lora_rank is None
    assert lite.num_experts == 64 and lite.num_experts_per_tok == 6 and lite.deepseek_moe is not None
    assert lite.deepseek_moe.topk_method == "greedy" and lite.deepseek_moe.n_shared_experts == 2
    scaling = lite.rotary_config.scaling
    assert scaling is not None and scaling["original_max_position_embeddings"] == 4096 and lite.rotary_config.base == 10000.0
    assert lite.attn_scale == pytest.approx(192**-0.5 * (0.1 * 0.707 * math.log(40) + 1) ** 2, rel=1e-12)
    v3 = _raw_config(tmp_path, V3_RAW)
    assert v3.deepseek_moe is not None and (v3.deepseek_moe.topk_method, v3.deepseek_moe.n_group, v3.deepseek_moe.topk_group) == (
        "noaux_tc",
        8,
        4,
    )
    assert [v3.layer_is_moe(i) for i in (0, 2, 3, 60)] == [False, False, True, True]
    assert v3.rotary_config.interleaved  # (rope_interleave defaults to true)


def test_kv_pool_holds_the_latent(tmp_path, dirs):
    """The pool's bytes per token are (kv_lora_rank + qk_rope_head_dim) * dtype bytes per layer:
    one latent row, no V buffer (V is K's first kv_lora_rank values); against the full K/V of the
    same heads (H * (qk_head_dim + v_head_dim) per layer) that is 8.9x less for DeepSeek-V2-Lite
    and 71x less for DeepSeek-V3 (docs/MODELS.md)."""
    bf16 = torch.bfloat16
    for cfg, layers, heads in (
        (ModelConfig.from_hf(cached_load_hf_config(str(V2_LITE))), 27, 16),
        (_raw_config(tmp_path, V3_RAW), 61, 128),
    ):
        latent = model_kv_bytes_per_slot(cfg, "auto", bf16, tp_size=1)
        assert latent == layers * (512 + 64) * 2
        assert model_kv_bytes_per_slot(cfg, "auto", bf16, tp_size=8) == latent  # replicated, not split by heads
        assert model_kv_bytes_per_slot(cfg, "int8", bf16, tp_size=1) == layers * (576 + 4)  # codes + one fp32 scale
        full = layers * heads * (192 + 128) * 2
        assert (layers, round(full / latent, 1)) in ((27, 8.9), (61, 71.1))
    with running_engine(dirs["v3"], page_size=4) as engine:
        pool = engine.kv_cache
        assert pool.latent and tuple(pool.buffer.shape) == (1, 3, pool.num_slots, 1, 32 + 8)
        assert pool.nbytes == pool.num_slots * model_kv_bytes_per_slot(engine.model.config, "auto", torch.float32, 1)
        assert pool.v_cache(0).data_ptr() == pool.k_cache(0).data_ptr() and pool.v_cache(0).shape[-1] == 32


def test_latent_pool_int8_roundtrip():
    """An int8 latent pool (CPU) stores one code row and one scale per token (the latent and the
    rotary key together) and reads V as the dequantized K's first v_dim values."""
    pool = KVCachePool(2, 16, 1, 40, torch.device("cpu"), torch.float32, kv_cache_dtype="int8", v_dim=32)
    latent = torch.randn(5, 1, 40)
    slots = torch.tensor([3, 7, 0, 15, 9])
    pool.store_kv(latent, None, slots, layer_id=1)
    codes, scales = quantize_int8_per_head(latent)
    k, v = pool.gather(1, slots, torch.float32)
    assert torch.equal(k, codes.float() * scales.unsqueeze(-1)) and torch.equal(v, k[..., :32])
    with pytest.raises(ValueError, match="latent KV pool stores K alone"):
        pool.store_kv(latent, latent, slots, layer_id=0)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_prefill_logits_match_hf(name, dirs, oracles):
    assert_prefill_logits_match_hf(dirs[name], oracles[name], _prompts(), f"deepseek {name}")


@pytest.mark.parametrize("name,backend", [("v2", "auto"), ("v2_lite", "auto"), ("v3", "auto"), ("v3", "cpu")])
def test_decode_logits_match_hf(name, backend, dirs, oracles):
    """Decode steps fed HF's greedy tokens equal HF generate's step logits (4-token pages; `cpu`:
    its C kernels have no MLA, so the torch code it derives from runs these layers)."""
    prompts = _prompts()
    steps = 6
    hf = oracles[name]
    refs = [hf.greedy(ids, steps) for ids in prompts]
    with running_engine(dirs[name], page_size=4, attention_backend=backend) as engine:
        assert engine.config.attention_backend == ("torch" if backend == "auto" else backend)
        ours = teacher_forced_logits(engine, allocated_reqs(engine, prompts, steps), [t for t, _ in refs])
    for i, (_, ref_logits) in enumerate(refs):
        diff = (torch.stack([s[i] for s in ours]) - torch.stack(ref_logits)).abs().max().item()
        assert diff < LOGIT_ATOL, f"{name} prompt {i}: max |decode logit diff| {diff:.3g}"


def test_every_parameter_matters(oracles):
    """The correction bias, the group limit, the routed scaling factor and the latent norms each
    move HF's logits well past the tolerance: the matches above check every one of them."""
    ids = _prompts()[2]
    v3, v2 = oracles["v3"], oracles["v2"]

    def moved(hf: HFOracle, change: Any, undo: Any) -> float:
        base = hf.logits(ids)
        change()
        out = (hf.logits(ids) - base).abs().max().item()
        undo()
        return out

    gate, attn = v3.model.model.layers[1].mlp.gate, v3.model.model.layers[2].self_attn
    saved = gate.e_score_correction_bias.clone()
    assert moved(v3, lambda: gate.e_score_correction_bias.zero_(), lambda: gate.e_score_correction_bias.copy_(saved)) > 100 * LOGIT_ATOL
    for norm in (attn.kv_a_layernorm, attn.q_a_layernorm):
        w = norm.weight.data.clone()
        assert moved(v3, lambda n=norm: n.weight.data.fill_(1.0), lambda n=norm, w=w: n.weight.data.copy_(w)) > 100 * LOGIT_ATOL
    gates = [layer.mlp.gate for layer in v2.model.model.layers[1:]]
    assert (
        moved(v2, lambda: [setattr(g, "topk_group", 2) for g in gates], lambda: [setattr(g, "topk_group", 1) for g in gates])
        > 100 * LOGIT_ATOL
    )
    assert moved(v2, lambda: [setattr(g, "routed_scaling_factor", 1.0) for g in gates],
                 lambda: [setattr(g, "routed_scaling_factor", 1.5) for g in gates]) > 100 * LOGIT_ATOL  # fmt: skip


@pytest.mark.parametrize("name", ["v2", "v3"])
def test_llm_greedy_matches_hf(name, dirs, oracles):
    """Greedy tokens through the offline API (16-token prefill chunks, 16-token pages, the radix
    cache cold then warm) equal HF generate's, tie-aware; on a CPU every decode step ran on the
    module path (the C decode loop does not describe MLA layers), on CUDA on the decode graphs."""
    prompts = random_prompts([3, 9, 20, 37], seed=710)
    max_tokens = 10
    kw = dict(page_size=16, max_extend_tokens=16, cache_type="radix", max_running_req=4, max_seq_len_override=128)
    with running_llm(dirs[name], **kw) as llm:
        engine = llm.scheduler.engine
        assert engine.config.attention_backend == "torch" and engine.kv_cache.latent
        log = record_runners(engine)
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        results = llm.generate(prompts, params) + llm.generate(prompts, params)
    assert {cls for cls, phase in log if phase == "decode"} == {"GraphRunner" if TEST_DEVICE == "cuda" else "ModuleRunner"}
    assert sum(r.cached_tokens for r in results[len(prompts) :]) >= 16, "the warm run hit no cache"
    compared = 0
    for i, res in enumerate(results):
        ref, ref_logits = oracles[name].greedy(prompts[i % len(prompts)], max_tokens)
        compared += assert_greedy_match(res.token_ids, ref, ref_logits, label=f"{name} prompt {i}")
    assert compared >= 0.8 * max_tokens * len(results)


@pytest.mark.skipif(TEST_DEVICE.startswith("cuda") and torch.cuda.device_count() < 2, reason="tp=2 on CUDA needs two GPUs")
def test_tp2_matches_hf(dirs, oracles):
    """tp=2: 2 of 4 heads per rank (q_b_proj and kv_b_proj rows, o_proj columns), the latent
    projection and pool replicated, experts and the shared MLP split on their intermediate dim:
    HF's greedy tokens."""
    prompts = random_prompts([4, 19, 30], seed=720)
    max_tokens = 8
    kw = dict(max_running_req=4, page_size=4, max_seq_len_override=96, num_page_override=4 * 96 // 4 + 8)
    with running_llm(dirs["v2"], tp=2, **kw) as llm:
        out = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens))
        attn = llm.scheduler.engine.model.model.layers[1].self_attn
        assert attn.q_b_proj.weight.shape == (2 * 24, 24) and attn.kv_b_proj.weight.shape == (2 * (16 + 12), 32)
        assert attn.kv_a_proj_with_mqa.weight.shape == (32 + 8, 64) and llm.scheduler.engine.kv_cache.buffer.shape[-2:] == (1, 40)
    for i, res in enumerate(out):
        ref, ref_logits = oracles["v2"].greedy(prompts[i], max_tokens)
        assert assert_greedy_match(res.token_ids, ref, ref_logits, label=f"tp2 prompt {i}") >= max_tokens // 2


@pytest.mark.skipif(TEST_DEVICE != "cpu", reason="the CPU step runners and the int8 pool")
@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_cpu_bf16_runs_the_module_path(kv, dirs, oracles):
    """bf16 on a CPU, with the model-dtype and the int8 latent pool: the C decode loop does not
    describe MLA layers and every decode step ran on ModuleRunner. Fed our own tokens, each greedy
    token is in HF float32's top 5 (bf16 pool); over int8 the first is (the int8 pool's exact
    arithmetic is test_latent_pool_int8_roundtrip: its noise flips this tiny model's routing later)."""
    from minisgl.core import get_global_ctx
    from minisgl.engine.cpu_decode import _describe

    prompt = random_prompts([21], seed=740)[0]
    with running_llm(dirs["v3"], dtype="bfloat16", kv_cache_dtype=kv, max_running_req=2, max_seq_len_override=64) as llm:
        engine = llm.scheduler.engine
        assert engine.cpu_runner is None and engine.kv_cache.latent and (engine.kv_cache.scales is not None) == (kv == "int8")
        gate = engine.model.model.layers[1].mlp.gate  # the router stays float32, as transformers keeps it
        assert gate.weight.dtype == gate.e_score_correction_bias.dtype == torch.float32
        assert engine.model.model.layers[1].mlp.experts.w13.dtype == torch.bfloat16
        why = _describe(engine.model, get_global_ctx().attn_backend, 1)[1]
        assert why in ("layer 0 is DecoderLayer(LatentAttention, GatedMLP)", "the attention backend is not the CPU kernels'"), why
        log = record_runners(engine)
        out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6))[0].token_ids
    assert {cls for cls, phase in log if phase == "decode"} == {"ModuleRunner"}
    ids = list(prompt)
    for t in out if kv == "auto" else out[:1]:
        assert t in oracles["v3"].logits(ids)[-1].topk(5).indices.tolist()
        ids.append(t)


def test_dummy_weights_start(dirs):
    """`--load-format dummy` (the benchmark's configs): every parameter, the kv_b_proj rows and the
    router's correction bias included, gets a value and a step runs."""
    with running_llm(dirs["v2_lite"], use_dummy_weight=True, max_running_req=2, max_seq_len_override=64) as llm:
        out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=2))
    assert len(out[0].token_ids) == 2


def test_fp8_block_checkpoint_matches_hf_on_dequantized_weights(dirs, tmp_path):
    """A V3 checkpoint in DeepSeek-V3's own FP8 layout (quant_method fp8, 128x128 blocks,
    weight_scale_inv) on every projection, kv_b_proj and the experts included: dequantized at load
    (kv_b_proj is no linear layer: it is never kept in FP8), prefill logits equal HF's on the
    dequantized weights."""
    from quant_helpers import fp8_block_layer
    from safetensors.torch import load_file, save_file

    state = load_file(str(dirs["v3"] / "model.safetensors"))
    quant: Dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if name.endswith(("proj.weight", "proj_with_mqa.weight")):
            q = fp8_block_layer(t.float(), (128, 128))
            quant.update({f"{name.removesuffix('.weight')}.{k}": v for k, v in q.tensors.items()})
            state[name] = q.dense
        else:
            quant[name] = t
    for folder, tensors in (("dense", state), ("fp8", quant)):
        (tmp_path / folder).mkdir()
        save_file(tensors, str(tmp_path / folder / "model.safetensors"), metadata={"format": "pt"})
        cfg = json.loads((dirs["v3"] / "config.json").read_text())
        if folder == "fp8":
            cfg["quantization_config"] = {
                "quant_method": "fp8",
                "fmt": "e4m3",
                "activation_scheme": "dynamic",
                "weight_block_size": [128, 128],
            }
        (tmp_path / folder / "config.json").write_text(json.dumps(cfg))
    hf = HFOracle(tmp_path / "dense")
    hf.model.config._attn_implementation = "eager"
    assert_prefill_logits_match_hf(tmp_path / "fp8", hf, _prompts()[:2], "deepseek v3 fp8 blocks")


def test_mtp_layers_are_skipped(dirs, oracles, tmp_path):
    """A V3 checkpoint with its multi-token-prediction layer (stored as layer num_hidden_layers)
    loads without it and computes the same logits."""
    import shutil

    from safetensors.torch import load_file, save_file

    src = dirs["v3"]
    state = load_file(str(src / "model.safetensors"))
    state["model.layers.3.eh_proj.weight"] = torch.randn(64, 128)
    state["model.layers.3.self_attn.kv_b_proj.weight"] = torch.randn(112, 32)
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(src / "config.json", tmp_path / "config.json")
    assert_prefill_logits_match_hf(tmp_path, oracles["v3"], _prompts()[:2], "deepseek v3 + mtp weights")


def test_backends_without_latent_attention_refuse_by_name(dirs, tmp_path):
    """The deterministic backend is refused at init naming latent_attention; `auto` resolves to
    torch on every device (Triton and FlashInfer have no MLA kernel); unsupported routing options
    are refused naming the field."""
    from minisgl.attention.registry import resolve_attention_backend

    with pytest.raises(ValueError, match=r"does not implement latent_attention \(DeepseekV3ForCausalLM\)"):
        with running_engine(dirs["v3"], attention_backend="deterministic"):
            pass
    features = ModelConfig.from_hf(cached_load_hf_config(str(dirs["v3"]))).attention_features()
    for device in ("cuda", "cpu"):
        assert resolve_attention_backend("auto", torch.device(device), features) == "torch"
    try:
        from minisgl.attention.triton_backend import TritonAttnBackend
    except ImportError:
        pass
    else:
        assert "latent_attention" not in TritonAttnBackend.attention_features
    base = json.loads((dirs["v2"] / "config.json").read_text())
    for field, value, arch in (("norm_topk_prob", True, "V2"), ("topk_method", "noaux_tc", "V2"),
                               ("scoring_func", "sigmoid", "V2"), ("topk_method", "greedy", "V3")):  # fmt: skip
        raw = {**base, field: value}
        if arch == "V3":
            raw.update(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3")
        with pytest.raises(ValueError, match=field):
            _raw_config(tmp_path, raw)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_mla_decode_kernel_in_interpreter() -> None:
    """tests/kernel_checks/mla.py: the Triton MLA decode kernel (split-K over the latent pool,
    several head blocks, empty chunks; a model-dtype and an fp8 pool) against a dense float64
    reference."""
    from kernel_checks import run_module

    proc = run_module("mla")
    assert proc.returncode == 0 and "mla kernels ok" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_mla_decode_kernel_compiles_for_sm90() -> None:
    """The kernel at DeepSeek's latent (512 + 64, 16-head blocks) compiled for sm_90 with the tiles
    mla_decode launches (bf16 over bf16 and fp8 pools, fp32): bf16 tensor-core dots, within the
    H200's shared memory, no spills."""
    from kernel_checks import run_module

    proc = run_module("sm90", "mla", interpret=False)
    assert proc.returncode == 0 and "FAILURES: []" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("spills 0") == 3, proc.stdout[-2000:]


# ---- CUDA (MINISGL_TEST_DEVICE=cuda) -----------------------------------------------------------
CUDA = pytest.mark.skipif(TEST_DEVICE != "cuda", reason="CUDA paths (MINISGL_TEST_DEVICE=cuda)")


@CUDA
def test_cuda_mla_decode_kernel():
    """The MLA decode kernel on the GPU against the float64 reference, float32 and bf16."""
    from kernel_checks import mla

    errors = mla.check_kernels(torch.device("cuda"), (torch.float32, torch.bfloat16))
    assert not errors, errors


@CUDA
@pytest.mark.parametrize("name", ["v2", "v3"])
def test_cuda_graph_replay_equals_eager(name, dirs, oracles):
    """On CUDA (the torch backend's latent decode through the MLA kernel, the triton MoE): decode
    steps replay CUDA graphs (GraphRunner, no fall-off to the module path), and their greedy
    tokens and logprobs equal the eager run's; both equal HF's tokens, tie-aware."""
    from minisgl.attention.base import AttnCap

    prompts = random_prompts([3, 9, 20, 37], seed=750)
    max_tokens = 10
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=2)
    kw = dict(page_size=16, max_extend_tokens=16, cache_type="radix", max_running_req=4, max_seq_len_override=128)
    runs: Dict[str, Any] = {}
    for path, extra in (("graphs", {}), ("eager", dict(cuda_graph_bs=[], cuda_graph_max_tokens=0))):
        with running_llm(dirs[name], **kw, **extra) as llm:
            engine = llm.scheduler.engine
            assert type(engine.moe_backend).__name__ == "TritonMoeBackend"
            assert type(engine.attn_backend).__name__ == "TorchAttnBackend" and AttnCap.DECODE_GRAPH in engine.attn_backend.caps
            log = record_runners(engine)
            runs[path] = llm.generate(prompts, params)
        want = "GraphRunner" if path == "graphs" else "ModuleRunner"
        assert {cls for cls, phase in log if phase == "decode"} == {want}, (path, log)
    for a, b in zip(runs["graphs"], runs["eager"]):
        assert a.token_ids == b.token_ids
        assert (torch.tensor(a.logprobs) - torch.tensor(b.logprobs)).abs().max().item() < 1e-4
    for i, res in enumerate(runs["eager"]):
        ref, ref_logits = oracles[name].greedy(prompts[i], max_tokens)
        assert_greedy_match(res.token_ids, ref, ref_logits, label=f"cuda {name} prompt {i}")


@CUDA
@pytest.mark.parametrize("name,kv", [("v2", "auto"), ("v3", "auto"), ("v3", "fp8_e4m3")])
def test_cuda_bf16_decode_takes_the_mla_kernel(name, kv, dirs, oracles, monkeypatch):
    """bf16 on CUDA, eager, over a bf16 and an fp8 latent pool: every layer of every decode step
    ran the Triton MLA kernel (no fall-off to the gather + SDPA), and each greedy token is in HF
    float32's top 5 (fed our tokens; over fp8 the first: its rounding flips this tiny model's
    routing later, as int8's on the CPU)."""
    from minisgl.kernel import triton_mla

    calls: List[int] = []
    kernel = triton_mla.mla_decode
    monkeypatch.setattr(triton_mla, "mla_decode", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    prompts = random_prompts([7, 30], seed=730)
    kw = dict(dtype="bfloat16", kv_cache_dtype=kv, page_size=16, max_running_req=2, max_seq_len_override=96, cuda_graph_bs=[],
              cuda_graph_max_tokens=0)  # fmt: skip
    with running_llm(dirs[name], **kw) as llm:
        log = record_runners(llm.scheduler.engine)
        out = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8))
    decode_steps = sum(1 for _, phase in log if phase == "decode")
    assert {cls for cls, phase in log if phase == "decode"} == {"ModuleRunner"}
    assert decode_steps > 0 and len(calls) == decode_steps * 3  # every layer of every decode step
    for i, res in enumerate(out):
        ids = list(prompts[i])
        for t in res.token_ids[: 4 if kv == "auto" else 1]:
            top = oracles[name].logits(ids)[-1].topk(5).indices.tolist()
            assert t in top, f"{name} prompt {i}: token {t} not in HF's top 5 {top}"
            ids.append(t)
