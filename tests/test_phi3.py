"""Phi-3 / Phi-3.5 / Phi-4-mini (models/phi3.py) on tiny random checkpoints against Hugging Face
(float32): prefill logits, decode logits, greedy tokens through `LLM` on every step runner (CPU:
the module path and the CPU fast path; CUDA: graphs and eager), LongRoPE's per-position rule,
the fused qkv/gate_up tensors split before sharding (tp=2), and what Phi-3 configs we refuse.

Three shapes: "phi3" (Phi-3-mini: fused projections, plain rope), "phi35" (Phi-3.5-mini:
LongRoPE, written in the transformers-4 config layout) and "phi4mini" (Phi-4-mini: LongRoPE,
partial rotary 0.75, tied embeddings). LongRoPE's original_max_position_embeddings is 32 here, so
the prompts and their decodes cross from the short factors to the long ones.
"""

from __future__ import annotations

import functools
import inspect
import json
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

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
    prefill_logits,
    prepare_batch,
    random_prompts,
    record_runners,
    run_generation,
    running_engine,
    teacher_forced_logits,
    to_transformers4_layout,
)
from sched_helpers import running_llm

from minisgl.core import SamplingParams
from minisgl.layers.rotary import RotaryConfig, RotaryEmbedding
from minisgl.models import ModelConfig
from minisgl.models.weight import Fused
from minisgl.utils.hf import cached_load_hf_config

ORIGINAL = 32  # LongRoPE's original_max_position_embeddings in the tiny configs
_COMMON: Dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    initializer_range=0.2,  # the default 0.02 makes a 3-layer model repeat one token
    tie_word_embeddings=False,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)


def _longrope(rotary_dim: int, seed: int) -> Dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    n = rotary_dim // 2
    return {
        "rope_type": "longrope",
        "short_factor": (1.0 + 0.5 * torch.rand(n, generator=gen)).tolist(),
        "long_factor": (1.0 + 8.0 * torch.rand(n, generator=gen)).tolist(),
        "original_max_position_embeddings": ORIGINAL,
    }


# name -> Phi3Config overrides (head_dim is 64 / 4 = 16)
VARIANTS: Dict[str, Dict[str, Any]] = {
    "phi3": dict(),
    "phi35": dict(rope_parameters=_longrope(16, 1), original_max_position_embeddings=ORIGINAL),
    "phi4mini": dict(
        rope_parameters={**_longrope(12, 2), "partial_rotary_factor": 0.75},
        partial_rotary_factor=0.75,
        original_max_position_embeddings=ORIGINAL,
        tie_word_embeddings=True,
    ),
}


