"""The offline LLM API end to end on a tiny random model (float32) and the embedded model:
batch invariance against single requests and HF generate, chunked prefill, overlap on/off,
radix vs naive prefix cache (hits, eviction, page_size > 1), seeded sampling, stop conditions,
bad input, penalties and logprobs. Every LLM is checked for leaked pages and rows on exit
(sched_helpers.running_llm)."""

from __future__ import annotations

import json
import random
import shutil
from collections import Counter
from typing import List

import pytest
import torch
from sched_helpers import (
    TINY,
    WORKLOAD,
    assert_greedy_consistent,
    assert_idle_and_clean,
    assert_match_ref,
    assert_same_tokens,
    check_workload,
    greedy,
    hf_generate,
    running_llm,
    teacher_forced_logits,
)

from minisgl.core import SamplingParams
from minisgl.scheduler.config import SchedulerConfig

PROMPTS, MAX_TOKENS = WORKLOAD


@pytest.fixture(scope="module")
def oracle(hf_oracle):
    return hf_oracle(TINY)


def _params(max_tokens: List[int], **kw) -> List[SamplingParams]:
    return [greedy(n, **kw) for n in max_tokens]


# ---------------------------------------------------------------------------------------------
# Batch invariance, chunked prefill, overlap
# ---------------------------------------------------------------------------------------------


def test_batch_invariance_matches_single_requests_and_hf(tiny_dir, refs):
    """32 requests of different lengths and max_tokens in one generate() == each alone == HF."""
    assert len(PROMPTS) >= 32 and len(set(map(len, PROMPTS))) > 16 and len(set(MAX_TOKENS)) > 10
    with running_llm(tiny_dir) as llm:
        batched = llm.generate(PROMPTS, _params(MAX_TOKENS))
        check_workload(batched, refs, PROMPTS, MAX_TOKENS, "batched")
        assert llm.scheduler.stats().generated_tokens == sum(MAX_TOKENS)
        for i, (p, n) in enumerate(zip(PROMPTS, MAX_TOKENS)):
            llm.scheduler.reset_prefix_cache()  # alone means alone: no KV reused from the batch
            [alone] = llm.generate([p], greedy(n))
            ref, scores = refs.get(p, n)
            assert_match_ref(alone.token_ids, ref, scores, f"alone request {i}")
            assert_match_ref(batched[i].token_ids, alone.token_ids, scores, f"batched vs alone request {i}")


@pytest.mark.parametrize("page_size", [1, 4])
def test_chunked_prefill_tiny_budget(tiny_dir, refs, page_size):
    """max_extend_tokens=16: every prompt longer than 16 tokens is prefilled in chunks, several
    prompts share one chunk budget, and decode steps interleave with the chunks."""
    prompts, max_tokens = PROMPTS[:20], MAX_TOKENS[:20]
    with running_llm(tiny_dir, max_extend_tokens=16, page_size=page_size, cache_type="naive") as llm:
        sched = llm.scheduler
        seen: List[int] = []
        forward = sched.engine.forward_batch

        def spy(batch, args):
            if batch.is_prefill:  # the budget covers the decode rows mixed in too
                assert sum(r.extend_len for r in batch.reqs) <= 16
                seen.append(sum(r.extend_len for r in batch.reqs if r.cached_len < r.prefill_len))
            return forward(batch, args)

        sched.engine.forward_batch = spy  # type: ignore[method-assign]
        results = llm.generate(prompts, _params(max_tokens))
        check_workload(results, refs, prompts, max_tokens, f"chunked page_size={page_size}")
    assert seen and max(seen) <= 16, seen
    assert sum(seen) == sum(len(p) for p in prompts)  # naive cache: every prompt token computed once
    assert len(seen) >= sum(len(p) for p in prompts) // 16


@pytest.mark.parametrize("overlap", [True, False])
def test_overlap_on_and_off(tiny_dir, refs, overlap):
    with running_llm(tiny_dir, enable_overlap=overlap) as llm:
        assert llm.scheduler.overlap is overlap
        results = llm.generate(PROMPTS, _params(MAX_TOKENS))
        check_workload(results, refs, PROMPTS, MAX_TOKENS, f"overlap={overlap}")


