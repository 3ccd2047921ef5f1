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

import functools
import importlib.util
from pathlib import Path
from typing import Any, Callable, Dict, List

import pytest
import torch
from helpers import (
    LOGIT_ATOL,
    TEST_DEVICE,
    HFOracle,
    PageAllocator,
    allocated_reqs,
    assert_greedy_match,
    assert_prefill_logits_match_hf,
    make_req,
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
    return functools.cache(lambda name: build_gemma(name, tmp_path_factory.mktemp(name), seed=70 + NAMES.index(name)))


@pytest.fixture(scope="module")
def gemma_hf(gemma_dir: Callable[[str], Path]) -> Callable[[str], HFOracle]:
    @functools.cache
    def get(name: str) -> HFOracle:
        hf = HFOracle(gemma_dir(name))
        hf.model.config._attn_implementation = "eager"  # soft-capping: HF's eager attention only
        return hf

    return get


def _prompts(name: str) -> List[List[int]]:
    # (75: past the deterministic backend's first 64-key block, which then lies outside the window)
    return random_prompts([5, 13, 27, 75], seed=400 + NAMES.index(name))


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


def test_config_in_the_transformers4_layout(tmp_path):
    """A Gemma 3 config.json as transformers 4 wrote it (rope_theta + rope_local_base_freq +
    rope_scaling, sliding_window_pattern, no layer_types): the windows follow the layer types
    transformers derives, each layer type gets its rotary base, the scale its scalar."""
    import json

    raw = dict(_COMMON, architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", num_hidden_layers=7,
               sliding_window_pattern=3, rope_theta=1e6, rope_local_base_freq=1e4, query_pre_attn_scalar=32,
               rope_scaling={"rope_type": "linear", "factor": 8.0}, transformers_version="4.50.0")  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(raw))
    hf = cached_load_hf_config(str(tmp_path))
    cfg = ModelConfig.from_hf(hf)
    assert cfg.layer_windows == tuple(WINDOW if t == "sliding_attention" else None for t in hf.layer_types)
    assert cfg.layer_windows.count(None) == 2  # layers 2 and 5: every third is global
    assert (cfg.rotary_of(2).base, cfg.rotary_of(2).scaling["factor"]) == (1e6, 8.0)  # type: ignore[index]
    assert (cfg.rotary_of(0).base, cfg.rotary_of(0).scaling) == (1e4, None)
    assert cfg.attn_scale == 32**-0.5 and cfg.context_cut_by_window is None


# ---- the module path, against HF -------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_prefill_logits_match_hf(name, gemma_dir, gemma_hf):
    hf = gemma_hf(name)
    prompts = _prompts(name)
    assert_prefill_logits_match_hf(gemma_dir(name), hf, prompts, name)


@pytest.mark.parametrize("backend", ["auto", "deterministic"])
@pytest.mark.parametrize("name", NAMES)
def test_decode_logits_match_hf(name, backend, gemma_dir, gemma_hf):
    """Decode steps fed HF's greedy tokens equal HF generate's step logits, past the window, on
    the default backend (the CPU one, which hands these layers to the torch code) and on the
    batch-invariant one."""
    hf = gemma_hf(name)
    prompts = _prompts(name)
    steps = 10
    refs = [hf.greedy(ids, steps) for ids in prompts]
    with running_engine(gemma_dir(name), page_size=4, attention_backend=backend) as engine:
        reqs = allocated_reqs(engine, prompts, steps)
        ours = teacher_forced_logits(engine, reqs, [tokens for tokens, _ in refs])
    for i, (_, ref_logits) in enumerate(refs):
        diff = (torch.stack([s[i] for s in ours]) - torch.stack(ref_logits)).abs().max().item()
        assert diff < LOGIT_ATOL, f"{name} prompt {i}: max |decode logit diff| {diff:.3g}"


# ---- through LLM --------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_llm_greedy_matches_hf(name, gemma_dir, gemma_hf):
    """Greedy tokens through the offline API (16-token chunks of prefill, 16-token pages, the
    radix cache, a cold run then a warm one that continues each conversation: the sliding
    layers keep K/V only for the window before a request's end, so that is where a cached prefix
    is reusable, kvcache/window.py) equal HF generate's, tie-aware; on a CPU every decode step
    ran on the module path (ModuleRunner)."""
    hf = gemma_hf(name)
    prompts = random_prompts([3, 9, 20, 37], seed=410 + NAMES.index(name))
    max_tokens = 12
    kw = dict(page_size=16, max_extend_tokens=16, cache_type="radix", max_running_req=4, max_seq_len_override=128)
    with running_llm(gemma_dir(name), **kw) as llm:
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
        ids = (prompts + turns)[i]
        ref, ref_logits = hf.greedy(ids, max_tokens)
        compared += assert_greedy_match(res.token_ids, ref, ref_logits, label=f"{name} prompt {i}")
    assert compared >= 0.8 * max_tokens * len(results)