def build_phi3(out_dir: Path, seed: int, dtype: torch.dtype = torch.float32, **overrides: Any) -> Path:
    from transformers import AutoModelForCausalLM, Phi3Config

    cfg = Phi3Config(**{**_COMMON, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # HF inits norms to ones: make a mis-loaded norm visible
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    model.to(dtype).save_pretrained(out_dir)
    return out_dir


def _v4_layout(model_dir: Path) -> None:
    """transformers 4's Phi-3.5 config.json: rope_scaling {type, short/long_factor} and a top-level
    original_max_position_embeddings."""
    cfg = json.loads((model_dir / "config.json").read_text())
    params = cfg["rope_parameters"]
    scaling = {"type": "longrope", "short_factor": params["short_factor"], "long_factor": params["long_factor"]}
    to_transformers4_layout(model_dir, params.get("rope_theta", 10000.0), scaling)
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["original_max_position_embeddings"] = ORIGINAL
    (model_dir / "config.json").write_text(json.dumps(cfg, indent=2))


@pytest.fixture(scope="module")
def phi3_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    @functools.cache
    def get(name: str) -> Path:
        path = build_phi3(tmp_path_factory.mktemp(name), seed=30 + sorted(VARIANTS).index(name), **VARIANTS[name])
        if name == "phi35":
            _v4_layout(path)
        return path

    return get


@pytest.fixture(scope="module")
def phi3_hf(phi3_dir: Callable[[str], Path]) -> Callable[[str], HFOracle]:
    return functools.cache(lambda name: HFOracle(phi3_dir(name)))


@torch.inference_mode()
def hf_stepwise_greedy(hf: HFOracle, ids: List[int], n: int) -> Tuple[List[int], List[torch.Tensor]]:
    """HF's own Phi-3 forward with its cache, one token per forward past the first ORIGINAL
    positions, then greedy: (tokens, the logits behind each). Each forward picks LongRoPE's
    factors by its longest position, so every position is rotated by its own position's set: our
    rule. Within ORIGINAL this is HF generate exactly; past it generate differs on purpose (at the
    crossing it drops its cache and recomputes the whole sequence with the long factors, its
    `prepare_inputs_for_generation`), which a paged engine does not do (docs/MODELS.md)."""
    from transformers import DynamicCache

    model, dev = hf.model, hf.device
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    cache = {cache_kw: DynamicCache(config=model.config)}

    def forward(chunk: List[int]) -> torch.Tensor:
        out = model(input_ids=torch.tensor([chunk], device=dev), use_cache=True, **cache)
        return out.logits[0, -1].float().cpu()

    step = forward(ids[:ORIGINAL])
    for t in ids[ORIGINAL:]:
        step = forward([t])
    tokens, logits = [], []
    for _ in range(n):
        tokens.append(int(step.argmax()))
        logits.append(step)
        step = forward([tokens[-1]])
    return tokens, logits


_REFERENCES: Dict[Tuple[str, Tuple[int, ...], int], Tuple[List[int], List[torch.Tensor]]] = {}


def reference(name: str, hf: HFOracle, ids: List[int], n: int) -> Tuple[List[int], List[torch.Tensor]]:
    """HF generate, or for the LongRoPE shapes HF stepwise (identical while within ORIGINAL);
    memoized: every path and both runs of a test compare with the same HF outputs."""
    key = (name, tuple(ids), n)
    if key not in _REFERENCES:
        _REFERENCES[key] = hf.greedy(ids, n) if name == "phi3" else hf_stepwise_greedy(hf, ids, n)
    return _REFERENCES[key]


NAMES = sorted(VARIANTS)
LENGTHS = [5, 12, 27]


def _prompts(name: str) -> List[List[int]]:
    return random_prompts(LENGTHS, seed=NAMES.index(name) + 300)


# ---- the module path, against HF -------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_prefill_logits_match_hf(name, phi3_dir, phi3_hf):
    hf = phi3_hf(name)
    prompts = _prompts(name)
    assert_prefill_logits_match_hf(phi3_dir(name), hf, prompts, name)


@pytest.mark.parametrize("name", NAMES)
def test_decode_logits_match_hf(name, phi3_dir, phi3_hf):
    """Decode steps fed the reference's greedy tokens equal its step logits. The 27-token prompt
    decodes across position 32 (LongRoPE's short -> long rows); within 32 the reference is HF
    generate itself, and the teacher-forced steps also equal HF's forward of the whole sequence."""
    hf = phi3_hf(name)
    prompts = _prompts(name)
    steps = 10
    refs = [reference(name, hf, ids, steps) for ids in prompts]
    with running_engine(phi3_dir(name), page_size=4) as engine:
        reqs = allocated_reqs(engine, prompts, steps)
        ours = teacher_forced_logits(engine, reqs, [tokens for tokens, _ in refs])
    assert len(prompts[-1]) + steps > ORIGINAL
    for i, (_, ref_logits) in enumerate(refs):
        diff = (torch.stack([s[i] for s in ours]) - torch.stack(ref_logits)).abs().max().item()
        assert diff < LOGIT_ATOL, f"{name} prompt {i}: max |decode logit diff| {diff:.3g}"
        ids, cont = prompts[i], refs[i][0]
        within = min(steps, ORIGINAL - len(ids) + 1)  # the steps whose sequence stays within 32
        full = hf.logits((ids + cont)[:ORIGINAL])[len(ids) - 1 : len(ids) - 1 + within]
        diff = (torch.stack([s[i] for s in ours[:within]]) - full).abs().max().item()
        assert diff < LOGIT_ATOL, f"{name} prompt {i}: max |decode logit diff| against HF's forward {diff:.3g}"


# ---- every step runner, through LLM -----------------------------------------------------------
# On CPU these float32 runs take the module path: the C decode loop's kernels are bf16 (the fast
# path is checked in bf16 below, bitwise against the module path and against HF bf16).
PATHS = ["graphs", "eager"] if TEST_DEVICE.startswith("cuda") else ["module"]


def _path_kwargs(path: str) -> Dict[str, Any]:
    return {
        "graphs": {},
        "eager": dict(cuda_graph_bs=[], cuda_graph_max_tokens=0),
        "module": dict(cpu_fast_decode=False),
    }[path]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", NAMES)
def test_llm_greedy_matches_hf(name, path, phi3_dir, phi3_hf):
    """Greedy tokens through the offline API (chunked prefill, 16-token pages, the radix cache, a
    cold then a warm run) equal the reference's (HF generate; HF stepwise past 32), tie-aware, and every decode step ran on the runner
    this path must use: no silent fall-off to the module path."""
    hf = phi3_hf(name)
    prompts = random_prompts([3, 9, 20, 30], seed=NAMES.index(name) + 310)
    max_tokens = 16  # the 20- and 30-token prompts decode across position 32
    kw = dict(page_size=16, max_extend_tokens=16, cache_type="radix", max_running_req=4, max_seq_len_override=128, **_path_kwargs(path))
    with running_llm(phi3_dir(name), **kw) as llm:
        engine = llm.scheduler.engine
        log = record_runners(engine)
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        results = llm.generate(prompts, params) + llm.generate(prompts, params)
    decode_runners = {cls for cls, phase in log if phase == "decode"}
    expected = {"graphs": "GraphRunner", "eager": "ModuleRunner", "module": "ModuleRunner"}[path]
    assert decode_runners == {expected}, f"{name} {path}: decode steps ran on {decode_runners}"
    assert sum(r.cached_tokens for r in results[len(prompts) :]) > 0, "the warm run hit no cache"
    compared = 0
    for i, res in enumerate(results):
        ids = prompts[i % len(prompts)]
        ref, ref_logits = reference(name, hf, ids, max_tokens)
        compared += assert_greedy_match(res.token_ids, ref, ref_logits, label=f"{name} {path} prompt {i}")
    assert compared >= 0.8 * max_tokens * len(results)


@pytest.mark.skipif(TEST_DEVICE != "cpu", reason="the CPU fast path")
@pytest.mark.parametrize("name", NAMES)
def test_cpu_decode_loop_is_built_and_equals_the_module_path(name, tmp_path):
    """bf16 on CPU: the C decode loop (`CpuDecodeLoop`) is built from Phi-3's own modules with no
    Phi-specific code (fused checkpoint tensors, LongRoPE's table), and a decode step past
    position 32 (LongRoPE's long rows) gives bitwise the module path's logits."""
    from minisgl.engine.cpu_decode import CpuDecodeLoop
    from minisgl.kernel.cpu import cpu_kernels

    kern = cpu_kernels()
    if kern is None or not kern.has_gemv:
        pytest.skip("no C compiler or no AVX512-BF16 here")
    path = build_phi3(tmp_path / name, seed=50 + NAMES.index(name), dtype=torch.bfloat16, **VARIANTS[name])
    prompt = random_prompts([30], seed=320)[0]
    with running_engine(path, max_running_req=2, dtype=torch.bfloat16) as engine:
        loop = engine.cpu_runner
        if name == "phi4mini":
            # partial rotary: the C kernels rotate whole heads, so the CPU attention backend does not
            # take these layers (its capability check, not a Phi predicate) and neither does the loop;
            # the module path runs them (docs/MODELS.md)
            from minisgl.core import get_global_ctx
            from minisgl.engine.cpu_decode import _describe

            assert loop is None
            assert "attention is not one the kernels take" in _describe(engine.model, get_global_ctx().attn_backend, 1)[1]
            return
        assert isinstance(loop, CpuDecodeLoop) and loop in engine.runners, "the decode loop was not built"
        alloc = PageAllocator(engine)
        alloc.allocate(0, len(prompt) + 8)
        out = run_generation(engine, [make_req(prompt, 0, output_len=8)], 8)[0]
        req = make_req(prompt + out[:-1], 0, output_len=2, cached_len=len(prompt) + 6)
        batch = prepare_batch(engine, [req], "decode")
        assert loop.can_run(batch)
        pool = engine.kv_cache.buffer.clone()
        logits = {}
        for fused in (True, False):
            with torch.inference_mode(), engine.ctx.forward_batch(batch):
                logits[fused] = (loop.run(batch) if fused else engine.model.forward()).clone()
            engine.kv_cache.buffer.copy_(pool)
    assert torch.equal(logits[True], logits[False])


@pytest.mark.skipif(TEST_DEVICE != "cpu", reason="the CPU fast path's bf16 kernels")
def test_bf16_cpu_fast_path_agrees_with_hf_bf16(tmp_path):
    """bf16 weights on CPU run the C fast path (its bf16 GEMMs); greedy tokens agree with HF bf16
    up to bf16-sized ties."""
    from transformers import AutoModelForCausalLM

    path = build_phi3(tmp_path / "phi35_bf16", seed=40, dtype=torch.bfloat16, **VARIANTS["phi35"])
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).eval()
    prompts = random_prompts([7, 25], seed=330)
    with running_llm(path, dtype="bfloat16", max_running_req=1, max_seq_len_override=128) as llm:
        engine = llm.scheduler.engine
        log = record_runners(engine)
        results = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12))
    # one row at a time: the loop takes batches of its row count (1 on a CPU without AMX); a CPU
    # without AVX512-BF16 has no bf16 C GEMMs and no loop: the module path decodes
    from minisgl.kernel.cpu import cpu_kernels

    kern = cpu_kernels()
    expected = "CpuDecodeLoop" if kern is not None and kern.has_gemv else "ModuleRunner"
    assert {cls for cls, phase in log if phase == "decode"} == {expected}
    for ids, res in zip(prompts, results):
        x = torch.tensor([ids])
        with torch.inference_mode():
            out = hf.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=12, do_sample=False,
                              return_dict_in_generate=True, output_logits=True, pad_token_id=0)  # fmt: skip
        ref = out.sequences[0, len(ids) :].tolist()
        agreed = 0
        for a, b, lg in zip(res.token_ids, ref, out.logits):
            if a != b:
                gap = abs(float(lg[0][b] - lg[0][a]))
                assert gap < 0.3, f"bf16: divergence at {agreed} ({a} vs HF {b}), HF gap {gap:.3g}"
                break
            agreed += 1
        assert agreed >= 4, (res.token_ids, ref)


