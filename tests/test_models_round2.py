"""Mixtral, Qwen2-MoE, OLMo 2, Granite, SmolLM3 and GLM-4 (one file each in minisgl/models/) on
tiny random checkpoints against Hugging Face (float32): prefill and teacher-forced decode logits,
greedy tokens through `LLM` (chunked prefill, a warm prefix cache), which runner each CPU decode
step used (the C loop must decline what it does not compute), tp=2 against tp=1, and the options
we refuse by name.

Every parameter matters: HF inits norms to ones and biases to zero, so they are perturbed; the
config scalars (Granite's multipliers) are set away from 1; SmolLM3 has a NoPE layer among three.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any, Callable, Dict, Tuple

import pytest
import torch
from helpers import (
    LOGIT_ATOL,
    TEST_DEVICE,
    HFOracle,
    PageAllocator,
    allocated_reqs,
    assert_greedy_match,
    make_req,
    prefill_logits,
    random_prompts,
    record_runners,
    run_generation,
    running_engine,
    teacher_forced_logits,
    to_transformers4_layout,
)
from sched_helpers import running_llm

from minisgl.core import SamplingParams
from minisgl.models import ModelConfig, create_model
from minisgl.utils.hf import cached_load_hf_config

_COMMON: Dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=128,
    initializer_range=0.2,  # the default 0.02 makes a 3-layer model repeat one token
    tie_word_embeddings=False,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)

# name -> (HF model_type, config overrides)
ARCHS: Dict[str, Tuple[str, Dict[str, Any]]] = {
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": (
        "qwen2_moe",
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            shared_expert_intermediate_size=80,
            norm_topk_prob=False,
            mlp_only_layers=[1],  # layers 0 and 2 sparse, layer 1 dense
        ),
    ),
    "olmo2": ("olmo2", dict()),
    "granite": (
        "granite",
        dict(
            embedding_multiplier=3.0,
            residual_multiplier=0.6,
            attention_multiplier=0.11,
            logits_scaling=2.5,
            tie_word_embeddings=True,  # as Granite 3.x: the head reads the embedding, unmultiplied
        ),
    ),
    "smollm3": ("smollm3", dict(no_rope_layer_interval=2)),  # layer 1 is NoPE
    "glm4": ("glm4", dict(partial_rotary_factor=0.5, attention_bias=True)),
}
NAMES = list(ARCHS)


def build(name: str, out_dir: Path, seed: int, dtype: torch.dtype = torch.float32, **extra: Any) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, overrides = ARCHS[name]
    cfg = AutoConfig.for_model(model_type, **{**_COMMON, **overrides, **extra})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith(".bias"):  # zero-initialised: give them values that matter
                p.normal_(0.0, 0.5)
            elif "norm" in pname:  # ones: make a mis-loaded (or misplaced) norm visible
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    model.to(dtype).save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    return functools.cache(lambda name: build(name, tmp_path_factory.mktemp(name), seed=70 + NAMES.index(name)))


@pytest.fixture(scope="module")
def hf(model_dir: Callable[[str], Path]) -> Callable[[str], HFOracle]:
    return functools.cache(lambda name: HFOracle(model_dir(name)))


@pytest.mark.parametrize("name", NAMES)
def test_prefill_and_decode_logits_match_hf(name, model_dir, hf):
    """The module path: prefill logits of three prompts in one batch, then ten decode steps fed
    HF's greedy tokens, each within 1e-4 of HF's."""
    oracle = hf(name)
    prompts = random_prompts([5, 12, 27], seed=400 + NAMES.index(name))
    steps = 10
    refs = [oracle.greedy(ids, steps) for ids in prompts]
    with running_engine(model_dir(name), page_size=4) as engine:
        reqs = allocated_reqs(engine, prompts, steps)
        ours = teacher_forced_logits(engine, reqs, [tokens for tokens, _ in refs])
    for i, ids in enumerate(prompts):
        ref_prefill = oracle.logits(ids)[-1]
        assert ref_prefill.std() > 0.1  # informative logits, not ~constant
        diff = (ours[0][i] - ref_prefill).abs().max().item()
        assert diff < LOGIT_ATOL, f"{name} prompt {i}: max |prefill logit diff| {diff:.3g}"
        diff = (torch.stack([s[i] for s in ours]) - torch.stack(refs[i][1])).abs().max().item()
        assert diff < LOGIT_ATOL, f"{name} prompt {i}: max |decode logit diff| {diff:.3g}"


@pytest.mark.parametrize("name", NAMES)
def test_llm_greedy_matches_hf(name, model_dir, hf):
    """Greedy tokens through the offline API (16-token prefill chunks, the radix cache: a cold
    run, then a warm one that reuses the prompts' pages and a new prompt sharing the first 24
    tokens of one) equal HF generate's, tie-aware."""
    oracle = hf(name)
    prompts = random_prompts([3, 20, 30], seed=410 + NAMES.index(name))
    shares_prefix = prompts[2][:24] + random_prompts([9], seed=415)[0]
    max_tokens = 12
    kw = dict(page_size=4, max_extend_tokens=16, cache_type="radix", max_running_req=4, max_seq_len_override=128)
    with running_llm(model_dir(name), **kw) as llm:
        log = record_runners(llm.scheduler.engine)
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        results = llm.generate(prompts, params) + llm.generate(prompts + [shares_prefix], params)
    assert results[-1].cached_tokens >= 20, "the prompt sharing a prefix reused none of its pages"
    assert sum(1 for _, phase in log if phase == "prefill") > len(prompts), "no prompt was chunked"
    compared = 0
    for i, (res, ids) in enumerate(zip(results, prompts + prompts + [shares_prefix])):
        ref, ref_logits = oracle.greedy(ids, max_tokens)
        compared += assert_greedy_match(res.token_ids, ref, ref_logits, label=f"{name} prompt {i}")
    assert compared >= 0.8 * max_tokens * len(results)