def test_overlap_default_follows_the_device(tiny_dir, monkeypatch):
    """Unset, overlap is on for CUDA and off on a CPU, where the forward runs inside the launch
    and a one-step lag would only delay each token; an explicit choice wins either way."""
    monkeypatch.delenv("MINISGL_DISABLE_OVERLAP_SCHEDULING", raising=False)
    with running_llm(tiny_dir) as llm:
        assert llm.scheduler.overlap is (llm.scheduler.device.type != "cpu")
    with running_llm(tiny_dir, enable_overlap=True) as llm:
        assert llm.scheduler.overlap is True


def test_overlap_env_switch(tiny_dir, refs, monkeypatch):
    cfg = dict(model_path=str(tiny_dir), tp_info=None, dtype=torch.float32)
    monkeypatch.delenv("MINISGL_DISABLE_OVERLAP_SCHEDULING", raising=False)
    assert SchedulerConfig(**cfg).overlap is True
    monkeypatch.setenv("MINISGL_DISABLE_OVERLAP_SCHEDULING", "1")
    assert SchedulerConfig(**cfg).overlap is False
    assert SchedulerConfig(**cfg, enable_overlap=True).overlap is True  # an explicit choice wins
    prompts, max_tokens = PROMPTS[:12], MAX_TOKENS[:12]
    with running_llm(tiny_dir) as llm:
        assert llm.scheduler.overlap is False
        results = llm.generate(prompts, _params(max_tokens))
        check_workload(results, refs, prompts, max_tokens, "MINISGL_DISABLE_OVERLAP_SCHEDULING=1")


# ---------------------------------------------------------------------------------------------
# Prefix cache
# ---------------------------------------------------------------------------------------------


def _shared_prefix_prompts(seed: int, n_groups: int = 3, per_group: int = 5) -> List[List[int]]:
    """Groups of prompts sharing a long prefix (with a nested shared sub-prefix inside each
    group), plus one prompt that is exactly a group's prefix."""
    rng = random.Random(seed)
    prompts: List[List[int]] = []
    for _ in range(n_groups):
        prefix = [rng.randrange(256) for _ in range(rng.randint(33, 50))]
        sub = prefix + [rng.randrange(256) for _ in range(7)]
        prompts.append(list(prefix))
        for j in range(per_group):
            base = sub if j % 2 else prefix
            prompts.append(base + [rng.randrange(256) for _ in range(rng.randint(1, 12))])
    rng.shuffle(prompts)
    return prompts


