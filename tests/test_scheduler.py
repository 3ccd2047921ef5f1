"""The Scheduler driven step by step on a tiny random model (float32): overlap lag, abort in
every state, memory pressure (requests wait, nothing is lost), the running-request bound,
decode not starved by chunked prefill, request validation, statistics, and no leaks."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Tuple

import pytest
import torch
from helpers import TEST_ATTENTION_BACKEND, TEST_DEVICE
from sched_helpers import (
    WORKLOAD,
    assert_idle_and_clean,
    assert_match_ref,
    greedy,
    llm_kwargs,
)

from minisgl.core import SamplingParams
from minisgl.distributed import DistributedInfo
from minisgl.llm import LLM
from minisgl.sampling_params import GrammarSpec
from minisgl.scheduler import Scheduler, SchedulerConfig, UserRequest

PROMPTS, MAX_TOKENS = WORKLOAD


@contextmanager
def running_scheduler(model_path: Any, **kw: Any) -> Iterator[Scheduler]:
    kw.setdefault("device", TEST_DEVICE)
    kw.setdefault("attention_backend", TEST_ATTENTION_BACKEND)
    kw.setdefault("max_running_req", 16)
    kw.setdefault("max_seq_len_override", 128)
    kw.setdefault("num_page_override", 16 * 128 // kw.get("page_size", 1) + 8)
    sched = Scheduler(SchedulerConfig(model_path=str(model_path), tp_info=DistributedInfo(0, 1), dtype=torch.float32, **kw))
    try:
        yield sched
        assert_idle_and_clean(sched)
    finally:
        sched.shutdown()


class Collector:
    """Accumulates TokenOutputs per uid."""

    def __init__(self) -> None:
        self.tokens: Dict[int, List[int]] = {}
        self.finish: Dict[int, str] = {}

    def add(self, outputs) -> None:
        for out in outputs:
            assert out.uid not in self.finish, f"output for uid {out.uid} after it finished"
            if out.token_id is not None:
                self.tokens.setdefault(out.uid, []).append(out.token_id)
            if out.finished:
                self.finish[out.uid] = out.finish_reason


def drive(sched: Scheduler, col: Collector, on_step=None) -> int:
    steps = 0
    while sched.has_work():
        col.add(sched.step())
        steps += 1
        if on_step is not None:
            on_step(sched)
        assert steps < 10_000
    return steps


def submit(sched: Scheduler, prompts, max_tokens, uid0: int = 0) -> List[int]:
    uids = []
    for i, (p, n) in enumerate(zip(prompts, max_tokens)):
        sched.add_request(UserRequest(uid0 + i, list(p), greedy(n)))
        uids.append(uid0 + i)
    return uids


def check_against_refs(col: Collector, uids, prompts, max_tokens, refs, label: str) -> None:
    for uid, p, n in zip(uids, prompts, max_tokens):
        ref, scores = refs.get(p, n)
        assert col.finish.get(uid) == "length", (label, uid, col.finish.get(uid))
        assert_match_ref(col.tokens.get(uid, []), ref, scores, f"{label} uid {uid}")


# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("overlap", [True, False])
def test_overlap_results_lag_one_step(tiny_dir, refs, overlap):
    p, n = PROMPTS[5], 4
    with running_scheduler(tiny_dir, enable_overlap=overlap) as sched:
        sched.add_request(UserRequest(7, p, greedy(n)))
        first = sched.step()
        col = Collector()
        col.add(first)
        if overlap:
            assert first == [] and sched._in_flight is not None  # the prefill is still in flight
        else:
            assert [o.token_id is not None for o in first] == [True] and sched._in_flight is None
        steps = 1 + drive(sched, col)
        assert steps == n + (1 if overlap else 0)
        check_against_refs(col, [7], [p], [n], refs, f"overlap={overlap}")


@pytest.mark.parametrize("overlap", [True, False])
def test_abort_in_every_state_frees_everything(tiny_dir, refs, overlap):
    """Abort a request mid chunked prefill, one while decoding (possibly in flight), one still
    waiting for a row; an unknown uid and a finished one return False. The rest complete."""
    long_p, short = PROMPTS[1], [PROMPTS[i][:6] + [i] for i in range(2, 6)]
    with running_scheduler(tiny_dir, enable_overlap=overlap, max_running_req=2, max_extend_tokens=16) as sched:
        sched.add_request(UserRequest(0, short[0], greedy(20)))  # B: will be aborted while decoding
        sched.add_request(UserRequest(1, long_p, greedy(5)))  # A: aborted mid prefill
        sched.add_request(UserRequest(2, short[1], greedy(5)))  # C: aborted while waiting
        sched.add_request(UserRequest(3, short[2], greedy(6)))  # E: completes
        col = Collector()
        col.add(sched.step())
        assert [r.uid for r in sched.prefilling] == [1] and 0 < sched.prefilling[0].cached_len < len(long_p)
        assert [r.uid for r in sched.waiting] == [2, 3]
        assert sched.abort(1) and sched.abort(2)
        assert not sched.abort(1) and not sched.abort(12345)
        while len(col.tokens.get(0, [])) < 3:
            col.add(sched.step())
        assert sched.abort(0)
        drive(sched, col)
        assert not sched.abort(3)  # already finished
        assert col.finish == {0: "abort", 1: "abort", 2: "abort", 3: "length"}
        assert 1 not in col.tokens and 2 not in col.tokens
        ref_b, scores_b = refs.get(short[0], 20)
        got_b = col.tokens[0]
        assert 3 <= len(got_b) < 20
        assert_match_ref(got_b, ref_b[: len(got_b)], scores_b, "aborted B's partial output")
        check_against_refs(col, [3], [short[2]], [6], refs, "E")


@pytest.mark.parametrize("cache_type,page_size", [("naive", 1), ("radix", 1), ("radix", 4)])
def test_memory_pressure_requests_wait_and_complete(tiny_dir, refs, cache_type, page_size):
    """A pool of 100 token slots: big enough for any one request (<= 84 tokens) but far too small
    for the workload (~1,300 tokens): requests wait for pages, none is lost or changed."""
    pages = 100 // page_size
    with running_scheduler(tiny_dir, cache_type=cache_type, page_size=page_size, num_page_override=pages, max_running_req=32) as sched:
        assert sched.stats().total_pages == pages
        uids = submit(sched, PROMPTS, MAX_TOKENS)
        peak_running, waited = [0], [False]

        def observe(s: Scheduler) -> None:
            st = s.stats()
            peak_running[0] = max(peak_running[0], st.num_running)
            waited[0] |= st.num_waiting > 0 and st.num_running > 0
            assert 0 <= st.free_pages <= st.total_pages
            assert s.allocator.num_free >= 0 and s._reserved >= 0

        col = Collector()
        drive(sched, col, observe)
        assert waited[0] and peak_running[0] < len(PROMPTS)
        check_against_refs(col, uids, PROMPTS, MAX_TOKENS, refs, f"pressure {cache_type} ps={page_size}")
        assert sched.stats().generated_tokens == sum(MAX_TOKENS)


def test_running_requests_bounded_by_table_rows(tiny_dir, refs):
    prompts, max_tokens = PROMPTS[:12], MAX_TOKENS[:12]
    with running_scheduler(tiny_dir, max_running_req=3) as sched:
        uids = submit(sched, prompts, max_tokens)
        peak = [0]

        def observe(s: Scheduler) -> None:
            peak[0] = max(peak[0], s.stats().num_running)
            assert len(s.free_rows) + len(s.active) == 3

        col = Collector()
        drive(sched, col, observe)
        assert peak[0] == 3
        check_against_refs(col, uids, prompts, max_tokens, refs, "max_running_req=3")


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("mixed", [True, False])
def test_decode_not_starved_by_chunked_prefill(tiny_dir, refs, overlap, mixed):
    """A decoding request keeps making progress while long prompts are prefilled in 16-token
    chunks. Mixed: every step carries its decode row and the chunks fill the rest of the
    budget. Not mixed: never two prefill steps in a row while something can decode. Every step
    stays within the budget and outputs equal the references."""
    long_prompts = [p for p in PROMPTS if len(p) >= 40][:5]
    first = PROMPTS[3][:8]
    with running_scheduler(tiny_dir, max_extend_tokens=16, enable_overlap=overlap, mixed_batches=mixed) as sched:
        log: List[Tuple[str, int, bool]] = []
        prefilled: List[int] = []  # prompt tokens per step (decode rows of a mixed batch excluded)
        forward = sched.engine.forward_batch

        def spy(batch, args):
            log.append((batch.phase, sum(r.extend_len for r in batch.reqs), any(r.uid == 0 for r in batch.reqs)))
            prefilled.append(sum(r.extend_len for r in batch.reqs if r.cached_len < r.prefill_len))
            return forward(batch, args)

        sched.engine.forward_batch = spy  # type: ignore[method-assign]
        sched.add_request(UserRequest(0, first, greedy(30)))
        col = Collector()
        col.add(sched.step())
        uids = submit(sched, long_prompts, [4] * len(long_prompts), uid0=1)
        drive(sched, col)
        check_against_refs(col, [0] + uids, [first] + long_prompts, [30] + [4] * len(long_prompts), refs, "interleave")
        assert (sched.stats().mixed_steps > 0) == mixed
    assert all(n <= 16 for phase, n, _ in log if phase == "prefill")
    total_long = sum(len(p) for p in long_prompts)
    # while request 0 decodes (it runs 30 tokens, far longer than the prefills)
    if mixed:
        with0 = [i for i, (_, _, has0) in enumerate(log) if has0]
        window = log[with0[1] : with0[-1] + 1]  # after request 0's own prefill
        assert all(has0 for _, _, has0 in window), f"a step without the decoding request: {window}"
        # the long prompts rode along with its decode rows, chunked, none cached
        assert sum(prefilled[with0[1] :]) == total_long
        assert sum(phase == "prefill" for phase, _, _ in window) >= 5
    else:
        assert sum(n for phase, n, has0 in log if phase == "prefill" and not has0) == total_long  # chunked, none cached
        decoding = [i for i, (phase, _, has0) in enumerate(log) if phase == "decode" and has0]
        window = log[decoding[0] : decoding[-1] + 1]
        for a, b in zip(window, window[1:]):
            assert not (a[0] == "prefill" and b[0] == "prefill"), f"two prefills in a row while decoding: {window}"
        assert sum(phase == "prefill" for phase, _, _ in window) >= 5  # prefills did proceed meanwhile


def test_validation_rejects_without_side_effects(tiny_dir, refs):
    with running_scheduler(tiny_dir) as sched:
        sched.add_request(UserRequest(1, [1, 2, 3], greedy(2)))
        bad = [
            (UserRequest(1, [4, 5], greedy(2)), "uid"),
            (UserRequest(2, [], greedy(2)), "empty"),
            (UserRequest(3, [1, 256], greedy(2)), "input_ids"),
            (UserRequest(4, [-1], greedy(2)), "input_ids"),
            (UserRequest(5, [1] * 128, greedy(2)), "context"),
            (UserRequest(6, [1], SamplingParams(top_p=2.0)), "top_p"),
            (UserRequest(7, [1], SamplingParams(logprobs=100)), "logprobs"),
            (UserRequest(8, [1], SamplingParams(stop_token_ids=[-3])), "stop_token_ids"),
        ]
        for req, field in bad:
            with pytest.raises(ValueError, match=field):
                sched.add_request(req)
        assert [r.uid for r in sched.waiting] == [1]
        col = Collector()
        drive(sched, col)
        check_against_refs(col, [1], [[1, 2, 3]], [2], refs, "good request")
        sched.add_request(UserRequest(1, [1, 2, 3], greedy(2)))  # a finished uid may be reused
        drive(sched, Collector())


def test_stats_count_prompts_hits_and_tokens(tiny_dir):
    prefix = PROMPTS[1][:40]
    prompts = [prefix + [1, 2], prefix + [3], prefix + [4, 5, 6]]
    with running_scheduler(tiny_dir, cache_type="radix", max_running_req=1) as sched:
        submit(sched, prompts, [3, 2, 1])
        drive(sched, Collector())
        st = sched.stats()
        assert st.prompt_tokens == sum(map(len, prompts))
        assert st.generated_tokens == 6
        # requests 2 and 3 reuse the 40-token prefix (request 1 was cached when it finished)
        assert st.cache_hit_tokens == 2 * 40
        assert 0 < st.cache_hit_rate < 1
        assert st.cached_pages >= 40 and st.free_pages == st.total_pages
        assert st.kv_usage == 0.0


# ---------------------------------------------------------------------------------------------
# tp > 1: the followers run rank 0's plans with only what the plans carry
# ---------------------------------------------------------------------------------------------

EMAIL = r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)"
TEXTS = ["email me: ada@lab.org or bob@mail.com", "The quick brown fox jumps over the lazy dog", "answer: yes no maybe"] * 10


def _tiny_llama_with_tokenizer(out: Any) -> str:
    """A tiny random Llama (4 query heads, 2 KV heads: tp=2 divides it) and a byte-level BPE
    tokenizer trained here, so grammars can be compiled."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(TEXTS, vocab_size=300, min_frequency=2, special_tokens=["<|endoftext|>"])
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>", bos_token="<|endoftext|>")
    tok.save_pretrained(out)
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    torch.manual_seed(5)
    config = LlamaConfig(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.1, bos_token_id=eos, eos_token_id=eos,
    )  # fmt: skip
    LlamaForCausalLM(config).eval().save_pretrained(out)
    return str(out)


