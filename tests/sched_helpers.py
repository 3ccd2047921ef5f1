"""Helpers for the scheduler / LLM tests: building LLMs on tiny models, the shared workload, the
HF references (cached for the whole session) and tie-aware token comparison.

Every LLM here runs in float32 so greedy tokens can be compared with Hugging Face exactly. The
only forgiven difference is a true tie: at the first divergence, HF's own logit gap between the
two tokens is below TIE_EPS.
"""

from __future__ import annotations

import itertools
import random
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Sequence, Tuple

import torch
from helpers import TEST_ATTENTION_BACKEND, TEST_DEVICE, TIE_EPS, HFOracle

from minisgl.core import SamplingParams
from minisgl.llm import LLM
from minisgl.scheduler import Scheduler, UserRequest

TINY = "llama"  # the tiny architecture the scheduler tests run on (tests/helpers.py TINY_ARCHS)
VOCAB = 256


def llm_kwargs(**kw: Any) -> Dict[str, Any]:
    kw.setdefault("dtype", "float32")
    kw.setdefault("device", TEST_DEVICE)
    kw.setdefault("attention_backend", TEST_ATTENTION_BACKEND)
    kw.setdefault("max_running_req", 48)
    kw.setdefault("max_seq_len_override", 192)
    kw.setdefault("num_page_override", 48 * 192 // kw.get("page_size", 1) + 16)
    return kw


def assert_idle_and_clean(sched: Scheduler) -> None:
    """The no-leak contract: idle, every row free, every page free or cached unpinned; after
    reset_prefix_cache() every page is free."""
    sched.check_invariants()
    stats = sched.stats()
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.free_pages == stats.total_pages, stats
    sched.reset_prefix_cache()
    assert sched.allocator.num_free == sched.allocator.num_pages, (
        f"after reset_prefix_cache: {sched.allocator.num_free} free of {sched.allocator.num_pages}"
    )
    assert sched.stats().cached_pages == 0
    sched.check_invariants()


@contextmanager
def running_llm(model_path: Any, **kw: Any) -> Iterator[LLM]:
    """An LLM that is checked for leaks when the test body succeeds and always shut down."""
    llm = LLM(str(model_path), **llm_kwargs(**kw))
    try:
        yield llm
        assert_idle_and_clean(llm.scheduler)
    finally:
        llm.shutdown()


# ---------------------------------------------------------------------------------------------
# Workloads
# ---------------------------------------------------------------------------------------------


def make_workload(n: int, seed: int, min_len: int = 1, max_len: int = 60, max_new: int = 24) -> Tuple[List[List[int]], List[int]]:
    """n prompts of different lengths (token ids over the whole vocab, 0 included) and
    different max_tokens."""
    rng = random.Random(seed)
    lengths = [min_len, max_len] + [rng.randint(min_len, max_len) for _ in range(n - 2)]
    prompts = [[rng.randrange(VOCAB) for _ in range(L)] for L in lengths]
    max_tokens = [1, max_new] + [rng.randint(1, max_new) for _ in range(n - 2)]
    rng.shuffle(max_tokens)
    return prompts, max_tokens


def greedy(max_tokens: int, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


# ---------------------------------------------------------------------------------------------
# HF references
# ---------------------------------------------------------------------------------------------


class HFRefs:
    """HF generate (greedy) per prompt, computed once per session and sliced for shorter runs."""

    def __init__(self, oracle: HFOracle) -> None:
        self.oracle = oracle
        self._cache: Dict[Tuple[int, ...], Tuple[List[int], List[torch.Tensor]]] = {}

    def get(self, prompt: Sequence[int], n: int) -> Tuple[List[int], List[torch.Tensor]]:
        key = tuple(prompt)
        hit = self._cache.get(key)
        if hit is None or len(hit[0]) < n:
            hit = self._cache[key] = hf_generate(self.oracle, prompt, n)
        return hit[0][:n], hit[1][:n]


@torch.inference_mode()
def hf_generate(oracle: HFOracle, prompt: Sequence[int], n: int, **gen_kwargs: Any) -> Tuple[List[int], List[torch.Tensor]]:
    """Greedy HF generate on one unpadded prompt: (tokens, the scores behind each token).

    attention_mask is explicit (a pad id equal to a prompt token would otherwise be masked) and
    EOS is off (the tiny models have none; callers compare up to EOS themselves). The scores are
    the processed ones, so penalties (repetition_penalty) are included in the tie gap."""
    model = oracle.model
    x = torch.tensor([list(prompt)], device=oracle.device)
    out = model.generate(
        input_ids=x,
        attention_mask=torch.ones_like(x),
        max_new_tokens=n,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        return_dict_in_generate=True,
        output_scores=True,
        **gen_kwargs,
    )
    tokens = out.sequences[0, len(prompt) :].tolist()
    scores = [s[0].float().cpu() for s in out.scores]
    return tokens, scores


def teacher_forced_logits(oracle: HFOracle, prompt: Sequence[int], tokens: Sequence[int]) -> torch.Tensor:
    """HF's logits for each of `tokens` given the prompt and the tokens before it: [len(tokens), V]."""
    if not tokens:
        return torch.empty(0, VOCAB)
    ids = list(prompt) + list(tokens)
    return oracle.logits(ids[:-1])[len(prompt) - 1 :]


# ---------------------------------------------------------------------------------------------
# Comparisons
# ---------------------------------------------------------------------------------------------


def assert_match_ref(ours: Sequence[int], ref: Sequence[int], ref_scores: Sequence[torch.Tensor], label: str = "") -> bool:
    """Token for token equal to `ref` (same length), except a true tie at the first divergence
    (HF's gap between the two tokens < TIE_EPS; comparison stops there). Returns False on a tie."""
    ours, ref = list(ours), list(ref)
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            gap = abs(float(ref_scores[i][a]) - float(ref_scores[i][b]))
            assert gap < TIE_EPS, (
                f"{label}: first divergence at generated token {i}: ours {a}, reference {b}; HF's gap "
                f"between them is {gap:.3g} (not a tie)\n  ours: {ours}\n  ref:  {ref}"
            )
            return False
    assert len(ours) == len(ref), f"{label}: {len(ours)} tokens, reference {len(ref)}\n  ours: {ours}\n  ref:  {ref}"
    return True


def assert_greedy_consistent(oracle: HFOracle, prompt: Sequence[int], tokens: Sequence[int], label: str = "") -> torch.Tensor:
    """Every token is HF's argmax given the prompt and our own tokens before it (within
    TIE_EPS of the max logit). One HF forward per sequence. Returns HF's logits for `tokens`."""
    logits = teacher_forced_logits(oracle, prompt, tokens)
    for i, t in enumerate(tokens):
        row = logits[i]
        gap = float(row.max() - row[t])
        assert gap < TIE_EPS, (
            f"{label}: generated token {i} = {t} is not HF's greedy choice {int(row.argmax())} "
            f"(logit gap {gap:.3g})\n  ours: {list(tokens)}"
        )
    return logits


def assert_same_tokens(a: Sequence[int], b: Sequence[int], logits: torch.Tensor, label: str = "") -> None:
    """Two runs of the same greedy request agree token for token, except a tie at the first
    divergence judged on HF's logits for run `a` (teacher-forced on a's tokens)."""
    a, b = list(a), list(b)
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            gap = abs(float(logits[i][x]) - float(logits[i][y]))
            assert gap < TIE_EPS, (
                f"{label}: runs diverge at generated token {i} ({x} vs {y}), HF gap {gap:.3g} is not a tie\n  a: {a}\n  b: {b}"
            )
            return
    assert len(a) == len(b), f"{label}: lengths differ ({len(a)} vs {len(b)})\n  a: {a}\n  b: {b}"


# ---------------------------------------------------------------------------------------------
# Session-wide caches (shared by every test module that imports this one)
# ---------------------------------------------------------------------------------------------

WORKLOAD = make_workload(32, seed=3)  # the main workload: 32 prompts of 1..60 tokens, 1..24 new tokens
_REFS: Dict[str, HFRefs] = {}


def refs_for(oracle: HFOracle) -> HFRefs:
    key = str(id(oracle))
    if key not in _REFS:
        _REFS[key] = HFRefs(oracle)
    return _REFS[key]


def check_workload(results: Sequence[Any], refs: HFRefs, prompts: Sequence[Sequence[int]], max_tokens: Sequence[int], label: str) -> None:
    """Every result equals HF generate on its prompt (tie-aware) and finished by length."""
    assert len(results) == len(prompts)
    for i, (res, p, n) in enumerate(zip(results, prompts, max_tokens)):
        ref, scores = refs.get(p, n)
        assert_match_ref(res.token_ids, ref, scores, f"{label} request {i} (prompt {len(p)} tokens, max_tokens {n})")
        assert res.finish_reason == "length", (label, i, res.finish_reason)
        assert res.completion_tokens == len(res.token_ids) == n
        assert res.prompt_tokens == len(p)


_STEP_UIDS = itertools.count(1 << 20)  # (apart from the LLM's own uids)


def run_steps(
    sched: Scheduler, reqs: List[Tuple[List[int], SamplingParams]], abort_at: Dict[int, int] | None = None
) -> Tuple[Dict[int, List[int]], Dict[int, str], List[Dict[int, int]]]:
    """Run `reqs` to the end on `sched` step by step: tokens and finish reason per request, and
    per step how many tokens each request got. `abort_at`: request index -> abort it once it
    has that many tokens."""
    uids = []
    for ids, params in reqs:
        uid = next(_STEP_UIDS)
        sched.add_request(UserRequest(uid, list(ids), params))
        uids.append(uid)
    index = {uid: i for i, uid in enumerate(uids)}
    tokens: Dict[int, List[int]] = {i: [] for i in range(len(reqs))}
    reasons: Dict[int, str] = {}
    steps: List[Dict[int, int]] = []
    for _ in range(10_000):
        if not sched.has_work():
            break
        per_step: Dict[int, int] = {}
        for out in sched.step():
            i = index[out.uid]
            if i in reasons:
                continue
            if out.token_id is not None:
                tokens[i].append(out.token_id)
                per_step[i] = per_step.get(i, 0) + 1
            if out.finished:
                reasons[i] = out.finish_reason or ""
            elif abort_at and abort_at.get(i) is not None and len(tokens[i]) >= abort_at[i]:
                sched.abort(out.uid)
                reasons[i] = "abort"
        steps.append(per_step)
    assert not sched.has_work()
    return tokens, reasons, steps


@contextmanager
def speculation_off(sched: Scheduler) -> Iterator[None]:
    """The same scheduler and engine with speculation off: every decode step a plain one."""
    previous, sched.speculative = sched.speculative, None
    try:
        yield
    finally:
        sched.speculative = previous