def test_prompt_logprobs_are_soft_capped(gemma_dir, gemma_hf):
    """Gemma 2's prompt logprobs (every prompt row's logits, chunked prefill) are the log-softmax
    of HF's soft-capped logits: the final cap applies to them too."""
    hf = gemma_hf("gemma2")
    prompt = random_prompts([30], seed=425)[0]
    with running_llm(gemma_dir("gemma2"), max_extend_tokens=16, page_size=4) as llm:
        result = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))[0]
    expect = torch.log_softmax(hf.logits(prompt), dim=-1)
    entries = result.prompt_logprobs
    assert entries is not None and len(entries) == len(prompt) - 1
    diff = max(abs(logprob - expect[p, token].item()) for p, (token, logprob, _) in enumerate(entries))
    assert diff < 1e-4, f"max |prompt logprob diff| {diff:.3g}"


def test_deterministic_mode_windows_and_caps(gemma_dir):
    """`--deterministic` with sliding windows and soft-capping, which the CPU's C attention does
    not take (those layers attend through the deterministic walk inside the mode's CPU backend):
    bf16 tokens and logprobs alone equal those in a batch, and generation logprobs equal the
    prompt logprobs of a re-scoring prefill, bit for bit."""
    prompts = _prompts("gemma2")[2:]  # (27 and 75 tokens: the latter's first key block leaves the window)
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.6, seed=i, max_tokens=6, ignore_eos=True, logprobs=1) for i in range(2)]
    with running_llm(gemma_dir("gemma2"), dtype="bfloat16", deterministic=True, max_extend_tokens=16) as llm:
        backend = llm.scheduler.engine.config.attention_backend
        assert backend == ("cpu_deterministic" if TEST_DEVICE == "cpu" else "deterministic")
        alone = [llm.generate([p], sp)[0] for p, sp in zip(prompts, params)]
        batch = llm.generate(prompts, params)
        texts = [p + r.token_ids for p, r in zip(prompts, alone)]
        rescored = llm.generate(texts, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))
    for p, a, b, r in zip(prompts, alone, batch, rescored):
        assert (a.token_ids, a.logprobs) == (b.token_ids, b.logprobs)
        assert [e[1] for e in (r.prompt_logprobs or [])[len(p) - 1 :]] == a.logprobs


@pytest.mark.skipif(TEST_DEVICE.startswith("cuda") and torch.cuda.device_count() < 2, reason="tp=2 on CUDA needs two GPUs")
def test_tp2_equals_tp1(gemma_dir):
    """Gemma 3 at tp=2 (2 of 4 query heads, one of 2 KV heads per rank): tp=1's greedy tokens
    and logprobs."""
    path = gemma_dir("gemma3")
    prompts = random_prompts([4, 19, 30], seed=420)
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=2)
    kw = dict(max_running_req=4, page_size=4, max_seq_len_override=96, num_page_override=4 * 96 // 4 + 8)
    with running_llm(path, **kw) as llm:
        ref = llm.generate(prompts, params)
    with running_llm(path, tp=2, **kw) as llm:
        out = llm.generate(prompts, params)
        assert llm.scheduler.engine.model.model.layers[0].self_attn.qkv_proj.weight.shape[0] == (2 + 2) * 16
    for a, b in zip(ref, out):
        assert a.token_ids == b.token_ids
        diff = (torch.tensor(a.logprobs) - torch.tensor(b.logprobs)).abs().max().item()
        assert diff < 1e-4, f"tp=2 logprobs differ from tp=1 by {diff:.3g}"


@pytest.mark.skipif(TEST_DEVICE != "cpu", reason="the CPU step runners")
def test_cpu_decode_step_runs_the_module_path_in_bf16(tmp_path):
    """bf16 on a CPU, where Llama-shaped models get the C decode loop: Gemma's model and layers are
    other classes (scaled embedding, four unit-offset norms, GELU), so no loop is built, the CPU attention backend declines
    its windowed / soft-capped layers, and the decode steps ran on ModuleRunner."""
    from minisgl.core import get_global_ctx
    from minisgl.engine.cpu_decode import _describe

    path = build_gemma("gemma2", tmp_path / "g2bf16", seed=80)
    prompt = random_prompts([20], seed=430)[0]
    with running_llm(path, dtype="bfloat16", max_running_req=2, max_seq_len_override=64) as llm:
        engine = llm.scheduler.engine
        assert engine.cpu_runner is None
        backend = get_global_ctx().attn_backend
        why = _describe(engine.model, backend, 1)[1]
        assert why == "Gemma2ForCausalLM is not a DecoderModel + LM head", why  # (GemmaModel overrides forward)
        if getattr(backend, "kernels", None) is not None:
            assert not backend.takes(engine.model.model.layers[1].self_attn.attn)  # global, but soft-capped
        log = record_runners(engine)
        llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4))
    assert {cls for cls, phase in log if phase == "decode"} == {"ModuleRunner"}