# why the C decode loop (engine/cpu_decode.py `_describe`) declines each architecture
DECLINED_BECAUSE = {
    "mixtral": "layer 0 is DecoderLayer(SelfAttention, SparseMoeBlock)",
    "qwen2_moe": "layer 0 is DecoderLayer(SelfAttention, SharedExpertMoeBlock)",
    "olmo2": "layer 0 has options the loop does not compute",  # no pre-norms, post-norms, wide q/k norm
    "granite": "layer 0 has options the loop does not compute",  # residual_multiplier
    "smollm3": "layer 1's attention is not one the kernels take",  # NoPE
    "glm4": "layer 0 has options the loop does not compute",  # post-norms (and partial interleaved rotary)
}


# which layers' attention the CPU attention kernels take (full rotate-half rotary, default scale)
KERNELS_TAKE = {
    "mixtral": [True, True, True],
    "qwen2_moe": [True, True, True],
    "olmo2": [True, True, True],  # (its whole-projection q/k norm runs before, in SelfAttention)
    "granite": [False, False, False],  # attention_multiplier
    "smollm3": [True, False, True],  # layer 1 is NoPE
    "glm4": [False, False, False],  # partial, interleaved rotary
}


@pytest.mark.skipif(TEST_DEVICE != "cpu", reason="the CPU decode runners")
@pytest.mark.parametrize("name", NAMES)
def test_cpu_decode_runner_in_bf16(name, tmp_path):
    """bf16 on CPU, where the C decode loop would apply to Llama: each of these declines it for
    the reason its layers give (no silent fall-off, no silent wrong answer), its decode steps run
    on the module path (with the CPU attention kernels where they take the layer), and the bf16
    logits are about as close to HF float32 on the same weights as HF bf16's are (greedy tokens
    of these tiny models flip at bf16-sized near-ties, so they are no oracle here)."""
    from transformers import AutoModelForCausalLM

    from minisgl.core import get_global_ctx
    from minisgl.engine.cpu_decode import _describe
    from minisgl.kernel.cpu import cpu_kernels

    path = build(name, tmp_path / name, seed=90 + NAMES.index(name), dtype=torch.bfloat16)
    prompts = random_prompts([9, 21], seed=420)
    with running_engine(path, dtype=torch.bfloat16, page_size=4, max_seq_len=64) as engine:
        log = record_runners(engine)
        alloc = PageAllocator(engine)
        for row, ids in enumerate(prompts):
            alloc.allocate(row, len(ids) + 4)
        run_generation(engine, [make_req(ids, row, output_len=4) for row, ids in enumerate(prompts)], 4)
        assert engine.cpu_runner is None
        kern = cpu_kernels()
        if kern is not None and kern.has_gemv:  # the loop would be built for Llama here
            backend = get_global_ctx().attn_backend
            why = _describe(engine.model, backend, 1)[1]
            assert DECLINED_BECAUSE[name] in why, why
            takes = [backend.takes(layer.self_attn.attn) for layer in engine.model.model.layers]
            assert takes == KERNELS_TAKE[name]
        ours = prefill_logits(engine, [make_req(ids, row, output_len=1) for row, ids in enumerate(prompts)])
    assert {cls for cls, phase in log if phase == "decode"} == {"ModuleRunner"}
    # bf16 logits (the CPU attention kernels, bf16 GEMMs and norms) are about as close to HF
    # float32 on the same weights as HF's own bf16 forward is (within 2x: rounding orders differ,
    # the MoE's most; a misplaced norm or scale is off by whole logits)
    hf32, hf16 = (AutoModelForCausalLM.from_pretrained(str(path), dtype=dt).eval() for dt in (torch.float32, torch.bfloat16))
    for i, ids in enumerate(prompts):
        with torch.inference_mode():
            ref = hf32(input_ids=torch.tensor([ids])).logits[0, -1]
            hf_err = (hf16(input_ids=torch.tensor([ids])).logits[0, -1].float() - ref).abs().max().item()
        err = (ours[i] - ref).abs().max().item()
        assert err < 2 * hf_err + 0.02, f"{name} bf16 prompt {i}: max |logit - HF fp32| {err:.3g}, HF bf16's {hf_err:.3g}"


