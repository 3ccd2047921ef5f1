"""The Engine and the Sampler: the seed's three engine tests (tests/test_ch06_engine.py in the
seed), min_p, mixed batches, forward_batch's contract, repeated construction, the KV page
budget, and bad input."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from helpers import (
    LOGIT_ATOL,
    TEST_DEVICE,
    PageAllocator,
    assert_greedy_match,
    engine_config,
    make_req,
    prefill_logits,
    prepare_batch,
    random_prompts,
    run_generation,
    running_engine,
)

import minisgl.core
from minisgl.core import Batch, Req, SamplingParams, get_global_ctx
from minisgl.distributed import DistributedInfo
from minisgl.distributed.info import try_get_tp_info
from minisgl.engine import Engine, EngineConfig, Sampler
from minisgl.engine.sample import MIN_T

SEED_MODEL = "qwen3"  # the seed runs these tests on Qwen3; here its tiny random twin


@pytest.fixture
def one_thread():
    """The sampler tests make thousands of tiny calls: intra-op threads only add wake-up latency
    (badly so on a loaded 2-core machine)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def _batch(params):
    reqs = [
        Req(
            input_ids=torch.tensor([1, 2, 3], dtype=torch.int32),
            table_idx=i,
            cached_len=0,
            output_len=4,
            uid=i,
            sampling_params=p,
            cache_handle=None,
        )
        for i, p in enumerate(params)
    ]
    return Batch(reqs=reqs, phase="decode")


# ---------------------------------------------------------------------------------------------
# The seed's three engine tests
# ---------------------------------------------------------------------------------------------


def test_prefill_logits_match_hf(tiny_model_dir, hf_oracle):
    hf = hf_oracle(SEED_MODEL)
    prompts = random_prompts([9, 4], seed=1)
    with running_engine(tiny_model_dir(SEED_MODEL), max_running_req=4, num_pages=1024, max_seq_len=256) as engine:
        reqs = []
        for row, ids in enumerate(prompts):
            engine.page_table[row, :256] = torch.arange(row * 256, row * 256 + 256)
            reqs.append(make_req(ids, row, output_len=8))
        ours = prefill_logits(engine, reqs)
    for i, ids in enumerate(prompts):
        diff = (ours[i] - hf.logits(ids)[-1]).abs().max().item()
        assert diff < LOGIT_ATOL, f"prompt {i}: max |logit diff| {diff:.3g}"


def test_manual_loop_greedy_matches_hf(tiny_model_dir, hf_oracle):
    """The seed's hand-written loop (examples/ch06_engine.py), verbatim but for the model; on
    CUDA it also proves host tensors in a batch are moved to the engine's device."""
    hf = hf_oracle(SEED_MODEL)
    path = tiny_model_dir(SEED_MODEL)
    engine = Engine(
        EngineConfig(
            model_path=str(path),
            tp_info=DistributedInfo(0, 1),
            dtype=torch.float32,
            device=TEST_DEVICE,
            max_running_req=4,
            num_page_override=1024,
            max_seq_len_override=256,
        )
    )
    try:
        assert engine.num_pages == 1024 and tuple(engine.page_table.shape) == (5, 256)
        prompts = random_prompts([9, 5], seed=2)
        reqs = []
        for row, ids in enumerate(prompts):
            engine.page_table[row, :256] = torch.arange(row * 256, row * 256 + 256)
            reqs.append(
                Req(
                    input_ids=torch.tensor(ids, dtype=torch.int32),
                    table_idx=row,
                    cached_len=0,
                    output_len=8,
                    uid=row,
                    sampling_params=SamplingParams(max_tokens=8),
                    cache_handle=None,
                )
            )
        outs = [[] for _ in reqs]
        phase = "prefill"
        for step in range(8):
            # the seed's lines as written: input_ids/positions built on the host (forward_batch
            # moves them to the engine's device), fields over `reqs` (graph replay pads the rest)
            batch = Batch(reqs=reqs, phase=phase)
            engine.graph_runner.pad_batch(batch)
            batch.positions = torch.cat([torch.arange(r.cached_len, r.device_len) for r in reqs]).int()
            batch.input_ids = torch.cat([r.input_ids[r.cached_len : r.device_len] for r in reqs])
            batch.out_loc = torch.cat([engine.page_table[r.table_idx, r.cached_len : r.device_len] for r in reqs])
            engine.attn_backend.prepare_metadata(batch)
            out = engine.forward_batch(batch, engine.sampler.prepare(batch))
            out.copy_done_event.synchronize()
            for i, r in enumerate(reqs):
                r.append_host(out.next_tokens_cpu[i : i + 1])
                outs[i].append(int(out.next_tokens_cpu[i]))
            if step == 0:
                assert len(batch.input_ids) == 14  # prefill: both prompts flattened
            else:
                assert len(batch.input_ids) == len(reqs)  # decode: one token each
            phase = "decode"
    finally:
        engine.shutdown()
    for i, (ids, o) in enumerate(zip(prompts, outs)):
        ref, ref_logits = hf.greedy(ids, 8)
        assert assert_greedy_match(o, ref, ref_logits, label=f"prompt {i}") == 8