# ---- the torch backend's mask, against a dense reference ---------------------------------------
def _dense_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: int, window: int | None,
                     scale: float, cap: float | None) -> torch.Tensor:  # fmt: skip
    """One query row [Hq, D] at position `pos` over keys/values [S, Hk, D] of positions 0..S-1,
    spelled out: the visible keys are the last `window` up to `pos` (all up to it without one)."""
    first = 0 if window is None else max(0, pos - window + 1)
    k, v = keys[first : pos + 1], values[first : pos + 1]  # [n, Hk, D]
    group = q.shape[0] // k.shape[1]
    out = []
    for h in range(q.shape[0]):
        s = (k[:, h // group] @ q[h]) * scale
        if cap is not None:
            s = torch.tanh(s / cap) * cap
        out.append(torch.softmax(s, dim=0) @ v[:, h // group])
    return torch.stack(out)


@pytest.mark.parametrize("cap", [None, 5.0])
def test_torch_backend_window_mask_equals_dense_reference(cap, gemma_dir):
    """The torch backend's prefill (with and without a cached prefix) and decode attention over
    random K/V in the pool, on a windowed and a global layer, equal the dense reference."""
    from dataclasses import replace

    from helpers import prepare_batch

    with running_engine(gemma_dir("gemma2"), attention_backend="torch") as engine:
        backend = engine.attn_backend
        backend.model_config = replace(backend.model_config, attn_logit_softcapping=cap, attn_scale=0.3)
        gen = torch.Generator().manual_seed(440)
        pool = engine.kv_cache
        pool.buffer.copy_(torch.randn(pool.buffer.shape, generator=gen))
        lens, cached = [21, 6, 13], [11, 0, 12]  # the last one is a 1-token "prefill" chunk
        alloc = PageAllocator(engine)
        reqs = []
        for row, (n, c) in enumerate(zip(lens, cached)):
            alloc.allocate(row, n)
            reqs.append(make_req(list(range(1, n + 1)), row, output_len=1, cached_len=c))
        hq, d = 4, 16
        for phase in ("prefill", "decode"):
            if phase == "decode":
                for r in reqs:
                    r.cached_len = r.device_len - 1
            batch = prepare_batch(engine, reqs, "prefill" if phase == "prefill" else "decode")
            t = batch.input_ids.shape[0]
            q = torch.randn(t, hq, d, generator=gen).to(engine.device)
            for layer_id, window in ((0, WINDOW), (1, None)):
                assert backend.model_config.window_of(layer_id) == window
                out = backend.attend(q, layer_id, batch)
                row = 0
                for r in batch.padded_reqs[: len(reqs)]:
                    slots = engine.page_table[r.table_idx, : r.device_len].long()
                    keys, values = pool.k_cache(layer_id)[slots], pool.v_cache(layer_id)[slots]
                    for pos in range(r.cached_len, r.device_len):
                        ref = _dense_attention(q[row], keys, values, pos, window, 0.3, cap)
                        diff = (out[row] - ref).abs().max().item()
                        assert diff < 1e-5, f"{phase} layer {layer_id} pos {pos}: {diff:.3g}"
                        row += 1


# ---- the Triton kernels, in Triton's interpreter -----------------------------------------------
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_kernels_window_and_softcap_in_interpreter() -> None:
    """tests/kernel_checks/gemma.py: the triton backend's decode (split and direct) and extend
    kernels and the deterministic kernel with a window and soft-capping against a dense float64
    reference, and an Engine on the triton backend against HF (both Gemmas, chunked prefill)."""
    from kernel_checks import run_module

    proc = run_module("gemma")
    assert proc.returncode == 0 and "gemma kernels ok" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


# ---- backends that cannot compute Gemma's attention refuse it ----------------------------------
def test_backend_without_the_options_refuses_them_by_name(gemma_dir, monkeypatch):
    """A backend that does not list Gemma 2's attention options in `attention_features` (as
    FlashInfer lacks sliding windows and soft-capping) is refused at init, naming each option;
    `auto` on CUDA never resolves to FlashInfer for such a model."""
    import sys
    import types

    from minisgl.attention.base import BaseAttnBackend
    from minisgl.attention.registry import resolve_attention_backend

    class PlainBackend(BaseAttnBackend):
        attention_features = ("query_pre_attn_scalar",)

        def prepare_metadata(self, batch: Any) -> None: ...

        def attend(self, q: torch.Tensor, layer_id: int, batch: Any) -> torch.Tensor:
            return q

    with running_engine(gemma_dir("gemma2")) as engine:
        with pytest.raises(ValueError, match=r"does not implement sliding_window, attn_logit_softcapping \(Gemma2ForCausalLM\)"):
            PlainBackend(engine.model.config)
    cuda = torch.device("cuda")
    monkeypatch.setitem(sys.modules, "flashinfer", types.ModuleType("flashinfer"))
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton raises ImportError
    assert resolve_attention_backend("auto", cuda) == "flashinfer"
    assert resolve_attention_backend("auto", cuda, ["sliding_window", "query_pre_attn_scalar"]) == "torch"
    assert resolve_attention_backend("auto", cuda, ["query_pre_attn_scalar"]) == "flashinfer"