# ---- LongRoPE ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["phi35", "phi4mini"])
def test_longrope_tables_equal_transformers(name, phi3_dir):
    """Row p of our table is transformers' Phi3RotaryEmbedding output for a forward whose longest
    position is p: the short factors below original_max_position_embeddings, the long ones from
    there on, times the attention factor."""
    from transformers import AutoConfig
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    path = phi3_dir(name)
    ours = RotaryEmbedding(ModelConfig.from_hf(cached_load_hf_config(str(path))).rotary_config)
    ref = Phi3RotaryEmbedding(AutoConfig.from_pretrained(str(path)))
    x = torch.zeros(1, dtype=torch.float32)
    for p in (0, 5, ORIGINAL - 1, ORIGINAL, ORIGINAL + 7, 127):
        cos, sin = ref(x, torch.tensor([[p]]))
        assert torch.equal(ours.cos[p], cos[0, 0]) and torch.equal(ours.sin[p], sin[0, 0]), (name, p)
    assert ref.attention_scaling > 1.0  # factor 128 / 32 = 4: the scaling is exercised
    assert not torch.allclose(ours.cos[ORIGINAL - 1], ours.cos[ORIGINAL], atol=0.1)


def test_longrope_prompt_past_original_is_rotated_per_position(phi3_dir, phi3_hf):
    """A prompt longer than original_max_position_embeddings: ours equals transformers fed the
    first 32 tokens and then one token at a time (each position past 32 rotated with the long
    factors, the earlier ones with the short ones); transformers' single forward of the whole
    prompt rotates all of it with the long factors instead (the documented difference)."""
    hf = phi3_hf("phi35")
    ids = random_prompts([45], seed=340)[0]
    with running_engine(phi3_dir("phi35")) as engine:
        PageAllocator(engine).allocate(0, len(ids) + 1)
        ours = prefill_logits(engine, [make_req(ids, 0, output_len=1)])[0]
    stepwise = hf_stepwise_greedy(hf, ids, 1)[1][0]
    assert (ours - stepwise).abs().max().item() < LOGIT_ATOL
    assert (ours - hf.logits(ids)[-1]).abs().max().item() > 100 * LOGIT_ATOL