@pytest.mark.usefixtures("one_thread")
def test_sampler_greedy_and_filters():
    sampler = Sampler(torch.device("cpu"), vocab_size=6)
    assert sampler.prepare(_batch([SamplingParams(), SamplingParams()])).temperatures is None
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0, 0.0, 0.0]] * 3)
    args = sampler.prepare(
        _batch(
            [
                SamplingParams(temperature=1.0, top_k=2),
                SamplingParams(temperature=1.0, top_p=0.5),
                SamplingParams(),
            ]
        )
    )  # the third request is greedy
    torch.manual_seed(0)
    draws = torch.stack([sampler.sample(logits, args) for _ in range(2000)])
    assert set(draws[:, 0].tolist()) == {0, 1}  # top-k=2: only the first two
    assert set(draws[:, 1].tolist()) == {0}  # the best token has p ~0.67 > 0.5: top-p keeps it alone
    assert set(draws[:, 2].tolist()) == {0}  # the greedy request in a mixed batch
    p0 = (draws[:, 0] == 0).float().mean().item()  # renormalised after top-k: e^5/(e^5+e^4) = 0.731
    assert abs(p0 - 0.731) < 0.03


# ---------------------------------------------------------------------------------------------
# More sampler behaviour
# ---------------------------------------------------------------------------------------------


def test_sampler_prepare_semantics():
    sampler = Sampler(torch.device("cpu"), vocab_size=6)
    # temperature 0.8 with top_k=1 is greedy too
    assert sampler.prepare(_batch([SamplingParams(), SamplingParams(temperature=0.8, top_k=1)])).temperatures is None
    args = sampler.prepare(_batch([SamplingParams(), SamplingParams(temperature=0.7)]))
    assert args.temperatures.tolist() == pytest.approx([MIN_T, 0.7])  # greedy: a tiny temperature
    assert args.top_k is None and args.top_p is None and args.min_p is None  # nobody filters
    args = sampler.prepare(_batch([SamplingParams(temperature=1.0, top_k=-1), SamplingParams(temperature=1.0, top_k=3)]))
    assert args.top_k.tolist() == [6, 3]  # -1 becomes the vocabulary size
    args = sampler.prepare(_batch([SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=1.0)]))
    assert args.top_p.tolist() == pytest.approx([0.9, 1.0]) and args.top_k is None


@pytest.mark.usefixtures("one_thread")
def test_sampler_top_k_then_top_p():
    """top-k first, then top-p over the renormalised remainder. logits [5, 4, 3, 0, 0, 0]:
    after top_k=2 the runner-up is preceded by e^5/(e^5+e^4) = 0.731 >= 0.7, so top_p=0.7 drops it.
    (Over the full distribution it would be preceded by only 0.656 and survive.)"""
    sampler = Sampler(torch.device("cpu"), vocab_size=6)
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0, 0.0, 0.0]] * 2)
    args = sampler.prepare(
        _batch([SamplingParams(temperature=1.0, top_k=2, top_p=0.7), SamplingParams(temperature=1.0, top_k=2, top_p=0.75)])
    )
    torch.manual_seed(0)
    draws = torch.stack([sampler.sample(logits, args) for _ in range(300)])
    assert set(draws[:, 0].tolist()) == {0}
    assert set(draws[:, 1].tolist()) == {0, 1}  # 0.731 < 0.75: both survive