@pytest.mark.parametrize("page_size", [1, 4])
def test_radix_and_naive_identical_with_hits(tiny_dir, oracle, page_size):
    prompts = _shared_prefix_prompts(seed=page_size)
    max_tokens = [random.Random(i).randint(4, 16) for i in range(len(prompts))]
    params = _params(max_tokens)
    with running_llm(tiny_dir, cache_type="naive", page_size=page_size) as llm:
        naive = llm.generate(prompts, params)
        assert llm.scheduler.stats().cache_hit_tokens == 0
    with running_llm(tiny_dir, cache_type="radix", page_size=page_size, max_running_req=4) as llm:
        # max_running_req=4: later requests are admitted after earlier ones finished and were cached
        first = llm.generate(prompts, params)
        hits_first = llm.scheduler.stats().cache_hit_tokens
        again = llm.generate(prompts, params)  # everything but the last token of each prompt is cached
        stats = llm.scheduler.stats()
    assert hits_first > 0, "requests sharing prefixes produced no cache hits"
    assert any(r.cached_tokens > 0 for r in first)
    assert all(r.cached_tokens % page_size == 0 for r in first + again)
    hits_again = stats.cache_hit_tokens - hits_first
    assert hits_again >= sum((len(p) - 1) // page_size * page_size for p in prompts), (hits_again, page_size)
    assert all(r.cached_tokens == (len(p) - 1) // page_size * page_size for r, p in zip(again, prompts))
    for i, p in enumerate(prompts):
        logits = assert_greedy_consistent(oracle, p, naive[i].token_ids, f"naive request {i}")
        assert_same_tokens(naive[i].token_ids, first[i].token_ids, logits, f"radix (cold) request {i}")
        assert_same_tokens(naive[i].token_ids, again[i].token_ids, logits, f"radix (warm) request {i}")
        assert naive[i].cached_tokens == 0


@pytest.mark.parametrize("page_size", [1, 4])
def test_radix_eviction_under_small_pool(tiny_dir, oracle, page_size):
    """A pool of 160 token slots: rounds of prefix-sharing prompts force LRU eviction of cached
    pages; outputs stay identical to the naive cache."""
    rounds = [_shared_prefix_prompts(seed=10 + r, n_groups=2, per_group=3) for r in range(3)]
    max_tokens = [8] * len(rounds[0])
    pool = dict(num_page_override=160 // page_size, max_running_req=4, page_size=page_size)
    with running_llm(tiny_dir, cache_type="naive", **pool) as llm:
        naive = [llm.generate(p, _params(max_tokens)) for p in rounds]
    with running_llm(tiny_dir, cache_type="radix", **pool) as llm:
        sched = llm.scheduler
        radix = []
        for prompts in rounds:
            radix.append(llm.generate(prompts, _params(max_tokens)))
            assert sched.stats().cached_pages <= sched.stats().total_pages
            sched.check_invariants()
        hits = sched.stats().cache_hit_tokens
        # round 0's prompts were evicted to make room for rounds 1 and 2
        match = sched.cache.match_prefix(rounds[0][0])
        assert match.num_pages * page_size < len(rounds[0][0]) - page_size
        sched.cache.unlock(match.handle)
    assert hits > 0
    for r, prompts in enumerate(rounds):
        for i, p in enumerate(prompts):
            logits = teacher_forced_logits(oracle, p, naive[r][i].token_ids)
            assert_same_tokens(naive[r][i].token_ids, radix[r][i].token_ids, logits, f"round {r} request {i}")


# ---------------------------------------------------------------------------------------------
# Sampling
# ---------------------------------------------------------------------------------------------


def test_seeded_sampling_reproducible_and_greedy_exact(tiny_dir, refs):
    sampled = [
        SamplingParams(temperature=1.0, seed=11, max_tokens=16),
        SamplingParams(temperature=0.7, top_k=40, top_p=0.9, seed=12, max_tokens=12),
        SamplingParams(temperature=1.3, min_p=0.05, seed=13, max_tokens=16),
    ]
    sp_prompts = PROMPTS[:3]
    gr_prompts, gr_max = PROMPTS[3:9], MAX_TOKENS[3:9]
    with running_llm(tiny_dir) as llm:
        run1 = llm.generate(sp_prompts + gr_prompts, sampled + _params(gr_max))
        run2 = llm.generate(sp_prompts + gr_prompts, sampled + _params(gr_max))
        alone = [llm.generate([p], sp)[0] for p, sp in zip(sp_prompts, sampled)]
        # another composition and order: sampled requests mixed into the big workload
        mixed_prompts = PROMPTS[10:] + sp_prompts[::-1]
        mixed = llm.generate(mixed_prompts, _params(MAX_TOKENS[10:]) + sampled[::-1])
        other_seed = llm.generate(sp_prompts[0], SamplingParams(temperature=1.0, seed=99, max_tokens=16))[0]
    with running_llm(tiny_dir, enable_overlap=False) as llm:
        no_overlap = llm.generate(sp_prompts, sampled)
    for i in range(3):
        toks = run1[i].token_ids
        assert len(toks) == sampled[i].max_tokens
        assert run2[i].token_ids == toks, f"seeded request {i} not reproducible across runs"
        assert alone[i].token_ids == toks, f"seeded request {i} depends on the batch"
        assert mixed[len(mixed) - 1 - i].token_ids == toks, f"seeded request {i} depends on batch order"
        assert no_overlap[i].token_ids == toks, f"seeded request {i} differs without overlap"
    greedy0, _ = refs.get(sp_prompts[0], 16)
    assert run1[0].token_ids != greedy0, "temperature 1.0 sampled exactly the greedy sequence"
    assert other_seed.token_ids != run1[0].token_ids, "a different seed gave the same sample"
    check_workload(run1[3:], refs, gr_prompts, gr_max, "greedy in a mixed batch")
    check_workload(mixed[:-3], refs, PROMPTS[10:], MAX_TOKENS[10:], "greedy in a mixed batch (2)")


# ---------------------------------------------------------------------------------------------
# Stop conditions
# ---------------------------------------------------------------------------------------------


def _first_repeat_free_token(refs, prompts, n):
    """A token that appears in some greedy output at index >= 2 and not before it."""
    for p in prompts:
        ref, _ = refs.get(p, n)
        for k in range(2, n - 2):
            if ref[k] not in ref[:k]:
                return ref[k]
    raise AssertionError("no suitable stop token in the references")


def _expected_until(ref: List[int], stops) -> tuple:
    for k, t in enumerate(ref):
        if t in stops:
            return ref[: k + 1], "stop"
    return ref, "length"


def test_stop_token_ids_and_max_tokens(tiny_dir, refs):
    prompts = PROMPTS[:16]
    n = 20
    stop = _first_repeat_free_token(refs, prompts, n)
    with running_llm(tiny_dir) as llm:
        results = llm.generate(prompts, [greedy(n, stop_token_ids=[stop]), greedy(n)] * 8)
    stopped = 0
    for i, (p, res) in enumerate(zip(prompts, results)):
        ref, scores = refs.get(p, n)
        expect, reason = _expected_until(ref, {stop}) if i % 2 == 0 else (ref, "length")
        assert_match_ref(res.token_ids, expect, scores, f"request {i}")
        assert res.finish_reason == reason and res.completion_tokens == len(expect)
        stopped += reason == "stop"
    assert stopped >= 1


def test_eos_and_ignore_eos(tiny_dir, refs, tmp_path):
    """EOS from config.json and from generation_config.json both stop a request (the EOS token
    is returned, finish_reason "stop"); ignore_eos runs to max_tokens."""
    prompts = PROMPTS[:16]
    n = 20
    eos1 = _first_repeat_free_token(refs, prompts, n)
    eos2 = _first_repeat_free_token(refs, prompts[::-1], n)
    model = shutil.copytree(tiny_dir, tmp_path / "with_eos")
    cfg = json.loads((model / "config.json").read_text())
    cfg["eos_token_id"] = eos1
    (model / "config.json").write_text(json.dumps(cfg))
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos1, eos2]}))
    with running_llm(model) as llm:
        assert {eos1, eos2} <= llm.scheduler.eos_ids
        results = llm.generate(prompts, [greedy(n), greedy(n, ignore_eos=True)] * 8)
    stops = 0
    for i, (p, res) in enumerate(zip(prompts, results)):
        ref, scores = refs.get(p, n)
        expect, reason = _expected_until(ref, {eos1, eos2}) if i % 2 == 0 else (ref, "length")
        assert_match_ref(res.token_ids, expect, scores, f"request {i}")
        assert res.finish_reason == reason, (i, res.finish_reason, reason)
        stops += reason == "stop"
    assert stops >= 1