# ---- configs ----------------------------------------------------------------------------------
def test_model_configs(phi3_dir, tmp_path):
    def cfg(path: Path) -> ModelConfig:
        return ModelConfig.from_hf(cached_load_hf_config(str(path)))

    v4 = json.loads((phi3_dir("phi35") / "config.json").read_text())
    assert "rope_parameters" not in v4 and v4["rope_scaling"]["type"] == "longrope"
    rc = cfg(phi3_dir("phi35")).rotary_config
    assert rc.scaling is not None and rc.scaling["original_max_position_embeddings"] == ORIGINAL
    assert rc.scaling["factor"] == 128 / ORIGINAL and (rc.rotary_dim, rc.max_position) == (16, 128)
    phi4 = cfg(phi3_dir("phi4mini"))
    assert phi4.tie_word_embeddings and (phi4.head_dim, phi4.rotary_config.rotary_dim) == (16, 12)
    assert phi4.architecture == "Phi3ForCausalLM"
    # a sliding window shorter than the context (Phi-3-mini-4k: 2047 of 4096) cuts the context to it
    windowed = build_phi3(tmp_path / "window", seed=50, sliding_window=47)
    assert cfg(windowed).rotary_config.max_position == 47 and cfg(windowed).context_cut_by_window == 47
    assert cfg(build_phi3(tmp_path / "wide", seed=50, sliding_window=4096)).rotary_config.max_position == 128
    with pytest.raises(ValueError, match=r"--max-seq-len 48 is longer than this model's sliding window \(sliding_window=47\)"):
        with running_engine(windowed, max_seq_len=48):
            pass
    # within the window the window masks nothing: HF (which masks it) agrees
    ids = random_prompts([40], seed=360)[0]
    with running_engine(windowed, max_seq_len=47) as engine:
        PageAllocator(engine).allocate(0, len(ids) + 1)
        ours = prefill_logits(engine, [make_req(ids, 0, output_len=1)])[0]
    assert (ours - HFOracle(windowed).logits(ids)[-1]).abs().max().item() < LOGIT_ATOL