@pytest.mark.usefixtures("one_thread")
def test_sampler_min_p():
    """min_p keeps tokens with p >= min_p * p_max of the tempered distribution; the survivors
    are drawn with their renormalised probabilities; requests without min_p are unaffected."""
    sampler = Sampler(torch.device("cpu"), vocab_size=6)
    row = [2.0, 1.5, 1.0, 0.0, -0.5, -3.0]
    logits = torch.tensor([row] * 4)
    params = [
        SamplingParams(temperature=1.0, min_p=0.1),
        SamplingParams(temperature=1.0),
        SamplingParams(),  # greedy
        SamplingParams(temperature=2.0, min_p=0.5),
    ]
    args = sampler.prepare(_batch(params))
    assert args.min_p is not None and args.min_p.tolist() == pytest.approx([0.1, 0.0, 0.0, 0.5])
    n = 4000
    torch.manual_seed(0)
    draws = torch.stack([sampler.sample(logits, args) for _ in range(n)])

    def freqs(col):
        return torch.bincount(draws[:, col], minlength=6).float() / n

    for col, p in ((0, params[0]), (3, params[3])):
        probs = torch.softmax(torch.tensor(row) / p.temperature, dim=-1)
        keep = probs >= p.min_p * probs.max()
        assert 1 <= keep.sum() < 6  # the filter removes something
        expected = torch.where(keep, probs, torch.zeros_like(probs))
        expected = expected / expected.sum()
        got = freqs(col)
        assert (got[~keep] == 0).all(), f"row {col}: tokens below min_p*p_max were drawn: {got}"
        assert (got - expected).abs().max().item() < 0.03, f"row {col}: {got} vs {expected}"
    # without min_p the low-probability tokens do appear (token 4 has p ~0.037)
    assert freqs(1)[4] > 0.02
    assert set(draws[:, 2].tolist()) == {0}


# ---------------------------------------------------------------------------------------------
# Engine behaviour
# ---------------------------------------------------------------------------------------------


def test_forward_batch_output_contract(tiny_model_dir):
    prompts = random_prompts([6, 3, 10], seed=3)
    with running_engine(tiny_model_dir("llama")) as engine:
        alloc = PageAllocator(engine)
        reqs = []
        for row, ids in enumerate(prompts):
            alloc.allocate(row, len(ids) + 2)
            reqs.append(make_req(ids, row, output_len=2))
        batch = prepare_batch(engine, reqs, "prefill")
        out = engine.forward_batch(batch, engine.sampler.prepare(batch))
        # complete_one ran for every request before sampling: the prompt is cached, one more on the way
        assert [(r.cached_len, r.device_len) for r in reqs] == [(len(p), len(p) + 1) for p in prompts]
        assert out.next_tokens_gpu.device == engine.device
        assert out.next_tokens_gpu.dtype == torch.int32 and out.next_tokens_gpu.shape == (3,)
        out.copy_done_event.synchronize()
        assert out.next_tokens_cpu.device.type == "cpu"
        assert torch.equal(out.next_tokens_cpu, out.next_tokens_gpu.cpu())
        # the sampled tokens are the argmax of the model's logits (all requests are greedy)
        fresh = [make_req(ids, row, output_len=1) for row, ids in enumerate(prompts)]
        assert torch.equal(out.next_tokens_cpu.long(), prefill_logits(engine, fresh).argmax(-1))


def test_mixed_batch_greedy_rows_match_hf(tiny_model_dir, hf_oracle):
    """Greedy and sampled requests in one batch: the greedy rows still equal HF's greedy
    output, and the sampled row (top_k=5) only ever picks one of HF's 5 best tokens."""
    hf = hf_oracle("qwen2")
    prompts = random_prompts([7, 11, 4], seed=4)
    params = [SamplingParams(), SamplingParams(temperature=1.5, top_k=5), SamplingParams(temperature=0.9, top_k=1)]
    steps = 12
    with running_engine(tiny_model_dir("qwen2")) as engine:
        alloc = PageAllocator(engine)
        reqs = []
        for row, (ids, p) in enumerate(zip(prompts, params)):
            alloc.allocate(row, len(ids) + steps)
            reqs.append(make_req(ids, row, output_len=steps, params=p))
        outs = run_generation(engine, reqs, steps)
    for i in (0, 2):
        ref, ref_logits = hf.greedy(prompts[i], steps)
        assert assert_greedy_match(outs[i], ref, ref_logits, label=f"greedy row {i}") == steps
    seq = prompts[1] + outs[1]
    hf_logits = hf.logits(seq)[len(prompts[1]) - 1 : -1]
    for j, tok in enumerate(outs[1]):
        top5 = hf_logits[j].topk(5).indices.tolist()
        assert tok in top5, f"sampled token {j} = {tok} is not in HF's top-5 {top5}"
    assert len(set(outs[1])) > 1