def test_max_seq_len_stops_with_length(tiny_dir, refs):
    with running_llm(tiny_dir, max_seq_len_override=40) as llm:
        assert llm.scheduler.max_seq_len == 40
        p30 = PROMPTS[1][:30]
        p39 = PROMPTS[1][:39]
        r30, r39 = llm.generate([p30, p39], greedy(100))
        with pytest.raises(ValueError, match="context"):
            llm.generate([PROMPTS[1][:40]], greedy(1))
    assert r30.finish_reason == "length" and r30.completion_tokens == 10
    assert r39.finish_reason == "length" and r39.completion_tokens == 1
    for p, r in ((p30, r30), (p39, r39)):
        ref, scores = refs.get(p, r.completion_tokens)
        assert_match_ref(r.token_ids, ref, scores, f"prompt {len(p)}")


# ---------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------

BAD = [
    ([[]], SamplingParams(max_tokens=4), "prompt 0 is empty"),
    ([[1, 2, 3]], SamplingParams(max_tokens=0), "max_tokens"),
    ([[1, 2, 3]], SamplingParams(max_tokens=-5), "max_tokens"),
    ([[1, 2, 3]], SamplingParams(temperature=-0.1), "temperature"),
    ([[1, 2, 3]], SamplingParams(top_p=0.0), "top_p"),
    ([[1, 2, 3]], SamplingParams(top_p=1.5), "top_p"),
    ([[1, 2, 3]], SamplingParams(top_k=0), "top_k"),
    ([[1, 2, 3]], SamplingParams(presence_penalty=3.0), "presence_penalty"),
    ([[1, 2, 300]], SamplingParams(max_tokens=4), "input_ids"),
    ([list(range(100)) * 2], SamplingParams(max_tokens=4), "context"),  # 200 tokens > 192
    ([[1, 2], [3, 4]], [SamplingParams()], "sampling_params"),
    ([], SamplingParams(), "prompts is empty"),
    (["text"], SamplingParams(), "tokenizer"),  # the tiny model has no tokenizer: token ids only
    ([[1, 2, 3]], SamplingParams(stop=["x"]), "stop strings .* no tokenizer"),
    ([[1, 2, 3]], SamplingParams(stop=[""]), "stop"),
    ([[1, 2, 3]], SamplingParams(stop=["x"] * 17), "stop"),
    ([[1, 2, 3]], SamplingParams(stop=["a\ud800"]), "surrogate"),
    ([[1, 2, 3]], SamplingParams(stop=[7]), "stop"),  # type: ignore[list-item]
]


