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

import functools
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
    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                     "truncate": False, "original_max_position_embeddings": 64},  # fmt: skip
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


def test_prefill_logits_match_hf(oss_dir, oss_hf):
    assert_prefill_logits_match_hf(oss_dir, oss_hf, _prompts(), "gpt_oss")
