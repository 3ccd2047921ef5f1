"""Gemma 2 and Gemma 3 (text, models/gemma.py) on tiny random checkpoints against Hugging Face
(float32, eager attention: the only HF kernel with soft-capping): prefill and decode logits,
greedy tokens through `LLM` (chunked prefill, 16-token pages, a warm radix cache), tp=2 against
tp=1, the runner the CPU decode step used, and the torch backend's sliding-window mask against a
dense reference.

The window is 8 tokens and the prompts are longer, so the windowed layers mask real keys; the
norms' weights (zero-initialised in HF: (1 + w) is then 1) are perturbed so (1 + w) matters.
Gemma 2 alternates sliding and global layers and soft-caps scores (50) and logits (30, lowered to
3 here so the cap bends the tiny model's logits); Gemma 3 has q/k norms, a global rope base with
linear scaling and a local one, and `layer_types` with two sliding layers per global one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Dict, List

import pytest
import torch
from helpers import (
    LOGIT_ATOL,
    TEST_DEVICE,
    HFOracle,
    PageAllocator,
    assert_greedy_match,
    make_req,
    prefill_logits,
    random_prompts,
    running_engine,
    teacher_forced_logits,
)
from sched_helpers import running_llm

from minisgl.core import SamplingParams
from minisgl.models import ModelConfig
from minisgl.utils.hf import cached_load_hf_config

WINDOW = 8
_COMMON: Dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=128,
    sliding_window=WINDOW,
    initializer_range=0.2,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
VARIANTS: Dict[str, Dict[str, Any]] = {
    "gemma2": dict(num_hidden_layers=4, query_pre_attn_scalar=24, final_logit_softcapping=3.0),
    "gemma3": dict(
        num_hidden_layers=3,
        query_pre_attn_scalar=12,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
    ),
}
NAMES = sorted(VARIANTS)


def build_gemma(name: str, out_dir: Path, seed: int, **extra: Any) -> Path:
    from transformers import AutoModelForCausalLM, Gemma2Config, Gemma3TextConfig

    config_class = Gemma2Config if name == "gemma2" else Gemma3TextConfig
    cfg = config_class(**{**_COMMON, **VARIANTS[name], **extra})
    cfg.architectures = ["Gemma2ForCausalLM" if name == "gemma2" else "Gemma3ForCausalLM"]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:  # zeros in HF: (1 + w) would be 1
                p.copy_(0.3 * torch.randn_like(p))
    model.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    cache: Dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in cache:
            cache[name] = build_gemma(name, tmp_path_factory.mktemp(name), seed=70 + NAMES.index(name))
        return cache[name]

    return get


@pytest.fixture(scope="module")
def gemma_hf(gemma_dir: Callable[[str], Path]) -> Callable[[str], HFOracle]:
    cache: Dict[str, HFOracle] = {}

    def get(name: str) -> HFOracle:
        if name not in cache:
            hf = HFOracle(gemma_dir(name))
            hf.model.config._attn_implementation = "eager"  # soft-capping: HF's eager attention only
            cache[name] = hf
        return cache[name]

    return get


_GREEDY: Dict[tuple, Any] = {}


def hf_greedy(name: str, hf: HFOracle, ids: List[int], n: int) -> Any:
    key = (name, tuple(ids), n)
    if key not in _GREEDY:
        _GREEDY[key] = hf.greedy(ids, n)
    return _GREEDY[key]


def _prompts(name: str) -> List[List[int]]:
    return random_prompts([5, 13, 27], seed=400 + NAMES.index(name))


# ---- the config --------------------------------------------------------------------------------
def test_config_reads_windows_rope_and_caps(gemma_dir):
    g2 = ModelConfig.from_hf(cached_load_hf_config(str(gemma_dir("gemma2"))))
    assert g2.layer_windows == (WINDOW, None, WINDOW, None)
    assert g2.attn_scale == 24**-0.5 and g2.attn_logit_softcapping == 50.0 and g2.final_logit_softcapping == 3.0
    assert g2.context_cut_by_window is None and g2.rotary_config.max_position == 128  # the backends mask it
    assert g2.hidden_act == "gelu_pytorch_tanh" and g2.tie_word_embeddings
    g3 = ModelConfig.from_hf(cached_load_hf_config(str(gemma_dir("gemma3"))))
    assert g3.layer_windows == (WINDOW, WINDOW, None) and g3.attn_logit_softcapping is None
    assert g3.rotary_of(2).base == 100000.0 and g3.rotary_of(2).scaling == {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0}
    assert g3.rotary_of(0).base == 10000.0 and g3.rotary_of(0).scaling is None


# ---- the module path, against HF -------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_prefill_logits_match_hf(name, gemma_dir, gemma_hf):
    hf = gemma_hf(name)
    prompts = _prompts(name)
    with running_engine(gemma_dir(name)) as engine:
        alloc = PageAllocator(engine)
        reqs = []
        for row, ids in enumerate(prompts):
            alloc.allocate(row, len(ids) + 1)
            reqs.append(make_req(ids, row, output_len=1))
        ours = prefill_logits(engine, reqs)
    for i, ids in enumerate(prompts):
        ref = hf.logits(ids)[-1]
        diff = (ours[i] - ref).abs().max().item()
        assert diff < LOGIT_ATOL, f"{name} prompt {i} (len {len(ids)}): max |logit diff| {diff:.3g}"
        assert ref.std() > 0.1


@pytest.mark.parametrize("name", NAMES)
def test_decode_logits_match_hf(name, gemma_dir, gemma_hf):
    """Decode steps fed HF's greedy tokens equal HF generate's step logits, past the window."""
    hf = gemma_hf(name)
    prompts = _prompts(name)
    steps = 10
    refs = [hf_greedy(name, hf, ids, steps) for ids in prompts]
    with running_engine(gemma_dir(name), page_size=4) as engine:
        alloc = PageAllocator(engine)
        reqs = []
        for row, ids in enumerate(prompts):
            alloc.allocate(row, len(ids) + steps)
            reqs.append(make_req(ids, row, output_len=steps))
        ours = teacher_forced_logits(engine, reqs, [tokens for tokens, _ in refs])
    for i, (_, ref_logits) in enumerate(refs):
        diff = (torch.stack([s[i] for s in ours]) - torch.stack(ref_logits)).abs().max().item()
        assert diff < LOGIT_ATOL, f"{name} prompt {i}: max |decode logit diff| {diff:.3g}"