def test_bad_input_raises_value_error_and_llm_stays_usable(tiny_dir, refs):
    good_p, good_n = PROMPTS[2], MAX_TOKENS[2]
    with running_llm(tiny_dir) as llm:
        for prompts, params, field in BAD:
            with pytest.raises(ValueError, match=field):
                llm.generate(prompts, params)
            assert not llm.scheduler.has_work()
        # one bad request in a batch rejects the batch and queues nothing
        with pytest.raises(ValueError, match="temperature"):
            llm.generate([good_p, good_p], [greedy(good_n), SamplingParams(temperature=-1.0)])
        assert not llm.scheduler.has_work()
        assert_idle_and_clean(llm.scheduler)
        [res] = llm.generate([good_p], greedy(good_n))
        ref, scores = refs.get(good_p, good_n)
        assert_match_ref(res.token_ids, ref, scores, "good request after bad ones")


# ---------------------------------------------------------------------------------------------
# The embedded model (text, chat template, EOS)
# ---------------------------------------------------------------------------------------------


def test_embedded_model_text_and_chat(embedded_model_dir, embedded_oracle, embedded_tokenizer):
    """The embedded SmolLM2-135M in float32: text and chat prompts give HF's greedy tokens
    (compared up to EOS, tie-aware); bad text input raises and the LLM stays usable."""
    from helpers import assert_greedy_match

    tok = embedded_tokenizer
    texts = ["The capital of France is"]
    chat = [{"role": "user", "content": "Name a colour."}]
    n = 8
    with running_llm(embedded_model_dir, max_running_req=4, max_seq_len_override=256, num_page_override=4 * 256 + 16) as llm:
        with pytest.raises(ValueError, match="empty"):
            llm.generate([""], greedy(n))
        results = llm.generate(texts + [chat], greedy(n))
    ids = [tok(t).input_ids for t in texts]
    chat_ids = tok.apply_chat_template(chat, tokenize=True, add_generation_prompt=True)
    chat_ids = list(chat_ids["input_ids"] if hasattr(chat_ids, "keys") else chat_ids)
    eos = llm.scheduler.eos_ids
    for i, (p, res) in enumerate(zip(ids + [chat_ids], results)):
        assert res.prompt_tokens == len(p)
        ref, step_logits = embedded_oracle.greedy(p, n)
        assert_greedy_match(res.token_ids, ref, step_logits, tuple(eos), f"embedded prompt {i}")
        assert res.text == tok.decode(res.token_ids, skip_special_tokens=True)
        assert res.finish_reason in ("stop", "length")
        if res.finish_reason == "stop":
            assert res.token_ids[-1] in eos


