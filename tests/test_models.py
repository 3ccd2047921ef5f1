"""Every supported architecture, as a tiny random checkpoint, against Hugging Face (float32):
prefill logits, teacher-forced decode logits, greedy generation through Engine.forward_batch
(page_size 1 and 4), and prefill on top of a prefix whose KV is already in the pool."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import (
    LLAMA3_ROPE_SCALING,
    LLAMA_V4_ROPE_THETA,
    LOGIT_ATOL,
    TINY_ARCHS,
    HFOracle,
    PageAllocator,
    allocated_reqs,
    assert_greedy_match,
    assert_prefill_logits_match_hf,
    make_req,
    prefill_logits,
    random_prompts,
    run_generation,
    running_engine,
    teacher_forced_logits,
    to_transformers4_layout,
)

from minisgl.models import ModelConfig
from minisgl.utils.hf import cached_load_hf_config

ARCHS = list(TINY_ARCHS)
LENGTHS = [5, 12, 27]  # prompts of different lengths in one batch
NEW_TOKENS = 16


def _prompts(arch: str):
    return random_prompts(LENGTHS, seed=ARCHS.index(arch) + 100)


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_logits_match_hf(arch, tiny_model_dir, hf_oracle):
    hf = hf_oracle(arch)
    prompts = _prompts(arch)
    assert_prefill_logits_match_hf(tiny_model_dir(arch), hf, prompts, arch)


@pytest.mark.parametrize("arch", ARCHS)
def test_decode_logits_match_hf(arch, tiny_model_dir, hf_oracle):
    """Decode steps fed HF's own greedy tokens: every step's logits equal HF's full-sequence
    logits at that position (checks decode attention over the paged pool, independent of ties)."""
    hf = hf_oracle(arch)
    prompts = _prompts(arch)
    conts = [hf.greedy(ids, 8)[0] for ids in prompts]
    with running_engine(tiny_model_dir(arch), page_size=4) as engine:
        reqs = allocated_reqs(engine, prompts, 8)
        steps = teacher_forced_logits(engine, reqs, conts)
    for i, (ids, cont) in enumerate(zip(prompts, conts)):
        ref = hf.logits(ids + cont)[len(ids) - 1 : len(ids) - 1 + len(cont)]
        ours = torch.stack([s[i] for s in steps])
        diff = (ours - ref).abs().max().item()
        assert diff < LOGIT_ATOL, f"{arch} prompt {i}: max |decode logit diff| {diff:.3g}"


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_generation_matches_hf(arch, page_size, tiny_model_dir, hf_oracle):
    hf = hf_oracle(arch)
    prompts = _prompts(arch)
    with running_engine(tiny_model_dir(arch), page_size=page_size) as engine:
        alloc = PageAllocator(engine, seed=page_size)
        reqs = []
        for row, ids in enumerate(prompts):
            alloc.allocate(row, len(ids) + NEW_TOKENS)
            reqs.append(make_req(ids, row, output_len=NEW_TOKENS))
        outs = run_generation(engine, reqs, NEW_TOKENS)
    compared = 0
    for i, (ids, ours) in enumerate(zip(prompts, outs)):
        ref, ref_logits = hf.greedy(ids, NEW_TOKENS)
        assert len(ref) == NEW_TOKENS
        compared += assert_greedy_match(ours, ref, ref_logits, label=f"{arch} ps={page_size} prompt {i}")
    assert compared >= 0.8 * NEW_TOKENS * len(prompts), "too many ties: the comparison proves little"
    # the tiny model must depend on its prompt, or equal outputs would prove little
    assert len({tuple(o) for o in outs}) == len(outs)
    assert len({t for o in outs for t in o}) >= 8


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("arch", ARCHS)
def test_cached_prefix_matches_hf(arch, page_size, tiny_model_dir, hf_oracle):
    """A first request runs (prefill + decode) and leaves its KV in the pool. A second batch then
    holds requests whose first N tokens point at that KV (cached_len = N, whole pages shared
    through the page table; one prefix includes tokens the first request generated), next to a
    fresh request. Only the uncached tokens are fed; generation must still equal HF's."""
    hf = hf_oracle(arch)
    first_prompt, fresh, suffix1, suffix2 = random_prompts([13, 9, 7, 5], seed=ARCHS.index(arch) + 200)
    with running_engine(tiny_model_dir(arch), page_size=page_size) as engine:
        alloc = PageAllocator(engine, seed=10 + page_size)
        alloc.allocate(0, len(first_prompt) + 8)
        first = make_req(first_prompt, 0, output_len=8)
        first_out = run_generation(engine, [first], 8)[0]
        # KV exists for every token but the last sampled one
        have_kv = first.input_ids[: first.device_len - 1].tolist()
        assert len(have_kv) == len(first_prompt) + 7

        n1 = 16 if page_size > 1 else 17  # past the prompt: includes generated tokens' KV
        n2 = 8 if page_size > 1 else 7  # inside the prompt
        specs = [(have_kv[:n1] + suffix1, n1), (first_prompt[:n2] + suffix2, n2), (fresh, 0)]
        reqs = []
        for row, (ids, n) in enumerate(specs, start=1):
            alloc.allocate(row, len(ids) + NEW_TOKENS, share_from=0, shared_tokens=n)
            reqs.append(make_req(ids, row, output_len=NEW_TOKENS, cached_len=n))
        assert [r.extend_len for r in reqs] == [len(suffix1), len(suffix2), len(fresh)]
        outs = run_generation(engine, reqs, NEW_TOKENS)

    ref, ref_logits = hf.greedy(first_prompt, 8)
    compared = assert_greedy_match(first_out, ref, ref_logits, label=f"{arch} first request")
    for (ids, n), ours in zip(specs, outs):
        ref, ref_logits = hf.greedy(ids, NEW_TOKENS)
        compared += assert_greedy_match(ours, ref, ref_logits, label=f"{arch} ps={page_size} cached_len={n}")
    assert compared >= 0.8 * (8 + NEW_TOKENS * len(specs))