def test_tp2_followers_sample_from_what_the_plan_carries(tmp_path_factory):
    """Penalties (the token history), min_tokens + logit_bias, a seed and a grammar (compiled
    and advanced on every rank): tp=2 gives tp=1's tokens and the ranks' token pools agree.
    Greedy draws are not broadcast, so a follower with a wrong history or mask would write other
    tokens into its pool."""
    if TEST_DEVICE.startswith("cuda") and torch.cuda.device_count() < 2:
        pytest.skip("tp=2 on CUDA needs two GPUs")
    path = _tiny_llama_with_tokenizer(tmp_path_factory.mktemp("tp_bpe_llama"))
    prompts = ["The quick", "The quick", "answer:", "mail to ", "brown fox"]
    params = [
        SamplingParams(temperature=0.0, max_tokens=16, repetition_penalty=8.0, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=16, frequency_penalty=2.0, presence_penalty=2.0, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=16, min_tokens=8, logit_bias={7: 2.0}),
        SamplingParams(temperature=0.0, max_tokens=40, grammar=GrammarSpec("regex", EMAIL)),
    ]
    seeded = SamplingParams(temperature=0.9, seed=3, max_tokens=16, ignore_eos=True)
    kw = llm_kwargs(max_running_req=4, max_extend_tokens=8, page_size=4, max_seq_len_override=96, num_page_override=4 * 96 // 4 + 8)

    def run(llm: LLM) -> List[List[int]]:
        # the greedy rows alone (no draw to broadcast: each rank's pool gets its own argmax), then a seeded one
        return [r.token_ids for r in llm.generate(prompts[:4], params)] + [llm.generate(prompts[4:], seeded)[0].token_ids]

    with LLM(path, **kw) as llm1:
        ref = run(llm1)
        plain = [r.token_ids for r in llm1.generate(prompts[:4], [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)] * 4)]
    assert ref[0] != plain[0] and ref[1] != plain[1], "the penalties change nothing here: the test would prove little"
    assert ref[3][: len(plain[3])] != plain[3], "the grammar changes nothing here"
    llm2 = LLM(path, tp=2, **kw)
    try:
        out = run(llm2)
        fps = llm2.scheduler.rank_fingerprints()
        assert_idle_and_clean(llm2.scheduler)
    finally:
        llm2.shutdown()
    assert out == ref
    assert fps[0] == fps[1], "a follower sampled other tokens than rank 0"