def test_stop_strings_trim_the_text_and_free_the_request(embedded_model_dir):
    """SamplingParams.stop offline, as the server trims: the text ends before the first stop
    string (or after it with include_stop_str_in_output), finish_reason "stop", the tokens are a
    prefix of the unstopped run's, and the request's pages are freed (running_llm checks)."""
    prompt, n = "The capital of France is", 24
    with running_llm(embedded_model_dir, max_running_req=4, max_seq_len_override=256, num_page_override=4 * 256 + 16) as llm:
        [full] = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        text = full.text
        stop = text[len(text) // 2 : len(text) // 2 + 3]
        at = text.find(stop)  # the oracle: where the first occurrence starts in the untrimmed text
        cut, kept, one = llm.generate(
            [prompt] * 3,
            [
                SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, stop=["never appears \u2603", stop]),
                SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, stop=[stop], include_stop_str_in_output=True),
                SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, stop=stop),  # one string, not a list
            ],
        )
    assert len(stop) == 3 and at >= 0
    for res in (cut, kept, one):
        assert res.finish_reason == "stop" and res.stop_reason == stop
        assert res.completion_tokens < n and res.token_ids == full.token_ids[: res.completion_tokens]
    assert cut.text == one.text == text[:at]
    assert kept.text == text[: at + len(stop)]
    assert full.finish_reason == "length" and full.stop_reason is None


# ---------------------------------------------------------------------------------------------
# Penalties and logprobs
# ---------------------------------------------------------------------------------------------


def test_repetition_penalty_matches_hf(tiny_dir, oracle, refs):
    prompts = [p for p in PROMPTS if len(p) >= 8][:6]
    n = 20
    plain = [greedy(n) for _ in prompts]
    penal = [greedy(n, repetition_penalty=1.5) for _ in prompts]
    with running_llm(tiny_dir) as llm:
        results = llm.generate(prompts + prompts, penal + plain)  # a mixed batch
    changed = 0
    for i, p in enumerate(prompts):
        ref, scores = hf_generate(oracle, p, n, repetition_penalty=1.5)
        assert_match_ref(results[i].token_ids, ref, scores, f"repetition_penalty request {i}")
        plain_ref, plain_scores = refs.get(p, n)
        assert_match_ref(results[len(prompts) + i].token_ids, plain_ref, plain_scores, f"unpenalised request {i}")
        changed += ref != plain_ref
    assert changed >= 1, "the penalty changed no output: the test proves nothing"


def _hand_penalised_greedy(oracle, prompt, n, presence=0.0, frequency=0.0, repetition=1.0):
    """The reference: HF forward logits, HF-style repetition penalty over prompt + output, then
    OpenAI-style presence/frequency penalties over the output; argmax."""
    out: List[int] = []
    scores = []
    for _ in range(n):
        logits = oracle.logits(prompt + out)[-1].clone()
        seen = torch.tensor(sorted(set(prompt + out)))
        v = logits[seen]
        logits[seen] = torch.where(v > 0, v / repetition, v * repetition)
        for t, c in Counter(out).items():
            logits[t] -= presence + frequency * c
        scores.append(logits)
        out.append(int(logits.argmax()))
    return out, scores