# ---- tensor parallelism -----------------------------------------------------------------------
@pytest.mark.skipif(TEST_DEVICE.startswith("cuda") and torch.cuda.device_count() < 2, reason="tp=2 on CUDA needs two GPUs")
@pytest.mark.parametrize("name", NAMES)
def test_tp2_equals_tp1(name, model_dir):
    """tp=2 (gloo on CPU) generates tp=1's greedy tokens with its logprobs: the experts and the
    shared expert sharded on their intermediate dim, OLMo 2's whole-projection q/k norm reduced
    over the ranks, GLM-4's fused gate_up split before sharding."""
    prompts = random_prompts([4, 19], seed=430)
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=2)
    kw = dict(max_running_req=2, page_size=4, max_seq_len_override=64)
    with running_llm(model_dir(name), **kw) as llm:
        ref = llm.generate(prompts, params)
    with running_llm(model_dir(name), tp=2, **kw) as llm:
        out = llm.generate(prompts, params)
    for a, b in zip(ref, out):
        assert a.token_ids == b.token_ids
        diff = (torch.tensor(a.logprobs) - torch.tensor(b.logprobs)).abs().max().item()
        assert diff < 1e-4, f"{name}: tp=2 logprobs differ from tp=1 by {diff:.3g}"


# ---- configs ----------------------------------------------------------------------------------
def _config(name: str, tmp_path: Path, **extra: Any) -> ModelConfig:
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type, overrides = ARCHS[name]
    cfg = AutoConfig.for_model(model_type, **{**_COMMON, **overrides, **extra})
    cfg.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]]
    cfg.save_pretrained(tmp_path)
    return ModelConfig.from_hf(cached_load_hf_config(str(tmp_path)))


def _build_on_meta(cfg: ModelConfig) -> Any:
    with torch.device("meta"):
        return create_model(cfg)


def test_configs_read_and_what_we_refuse_is_named(tmp_path):
    mixtral = _config("mixtral", tmp_path / "mixtral")
    assert (mixtral.num_experts, mixtral.moe_intermediate_size) == (4, 96) and mixtral.layer_is_moe(1)
    qwen2_moe = _config("qwen2_moe", tmp_path / "qwen2_moe", decoder_sparse_step=2, mlp_only_layers=[])
    assert [qwen2_moe.layer_is_moe(i) for i in range(3)] == [False, True, False]
    assert qwen2_moe.shared_expert_intermediate_size == 80
    granite = _config("granite", tmp_path / "granite")
    assert (granite.embedding_multiplier, granite.residual_multiplier) == (3.0, 0.6)
    assert (granite.attention_multiplier, granite.logits_scaling) == (0.11, 2.5)
    smol = _config("smollm3", tmp_path / "smol", num_hidden_layers=8, no_rope_layer_interval=4)
    assert smol.no_rope_layers == [3, 7]
    glm = _config("glm4", tmp_path / "glm")
    assert (glm.rotary_config.head_dim, glm.rotary_config.rotary_dim) == (16, 8)
    # GLM-4-0414's own config.json (transformers 4): rope_theta and partial_rotary_factor top-level
    _config("glm4", tmp_path / "glm_v4")
    to_transformers4_layout(tmp_path / "glm_v4", 10000.0, None)  # (GLM-4-0414's theta)
    v4 = json.loads((tmp_path / "glm_v4" / "config.json").read_text())
    (tmp_path / "glm_v4" / "config.json").write_text(json.dumps({**v4, "partial_rotary_factor": 0.5}))
    rc = ModelConfig.from_hf(cached_load_hf_config(str(tmp_path / "glm_v4"))).rotary_config
    assert (rc.rotary_dim, rc.base, rc.scaling) == (8, 10000.0, None)
    # options of these architectures we do not implement are refused by name
    with pytest.raises(ValueError, match="mlp_bias"):
        _build_on_meta(_config("granite", tmp_path / "granite_bias", mlp_bias=True))
    with pytest.raises(ValueError, match="unsupported rope scaling type 'dynamic'"):
        _build_on_meta(
            _config("smollm3", tmp_path / "smol_dyn", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4})
        )
    with pytest.raises(ValueError, match="longrope with an interleaved rotary layout"):
        scaling = {"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4, "original_max_position_embeddings": 32}
        _build_on_meta(_config("glm4", tmp_path / "glm_long", rope_parameters={**scaling, "rope_theta": 1e4, "partial_rotary_factor": 0.5}))
    # OLMo 2's whole-projection k norm is sharded with the KV heads: fewer KV heads than ranks
    # (each rank a replica) would normalise a replica by the wrong width
    from minisgl.distributed.info import clear_tp_info, set_tp_info, try_get_tp_info

    before = try_get_tp_info()
    set_tp_info(0, 2)
    try:
        with pytest.raises(ValueError, match=r"num_key_value_heads \(1\) divisible by tp \(2\)"):
            _build_on_meta(_config("olmo2", tmp_path / "olmo2_kv1", num_key_value_heads=1))
    finally:
        if before is None:
            clear_tp_info()
        else:
            set_tp_info(before.rank, before.size)