def test_dummy_weights(tiny_model_dir, tmp_path):
    """use_dummy_weight builds and runs without reading any weight file."""
    path = tmp_path / "no_weights"
    shutil.copytree(tiny_model_dir("qwen3_moe"), path)
    (path / "model.safetensors").unlink()
    ids = random_prompts([6], seed=10)[0]
    with running_engine(path, use_dummy_weight=True) as engine:
        PageAllocator(engine).allocate(0, len(ids) + 4)
        out = run_generation(engine, [make_req(ids, 0, output_len=4)], 4)[0]
        assert all(0 <= t < 256 for t in out)
        assert all(not p.is_meta for p in engine.model.parameters())


def test_kv_pool_and_page_table_layout(tiny_model_dir):
    # tiny llama: 3 layers, 2 kv heads, head_dim 16
    with running_engine(tiny_model_dir("llama"), page_size=4, max_running_req=3, max_seq_len=40, num_pages=50) as engine:
        assert engine.num_pages == 50
        assert tuple(engine.kv_cache.buffer.shape) == (2, 3, 51 * 4, 2, 16)  # +1 page for the dummy request
        assert tuple(engine.page_table.shape) == (4, 64)  # +1 dummy row, width align32(40)
        assert engine.page_table.dtype == torch.int32
        assert (engine.page_table[3] == 50 * 4).all()  # the dummy row points at the dummy page
        assert engine.dummy_req.table_idx == 3
        assert engine.max_seq_len == 40
        assert get_global_ctx() is engine.ctx and engine.ctx.kv_cache is engine.kv_cache


def test_warmup_prefill_touches_only_the_dummy_page(tiny_model_dir):
    """The init-time warm-up prefill (which compiles the prefill kernels before the first request)
    writes K/V to the dummy slot only: real pages and the page table stay as they were."""
    with running_engine(tiny_model_dir("llama"), page_size=4, max_running_req=3, max_seq_len=40, num_pages=50) as engine:
        dummy_slot = 50 * 4
        pool = engine.kv_cache.buffer
        assert pool[:, :, dummy_slot].abs().sum() > 0  # the warm-up ran and stored K/V there
        assert not pool[:, :, :dummy_slot].any() and not pool[:, :, dummy_slot + 1 :].any()
        assert not engine.page_table[:3].any() and (engine.page_table[3] == dummy_slot).all()


def test_engine_built_and_shut_down_twice(tiny_model_dir, hf_oracle):
    ids = random_prompts([12], seed=5)[0]

    def logits_of(name):
        with running_engine(tiny_model_dir(name)) as engine:
            PageAllocator(engine).allocate(0, len(ids) + 1)
            out = prefill_logits(engine, [make_req(ids, 0, output_len=1)])[0]
        # shutdown freed the global state
        with pytest.raises(AssertionError, match="no global Context"):
            get_global_ctx()
        assert try_get_tp_info() is None
        return out

    first, second = logits_of("llama"), logits_of("llama")
    assert torch.equal(first, second)
    other = logits_of("qwen3")  # a different model after the first
    assert (other - hf_oracle("qwen3").logits(ids)[-1]).abs().max().item() < LOGIT_ATOL
    assert (first - hf_oracle("llama").logits(ids)[-1]).abs().max().item() < LOGIT_ATOL


def test_second_engine_needs_shutdown_of_the_first(tiny_model_dir):
    ids = random_prompts([5], seed=6)[0]
    with running_engine(tiny_model_dir("llama")) as engine:
        PageAllocator(engine).allocate(0, 8)
        before = prefill_logits(engine, [make_req(ids, 0, output_len=1)])
        with pytest.raises(AssertionError, match="shut the previous Engine down"):
            Engine(engine_config(tiny_model_dir("qwen2")))
        # the first engine is untouched and still works
        assert get_global_ctx() is engine.ctx
        after = prefill_logits(engine, [make_req(ids, 0, output_len=1)])
        assert torch.equal(before, after)