def test_presence_and_frequency_penalties_match_reference(tiny_dir, oracle, refs):
    prompts = [p for p in PROMPTS if len(p) >= 8][:3]
    n = 12
    settings = [
        dict(presence_penalty=1.5),
        dict(frequency_penalty=0.8),
        dict(presence_penalty=-0.5, frequency_penalty=1.0, repetition_penalty=1.2),
    ]
    params = [greedy(n, **s) for s in settings for _ in prompts] + [greedy(n) for _ in prompts]
    with running_llm(tiny_dir) as llm:
        results = llm.generate([p for _ in settings for p in prompts] + prompts, params)
    changed = 0
    for k, s in enumerate(settings):
        for i, p in enumerate(prompts):
            ref, scores = _hand_penalised_greedy(
                oracle,
                p,
                n,
                s.get("presence_penalty", 0.0),
                s.get("frequency_penalty", 0.0),
                s.get("repetition_penalty", 1.0),
            )
            assert_match_ref(results[k * len(prompts) + i].token_ids, ref, scores, f"{s} request {i}")
            changed += ref != refs.get(p, n)[0]
    for i, p in enumerate(prompts):
        ref, scores = refs.get(p, n)
        assert_match_ref(results[len(settings) * len(prompts) + i].token_ids, ref, scores, f"plain request {i}")
    assert changed >= 2, "the penalties barely changed any output: the test proves little"


def test_logprobs_match_hf_log_softmax(tiny_dir, oracle):
    prompts = PROMPTS[4:10]
    n = 10
    params = [
        greedy(n, logprobs=3),
        greedy(n, logprobs=0),
        SamplingParams(temperature=1.0, seed=5, max_tokens=n, logprobs=5),
        greedy(n, logprobs=2, repetition_penalty=1.3),  # logprobs are of the raw distribution
        greedy(n),
        SamplingParams(temperature=0.8, seed=6, max_tokens=n, logprobs=1, top_k=20),
    ]
    with running_llm(tiny_dir) as llm:
        results = llm.generate(prompts, params)
    for i, (p, sp, res) in enumerate(zip(prompts, params, results)):
        if sp.logprobs is None:
            assert res.logprobs is None and res.top_logprobs is None
            continue
        assert len(res.logprobs) == len(res.top_logprobs) == len(res.token_ids) == n
        logp = torch.log_softmax(teacher_forced_logits(oracle, p, res.token_ids), dim=-1)
        for j, t in enumerate(res.token_ids):
            assert abs(res.logprobs[j] - float(logp[j, t])) < 1e-4, (i, j, res.logprobs[j], float(logp[j, t]))
            top = res.top_logprobs[j]
            assert len(top) == sp.logprobs
            vals, ids = logp[j].topk(max(sp.logprobs, 1))
            for r, (tid, lp) in enumerate(top):
                assert abs(lp - float(vals[r])) < 1e-4, (i, j, r, lp, float(vals[r]))
                assert abs(lp - float(logp[j, tid])) < 1e-4, (i, j, r, tid)
            if sp.is_greedy and not sp.has_penalties and top:
                assert top[0][0] == t or abs(top[0][1] - res.logprobs[j]) < 1e-4


@pytest.mark.parametrize("overlap", [True, False])
def test_exception_inside_generate_leaves_llm_usable(tiny_dir, refs, overlap):
    """An error (or Ctrl-C) in the middle of generate() aborts the pending requests, frees their
    pages and rows, and the next generate() gives the same tokens as a fresh LLM."""
    prompts, max_tokens = PROMPTS[:8], MAX_TOKENS[:8]
    with running_llm(tiny_dir, enable_overlap=overlap) as llm:
        forward = llm.scheduler.engine.forward_batch
        calls = [0]

        def failing(batch, args):
            calls[0] += 1
            if calls[0] == 4:
                raise KeyboardInterrupt
            return forward(batch, args)

        llm.scheduler.engine.forward_batch = failing  # type: ignore[method-assign]
        with pytest.raises(KeyboardInterrupt):
            llm.generate(prompts, _params(max_tokens))
        assert not llm.scheduler.has_work()
        llm.scheduler.check_invariants()
        results = llm.generate(prompts, _params(max_tokens))
        check_workload(results, refs, prompts, max_tokens, "after an interrupted generate")