def test_what_we_refuse_is_named():
    base = dict(head_dim=16, rotary_dim=16, max_position=64, base=10000.0)
    good = {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8, "original_max_position_embeddings": 32}
    RotaryEmbedding(RotaryConfig(**base, scaling=good))
    with pytest.raises(ValueError, match=r"rope_scaling\.long_factor has 7 entries"):
        RotaryEmbedding(RotaryConfig(**base, scaling={**good, "long_factor": [2.0] * 7}))
    no_original = {k: v for k, v in good.items() if k != "original_max_position_embeddings"}
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        RotaryEmbedding(RotaryConfig(**base, scaling=no_original))
    with pytest.raises(ValueError, match="unsupported rope scaling type 'dynamic'"):
        RotaryEmbedding(RotaryConfig(**base, scaling={"rope_type": "dynamic", "factor": 2.0}))
    fused = Fused((("q", 4), ("k", 2), ("v", 2)))
    assert [(p, t.shape[0]) for p, t in fused.split(torch.zeros(8, 3))] == [("q", 4), ("k", 2), ("v", 2)]
    with pytest.raises(ValueError, match="has 9 rows, its parts q: 4, k: 2, v: 2 need 8"):
        fused.split(torch.zeros(9, 3))


# ---- tensor parallelism -----------------------------------------------------------------------
@pytest.mark.skipif(TEST_DEVICE.startswith("cuda") and torch.cuda.device_count() < 2, reason="tp=2 on CUDA needs two GPUs")
@pytest.mark.parametrize("kv_heads", [2, 1])  # 1: fewer KV heads than ranks, each rank a replica
def test_tp2_equals_tp1(kv_heads, tmp_path):
    """The fused qkv_proj / gate_up_proj tensors are split into q, k, v / gate, up before each rank
    takes its shard: tp=2 generates tp=1's greedy tokens with its logprobs (Phi-4-mini's shape:
    LongRoPE, partial rotary, tied head)."""
    path = build_phi3(tmp_path / f"tp_kv{kv_heads}", seed=60 + kv_heads, num_key_value_heads=kv_heads, **VARIANTS["phi4mini"])
    prompts = random_prompts([4, 19, 30], seed=350)
    params = SamplingParams(temperature=0.0, max_tokens=10, logprobs=2)
    kw = dict(max_running_req=4, page_size=4, max_seq_len_override=96, num_page_override=4 * 96 // 4 + 8)
    with running_llm(path, **kw) as llm:
        ref = llm.generate(prompts, params)
        q_full = llm.scheduler.engine.model.model.layers[0].self_attn.qkv_proj.weight.shape[0]
    with running_llm(path, tp=2, **kw) as llm:
        out = llm.generate(prompts, params)
        q_local = llm.scheduler.engine.model.model.layers[0].self_attn.qkv_proj.weight.shape[0]
    # rank 0: 2 of the 4 query heads, and its own KV head (2 KV heads) or the replicated one
    assert q_local == (2 + 2 * 1) * 16 and q_full == (4 + 2 * kv_heads) * 16
    for a, b in zip(ref, out):
        assert a.token_ids == b.token_ids
        diff = (torch.tensor(a.logprobs) - torch.tensor(b.logprobs)).abs().max().item()
        assert diff < 1e-4, f"tp=2 logprobs differ from tp=1 by {diff:.3g}"