def test_page_budget_formula(tiny_model_dir, monkeypatch):
    """num_pages = (memory_ratio * free_before_load - model_bytes) // bytes_per_page; on CPU
    capped by cpu_kv_cache_bytes; num_page_override wins; <= 1 page is an error. (None: no
    window pool, the model has no sliding layers; tests/test_window_pages.py sizes those.)"""
    gib = 1 << 30
    with running_engine(tiny_model_dir("llama"), page_size=4) as engine:
        per_page = 2 * 16 * 2 * 4 * 4 * 3  # K+V * head_dim * kv_heads * page_size * fp32 bytes * layers
        free_before, model_bytes = 10 * gib, 3 * gib
        monkeypatch.setattr(engine, "_sync_get_memory", lambda: (64 * gib, free_before - model_bytes))
        cfg = dataclasses.replace(engine.config, num_page_override=None, memory_ratio=0.5, cpu_kv_cache_bytes=1 << 62)
        assert engine._determine_num_pages(free_before, cfg) == ((5 * gib - 3 * gib) // per_page, None)

        cfg = dataclasses.replace(cfg, memory_ratio=0.9)
        assert engine._determine_num_pages(free_before, cfg) == ((int(0.9 * free_before) - model_bytes) // per_page, None)

        capped = dataclasses.replace(cfg, cpu_kv_cache_bytes=100 * per_page + 7)
        if TEST_DEVICE == "cpu":
            assert engine._determine_num_pages(free_before, capped) == (100, None)
        else:  # the cap is for host memory only
            assert engine._determine_num_pages(free_before, capped) == ((int(0.9 * free_before) - model_bytes) // per_page, None)

        def no_memory_reading():
            raise AssertionError("memory must not be read when num_page_override is set")

        monkeypatch.setattr(engine, "_sync_get_memory", no_memory_reading)
        assert engine._determine_num_pages(free_before, dataclasses.replace(cfg, num_page_override=7)) == (7, None)

        # the model took nearly everything: not even two pages left
        monkeypatch.setattr(engine, "_sync_get_memory", lambda: (64 * gib, 2 * gib - per_page))
        with pytest.raises(ValueError, match="KV cache"):
            engine._determine_num_pages(4 * gib, dataclasses.replace(cfg, memory_ratio=0.5))


@pytest.mark.skipif(TEST_DEVICE != "cpu", reason="the host-memory cap applies to CPU engines only")
def test_cpu_kv_cache_cap_on_a_real_engine(tiny_model_dir):
    per_page = 2 * 16 * 2 * 1 * 4 * 3
    cfg = dataclasses.replace(engine_config(tiny_model_dir("llama")), num_page_override=None, cpu_kv_cache_bytes=1 << 20)
    engine = Engine(cfg)
    try:
        assert engine.num_pages == (1 << 20) // per_page
        assert engine.kv_cache.nbytes == (engine.num_pages + 1) * per_page
    finally:
        engine.shutdown()


# ---------------------------------------------------------------------------------------------
# Bad input: each a clear exception that names the problem
# ---------------------------------------------------------------------------------------------


def _copy_model(tiny_model_dir, tmp_path, name="llama"):
    dst = tmp_path / f"{name}_copy"
    shutil.copytree(tiny_model_dir(name), dst)
    return dst


def _assert_engine_still_buildable(tiny_model_dir):
    assert minisgl.core._GLOBAL_CTX is None, "a failed Engine left its global Context behind"
    with running_engine(tiny_model_dir("llama")) as engine:
        assert engine.num_pages > 1


@pytest.mark.parametrize("architectures", [["FancyNewForCausalLM"], None])
def test_unknown_architecture(tiny_model_dir, tmp_path, architectures):
    path = _copy_model(tiny_model_dir, tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    if architectures is None:
        del cfg["architectures"]
    else:
        cfg["architectures"] = architectures
    (path / "config.json").write_text(json.dumps(cfg))
    match = "FancyNewForCausalLM" if architectures else "architectures"
    with pytest.raises(ValueError, match=match):
        Engine(engine_config(path))
    _assert_engine_still_buildable(tiny_model_dir)


@pytest.mark.parametrize(
    "drop, match",
    [
        ("model.layers.1.mlp.down_proj.weight", r"missing weights: model\.layers\.1\.mlp\.down_proj\.weight"),
        ("model.layers.0.self_attn.k_proj.weight", r"missing parts of model\.layers\.0\.self_attn\.qkv_proj"),
        ("model.embed_tokens.weight", r"missing weights: .*model\.embed_tokens\.weight"),
    ],
)
def test_missing_weight(tiny_model_dir, tmp_path, drop, match):
    from safetensors.torch import load_file, save_file

    path = _copy_model(tiny_model_dir, tmp_path)
    state = load_file(str(path / "model.safetensors"))
    del state[drop]
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=match):
        Engine(engine_config(path))
    _assert_engine_still_buildable(tiny_model_dir)


def test_no_safetensors_file(tiny_model_dir, tmp_path):
    path = _copy_model(tiny_model_dir, tmp_path)
    (path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        Engine(engine_config(path))
    _assert_engine_still_buildable(tiny_model_dir)


def test_too_few_pages(tiny_model_dir):
    with pytest.raises(ValueError, match="num_pages=1"):
        Engine(engine_config(tiny_model_dir("llama"), num_pages=1))
    _assert_engine_still_buildable(tiny_model_dir)


def test_prompt_longer_than_max_seq_len(tiny_model_dir):
    ids = random_prompts([40], seed=8)[0]
    with running_engine(tiny_model_dir("llama"), max_seq_len=32) as engine:
        assert engine.max_seq_len == 32
        PageAllocator(engine).allocate(0, 32)
        req = make_req(ids, 0, output_len=4)
        batch = prepare_batch(engine, [req], "prefill")
        with pytest.raises(ValueError, match=r"40 tokens.*max_seq_len=32"):
            engine.forward_batch(batch, engine.sampler.prepare(batch))
        assert (req.cached_len, req.device_len) == (0, 40)  # the request was not advanced


def test_mixed_graph_token_buckets():
    """The captured token counts of prefill/mixed-step graphs: sorted, ending at the bound, and a
    padded step computes at most 25% more rows past 256 tokens; small devices capture less."""
    from minisgl.engine.mixed_graph import default_max_tokens, token_buckets

    b = token_buckets(2048)
    assert b[0] == 32 and b[-1] == 2048 and b == sorted(set(b))
    assert all(hi <= 1.25 * lo for lo, hi in zip(b, b[1:]) if lo >= 256)
    assert token_buckets(100) == [32, 64, 100] and token_buckets(0) == []
    assert default_max_tokens(80 << 30) == 2048 and default_max_tokens(8 << 30) == 512


def test_auto_attention_backend_prefers_triton_then_flashinfer(monkeypatch):
    """'auto' on CUDA: triton when it imports (the faster backend measured on the H200), else
    FlashInfer, else the torch reference; on a CPU always torch. Explicit names are validated."""
    import sys
    import types

    from minisgl.attention.registry import resolve_attention_backend

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.setitem(sys.modules, "flashinfer", types.ModuleType("flashinfer"))
    monkeypatch.setitem(sys.modules, "triton", types.ModuleType("triton"))
    assert resolve_attention_backend("auto", cuda) == "triton"
    assert resolve_attention_backend("auto", cpu) == "cpu"
    assert resolve_attention_backend("flashinfer", cuda) == "flashinfer"
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton now raises ImportError
    assert resolve_attention_backend("auto", cuda) == "flashinfer"
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    assert resolve_attention_backend("auto", cuda) == "torch"
    with pytest.raises(ValueError, match="unknown attention backend .flashinfr."):
        resolve_attention_backend("flashinfr", cuda)


def test_step_runners_are_listed_once_and_tried_in_order(tiny_model_dir):
    """Engine.forward_batch runs a step on the first runner of its list that accepts it; the
    module path is last and accepts every batch. A runner put first takes the steps it accepts."""
    from minisgl.engine.graph import GraphRunner
    from minisgl.engine.runners import ModuleRunner

    with running_engine(tiny_model_dir("llama")) as engine:
        kinds = [type(r) for r in engine.runners]
        assert kinds[0] is GraphRunner and kinds[-1] is ModuleRunner
        assert (engine.cpu_runner in engine.runners) == (engine.cpu_runner is not None)
        alloc = PageAllocator(engine)
        req = make_req([1, 2, 3], 0, output_len=2)
        alloc.allocate(0, 5)
        batch = prepare_batch(engine, [req], "prefill")
        engine.forward_batch(batch, engine.sampler.prepare(batch))  # a prefill: not the fake's

        class Fake:
            seen: list = []

            def can_run(self, batch):
                return batch.is_decode

            def run(self, batch):
                self.seen.append(batch.size)
                logits = torch.full((batch.padded_size, engine.config.model_config.vocab_size), -1.0, device=engine.device)
                logits[:, 7] = 1.0
                return logits

        engine.runners.insert(0, Fake())
        batch = prepare_batch(engine, [req], "decode")
        out = engine.forward_batch(batch, engine.sampler.prepare(batch))
        assert Fake.seen == [1] and out.next_tokens_cpu.tolist() == [7]


def test_cpu_decode_loop_leaves_prompt_logprob_steps_to_the_module_path(tiny_model_dir):
    """The C decode loop is a step runner of the engine's list; it takes decode steps only, and
    never a step that asks for prompt logprobs (it yields the last rows' logits alone)."""
    from minisgl.engine.cpu_decode import CpuDecodeLoop
    from minisgl.engine.runners import ModuleRunner, pick_runner

    with running_engine(tiny_model_dir("llama"), dtype=torch.bfloat16, max_running_req=2) as engine:
        loop = engine.cpu_runner
        if loop is None:
            pytest.skip("no C decode loop here (no C compiler or no AVX512-BF16)")
        assert isinstance(loop, CpuDecodeLoop) and loop in engine.runners
        alloc = PageAllocator(engine)
        req = make_req([1, 2, 3], 0, output_len=2)
        alloc.allocate(0, 5)
        prefill = prepare_batch(engine, [req], "prefill")
        assert isinstance(pick_runner(engine.runners, prefill), ModuleRunner)
        prefill.prompt_logprob_rows = torch.zeros(1, dtype=torch.long)
        assert isinstance(pick_runner(engine.runners, prefill), ModuleRunner)
        decode = prepare_batch(engine, [make_req([1, 2, 3, 4], 0, output_len=2, cached_len=3)], "decode")
        assert pick_runner(engine.runners, decode) is loop


def test_rotary_tables_are_shared_within_a_model_and_owned_by_it(tiny_model_dir):
    """One cos/sin table per model on its device, shared by every layer; no process-wide cache
    holds it after the build (so Engine.shutdown has nothing to clear)."""
    from minisgl.layers import rotary

    with running_engine(tiny_model_dir("llama")) as engine:
        ropes = {id(layer.self_attn.attn.rotary) for layer in engine.model.model.layers}
        rope = engine.model.model.layers[0].self_attn.attn.rotary
        assert len(ropes) == 1 and rope.cos.device == engine.device
        assert rotary._BUILDS == []


def test_backend_capabilities_come_with_their_hooks():
    """A backend declares what it can do in one enum; each capability names the hooks the graph
    runners call, and a backend that declares it implements them (the rest need none)."""
    import importlib

    from minisgl.attention.base import AttnCap, DecodeGraphHooks, MixedGraphHooks
    from minisgl.moe.base import MoeCap

    hooks = {AttnCap.DECODE_GRAPH: DecodeGraphHooks, AttnCap.MIXED_GRAPH: MixedGraphHooks}
    checked = []
    for module, name in (
        ("torch_backend", "TorchAttnBackend"),
        ("deterministic_backend", "DeterministicAttnBackend"),
        ("triton_backend", "TritonAttnBackend"),
        ("flashinfer_backend", "FlashInferAttnBackend"),
    ):
        try:
            cls = getattr(importlib.import_module(f"minisgl.attention.{module}"), name)
        except ImportError:  # triton / flashinfer not installed here
            continue
        checked.append(name)
        for cap, proto in hooks.items():
            wanted = [m for m in vars(proto) if not m.startswith("_")]
            assert wanted
            if cap in cls.caps:
                assert all(callable(getattr(cls, m, None)) for m in wanted), (name, cap)
    assert "TorchAttnBackend" in checked
    from minisgl.moe.torch_moe import TorchMoeBackend

    assert TorchMoeBackend.caps == MoeCap.NONE  # its routing reads expert counts on the host