# ---------------------------------------------------------------------------------------------
# Config layouts and rope scaling
# ---------------------------------------------------------------------------------------------


def test_both_config_layouts_are_exercised(tiny_model_dir):
    v5 = json.loads((tiny_model_dir("llama") / "config.json").read_text())
    assert "rope_parameters" in v5 and "rope_theta" not in v5 and "dtype" in v5
    v4 = json.loads((tiny_model_dir("llama_v4") / "config.json").read_text())
    assert "rope_parameters" not in v4 and "dtype" not in v4
    assert v4["rope_theta"] == LLAMA_V4_ROPE_THETA and v4["torch_dtype"] == "float32"
    assert v4["rope_scaling"]["rope_type"] == "llama3"

    rc = ModelConfig.from_hf(cached_load_hf_config(str(tiny_model_dir("llama_v4")))).rotary_config
    assert rc.base == LLAMA_V4_ROPE_THETA
    assert rc.scaling is not None and rc.scaling.get("rope_type", rc.scaling.get("type")) == "llama3"
    assert float(rc.scaling["factor"]) == LLAMA3_ROPE_SCALING["factor"]
    rc5 = ModelConfig.from_hf(cached_load_hf_config(str(tiny_model_dir("llama")))).rotary_config
    assert rc5.base == 10000.0
    assert (rc5.scaling or {}).get("rope_type", "default") == "default"


def test_llama3_rope_scaling_changes_the_answer(tiny_model_dir, hf_oracle, tmp_path):
    """The llama3 scaling is really exercised by the test prompts: the same weights without the
    scaling give clearly different logits, and the engine matches the scaled model."""
    import shutil

    src = tiny_model_dir("llama_v4")
    plain = tmp_path / "llama_v4_unscaled"
    shutil.copytree(src, plain)
    to_transformers4_layout(plain, LLAMA_V4_ROPE_THETA, None)
    ids = random_prompts([60], seed=7)[0]
    with running_engine(src) as engine:
        alloc = PageAllocator(engine)
        alloc.allocate(0, len(ids) + 1)
        ours = prefill_logits(engine, [make_req(ids, 0, output_len=1)])[0]
    scaled = hf_oracle("llama_v4").logits(ids)[-1]
    unscaled = HFOracle(plain).logits(ids)[-1]
    assert (ours - scaled).abs().max().item() < LOGIT_ATOL
    assert (ours - unscaled).abs().max().item() > 100 * LOGIT_ATOL


def test_sharded_checkpoint_matches_hf(hf_oracle, tmp_path):
    """A checkpoint split over several safetensors files (with its index) loads the same."""
    hf = hf_oracle("qwen2")
    hf.model.save_pretrained(tmp_path, max_shard_size="100KB")
    shards = sorted(tmp_path.glob("*.safetensors"))
    assert len(shards) > 3 and (tmp_path / "model.safetensors.index.json").exists()
    ids = random_prompts([10], seed=9)[0]
    with running_engine(tmp_path) as engine:
        PageAllocator(engine).allocate(0, len(ids) + 1)
        ours = prefill_logits(engine, [make_req(ids, 0, output_len=1)])[0]
    assert (ours - hf.logits(ids)[-1]).abs().max().item() < LOGIT_ATOL


def test_model_config_from_hf(tiny_model_dir):
    def cfg(name):
        return ModelConfig.from_hf(cached_load_hf_config(str(tiny_model_dir(name))))

    moe = cfg("qwen3_moe")
    assert moe.architecture == "Qwen3MoeForCausalLM" and moe.is_moe
    assert (moe.num_experts, moe.num_experts_per_tok, moe.norm_topk_prob) == (4, 2, True)
    assert [moe.layer_is_moe(i) for i in range(3)] == [True, False, True]
    q3 = cfg("qwen3")
    assert q3.tie_word_embeddings and q3.head_dim == 32 and not q3.is_moe
    mistral = cfg("mistral")
    assert (mistral.num_qo_heads, mistral.num_kv_heads, mistral.head_dim) == (8, 2, 8)
    assert cfg("llama").attention_bias
