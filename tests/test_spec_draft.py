"""Speculative decoding with a draft model (issue 29, `--speculative-algorithm draft`): greedy
outputs token-identical to speculation off in float32 with the target as its own draft (every
draft accepted) and with a different random draft sharing the vocabulary (few accepted), in
mixed batches with rows that do not speculate, a grammar row, stop ids / EOS / max_tokens / a
stop string inside an accepted run; sampled rows; aborts leave no page in either pool; the
config's refusals; and rejection sampling against a non-one-hot draft distribution q."""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

import pytest
import torch
from helpers import build_tiny_model
from sched_helpers import assert_idle_and_clean, llm_kwargs, run_steps, speculation_off
from test_spec_ngram import CHI2_999, _chi2, _copy_heavy_prompts, _VerifyRow, _with_word_tokenizer

from minisgl.core import SamplingParams
from minisgl.llm import LLM
from minisgl.sampling_params import GrammarSpec
from minisgl.scheduler import Scheduler

K = 4  # speculative_num_tokens


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Path]:
    """Two tiny random checkpoints (2 layers, hidden 64) sharing a 256-token vocabulary: the
    target (with a word-level tokenizer, for stop strings) and another draft."""
    root = tmp_path_factory.mktemp("draft")
    target = build_tiny_model("llama", root / "target", seed=11, num_hidden_layers=2)
    other = build_tiny_model("qwen2", root / "other", seed=12, num_hidden_layers=2)
    return {"target": _with_word_tokenizer(target, root / "tok"), "other": other}


@pytest.fixture(scope="module", params=["self", "other", "tight"])
def llm(request: pytest.FixtureRequest, models: Dict[str, Path]) -> Iterator[LLM]:
    """The target with the draft model `self` (the target itself: every draft is accepted) or
    `other` (a different random model: few are), page size 4; `tight`: the target as its draft
    with 40 pages (160 tokens) in each pool, so that requests are retracted and resumed, and
    steps of 16 tokens at most (prompts prefilled in chunks, the draft's catch-up too)."""
    draft = models["other"] if request.param == "other" else models["target"]
    pages = {"num_page_override": 40, "max_extend_tokens": 16} if request.param == "tight" else {}
    llm = LLM(str(models["target"]), **llm_kwargs(speculative_algorithm="draft", speculative_draft_model=str(draft), page_size=4,
                                                  max_running_req=16, **pages))  # fmt: skip
    llm.draft_kind = request.param  # type: ignore[attr-defined]
    try:
        yield llm
    finally:
        llm.shutdown()


def _assert_clean(sched: Scheduler) -> None:
    """Both pools: every target page free after the prefix cache is reset, every draft page free."""
    assert_idle_and_clean(sched)  # (check_invariants checks the draft proposer too)
    alloc = sched.proposer.allocator  # type: ignore[attr-defined]
    assert alloc.num_free == alloc.num_pages


def _both(llm: LLM, reqs: List[Tuple[List[int], SamplingParams]], **kw: Any) -> Tuple[Any, Any, Tuple[int, int, int]]:
    """The requests with speculation off, then on: (off, on, (proposed, accepted, verify rows) of "on")."""
    sched = llm.scheduler
    with speculation_off(sched):
        sched.reset_prefix_cache()
        off = run_steps(sched, reqs, **kw)
        _assert_clean(sched)
    before = sched.stats()
    on = run_steps(sched, reqs, **kw)
    after = sched.stats()
    _assert_clean(sched)
    counts = (after.spec_proposed_tokens - before.spec_proposed_tokens, after.spec_accepted_tokens - before.spec_accepted_tokens,
              after.spec_verify_rows - before.spec_verify_rows)  # fmt: skip
    return off, on, counts


def _inside_run(out: List[int]) -> int:
    """An index whose token occurs there first and is not the last of its run when every draft
    is accepted (the runs after the prefill's token: out[1 : K + 2], out[K + 2 : 2K + 3], ...)."""
    return next(j for j in range(1, len(out)) if out[j] not in out[:j] and (j - 1) % (K + 1) != K)


def test_greedy_identical_in_a_mixed_batch(llm: LLM) -> None:
    """Plain, penalized, logit_bias, min_tokens and grammar greedy rows speculate beside a seeded
    sampled row (which does not); every row equals speculation off. With the target as its own
    draft every draft is accepted and a plain row gets K + 1 tokens per step."""
    prompts = _copy_heavy_prompts(6, seed=21)
    params = [
        SamplingParams(temperature=0.0, max_tokens=41),
        SamplingParams(temperature=0.9, seed=5, max_tokens=20),
        SamplingParams(temperature=0.0, max_tokens=30, repetition_penalty=1.3),
        SamplingParams(temperature=0.0, max_tokens=30, logit_bias={7: 3.0}),
        SamplingParams(temperature=0.0, max_tokens=30, min_tokens=12, stop_token_ids=[33]),
        SamplingParams(temperature=0.0, max_tokens=16, grammar=GrammarSpec("regex", "(w[1-9])+")),
    ]
    off, on, (proposed, accepted, rows) = _both(llm, list(zip(prompts, params)))
    assert on[0] == off[0] and on[1] == off[1]
    assert len(on[0][5]) == 16 and all(1 <= t <= 9 for t in on[0][5])  # the grammar held
    ran = {i for step in on[2] for i, n in step.items() if n > 1}
    assert 1 not in ran, "the seeded row speculated"
    assert rows > 0 and proposed > 0
    if llm.draft_kind == "other":  # type: ignore[attr-defined]
        assert accepted < proposed
        return
    assert accepted == proposed, (accepted, proposed)
    assert {0, 2, 3, 4, 5} <= ran
    assert llm.scheduler.stats().spec_acceptance_rate == 1.0
    if llm.draft_kind == "self":  # type: ignore[attr-defined]
        # the plain row: its prefill's token, then K + 1 tokens a step until max_tokens cuts the drafts
        runs = [step[0] for step in on[2] if 0 in step]
        assert runs[0] == 1 and runs[1 : 1 + 40 // (K + 1)] == [K + 1] * (40 // (K + 1)), runs


def test_stop_id_eos_and_max_tokens_inside_an_accepted_run(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stop id, EOS and max_tokens at a token inside an accepted run (self draft) end the
    request there, as speculation off does; the run's later tokens are dropped."""
    if llm.draft_kind == "tight":  # type: ignore[attr-defined]
        pytest.skip("the small pool's test is the retraction one")
    sched = llm.scheduler
    prompts = _copy_heavy_prompts(3, seed=22)
    with speculation_off(sched):
        ref, _, _ = run_steps(sched, [(p, SamplingParams(temperature=0.0, max_tokens=40)) for p in prompts])
    cuts = [_inside_run(ref[i]) for i in range(len(prompts))]
    stop = [(p, SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[ref[i][j]])) for i, (p, j) in enumerate(zip(prompts, cuts))]
    length = [(p, SamplingParams(temperature=0.0, max_tokens=j + 1)) for p, j in zip(prompts, cuts)]
    off, on, (proposed, accepted, _) = _both(llm, stop + length)
    assert on[0] == off[0] and on[1] == off[1]
    n = len(prompts)
    for i, j in enumerate(cuts):
        assert on[0][i] == ref[i][: j + 1] and on[1][i] == "stop"
        assert on[0][n + i] == ref[i][: j + 1] and on[1][n + i] == "length"
    if llm.draft_kind != "other":  # type: ignore[attr-defined]
        assert accepted == proposed > 0
    # EOS: the model's end token (the policy's eos_ids) is a stop id of every request that does not ignore it
    monkeypatch.setattr(sched, "eos_ids", {ref[0][cuts[0]]})
    off, on, _ = _both(llm, [(prompts[0], SamplingParams(temperature=0.0, max_tokens=40))])
    assert on[0] == off[0] and on[0][0] == ref[0][: cuts[0] + 1] and on[1][0] == "stop"


def test_stop_string_inside_an_accepted_run(llm: LLM) -> None:
    if llm.draft_kind == "tight":  # type: ignore[attr-defined]
        pytest.skip("the small pool's test is the retraction one")
    prompt = _copy_heavy_prompts(1, seed=23)[0]
    sched = llm.scheduler
    with speculation_off(sched):
        ref, _, _ = run_steps(sched, [(prompt, SamplingParams(temperature=0.0, max_tokens=40))])
    out = ref[0]
    j = _inside_run(out)
    params = SamplingParams(temperature=0.0, max_tokens=40, stop=[llm.tokenizer.decode([out[j]])])
    results = {}
    for spec in (False, True):
        sched.reset_prefix_cache()
        with speculation_off(sched) if not spec else nullcontext():
            res = llm.generate([prompt], params)[0]
        results[spec] = (res.token_ids, res.text, res.finish_reason)
        _assert_clean(sched)
    assert results[True] == results[False]
    assert results[True][2] == "stop" and results[True][0] == out[: j + 1]


def test_sampled_rows_and_aborts_leave_no_pages(llm: LLM) -> None:
    """A barrage of greedy and sampled rows (a draft model's q: rejection sampling with
    min(1, p/q)), half of them aborted at different points: they finish within max_tokens and
    every page of both pools comes back; the greedy rows not aborted equal speculation off."""
    prompts = _copy_heavy_prompts(12, seed=24)
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, top_p=0.95, max_tokens=20 + i) for i in range(12)]
    abort_at = {i: 2 + 2 * i for i in range(0, 12, 3)}  # (before max_tokens, even with a run of K + 1 in between)
    before = llm.scheduler.stats()
    off, on, (proposed, accepted, rows) = _both(llm, list(zip(prompts, params)), abort_at=abort_at)
    assert rows > 0
    for i in range(12):
        if i in abort_at:
            assert on[1][i] == "abort"
        else:
            assert len(on[0][i]) == 20 + i and on[1][i] == "length"
            if params[i].is_greedy:
                assert on[0][i] == off[0][i]
    if llm.draft_kind != "other":  # type: ignore[attr-defined]
        # sampled rows accept with min(1, p/q) = 1 up to rounding: p and q are the same model's
        assert accepted >= 0.95 * proposed
    assert llm.scheduler.stats().spec_verify_rows > before.spec_verify_rows


def test_retracted_requests_resume_with_their_draft_kv_recomputed(llm: LLM) -> None:
    """A pool too small for the batch: requests are retracted (their draft pages freed with
    their target pages) and resumed (the draft recomputes their KV); outputs equal speculation
    off, every draft is still accepted, both pools end clean."""
    if llm.draft_kind != "tight":  # type: ignore[attr-defined]
        pytest.skip("needs the small pool")
    prompts = _copy_heavy_prompts(8, seed=25)
    reqs = [(p, SamplingParams(temperature=0.0, max_tokens=60)) for p in prompts]
    sched = llm.scheduler
    with speculation_off(sched):
        off = run_steps(sched, reqs)
        _assert_clean(sched)
    before = sched.stats()
    on = run_steps(sched, reqs)
    after = sched.stats()
    _assert_clean(sched)
    assert on[0] == off[0] and on[1] == off[1]
    assert after.retractions - before.retractions > 1, "no retraction with speculation on"
    assert after.spec_verify_rows > before.spec_verify_rows
    assert after.spec_accepted_tokens - before.spec_accepted_tokens == after.spec_proposed_tokens - before.spec_proposed_tokens
    # a request holds no more draft pages than target pages: the draft pool (as many pages) does not run out first
    assert sched.proposer.pool_full == 0  # type: ignore[attr-defined]


def test_config_refusals(models: Dict[str, Path], tmp_path: Path) -> None:
    from minisgl.distributed import DistributedInfo
    from minisgl.scheduler import SchedulerConfig
    from minisgl.server.args import parse_args

    base: Dict[str, Any] = {"model_path": str(models["target"]), "dtype": torch.float32, "tp_info": DistributedInfo(0, 1)}
    with pytest.raises(ValueError, match="needs speculative_draft_model"):
        SchedulerConfig(**base, speculative_algorithm="draft")
    with pytest.raises(ValueError, match="only used with speculative_algorithm='draft'"):
        SchedulerConfig(**base, speculative_algorithm="ngram", speculative_draft_model=str(models["other"]))
    with pytest.raises(ValueError, match="tp 1 only"):
        SchedulerConfig(**{**base, "tp_info": DistributedInfo(0, 2)}, speculative_algorithm="draft", speculative_draft_model="x")
    args = parse_args(["--speculative-algorithm", "draft", "--speculative-draft-model", "/d", "--speculative-num-tokens", "3"])
    assert [args.engine_value(f"speculative_{k}") for k in ("algorithm", "draft_model", "num_tokens")] == ["draft", "/d", 3]
    # another vocabulary: refused before any weight loads, naming both models and sizes
    wide = build_tiny_model("llama", tmp_path / "wide", seed=13, num_hidden_layers=2, vocab_size=320)
    with pytest.raises(ValueError, match=r"320 tokens.*256") as info:
        LLM(str(models["target"]), **llm_kwargs(speculative_algorithm="draft", speculative_draft_model=str(wide)))
    assert str(wide) in str(info.value) and str(models["target"]) in str(info.value)


# ---- rejection sampling against a draft model's distribution q ----------------------------


def test_rejection_sampling_with_a_draft_distribution() -> None:
    """120k sampled verify rows on a 6-token vocabulary whose drafts are drawn from a q unlike
    p (not one-hot): the first emitted token is distributed as p (temperature and top-k applied),
    and the token after an accepted draft as the next position's p; the acceptance rate is
    sum(min(p, q)). Naive acceptances fail the same test: min(1, p/q) with a residual of p itself
    instead of max(0, p - q), acceptance with probability p(d) (ignoring q) with the residual
    max(0, p - q), and keeping every draft p allows."""
    from minisgl.engine.spec_verify import make_verify_args, verify_tokens

    torch.manual_seed(1)
    vocab, n, temperature = 6, 120_000, 0.8
    logits = torch.randn(2, vocab) * 1.5
    params = SamplingParams(temperature=temperature, top_k=4)

    def target(row: torch.Tensor) -> torch.Tensor:  # independent of the sampler's code
        p = torch.softmax(row / temperature, dim=-1)
        p[p < p.topk(4).values[-1]] = 0.0
        return p / p.sum()

    p0, p1 = target(logits[0]), target(logits[1])
    q = torch.tensor([0.05, 0.3, 0.1, 0.25, 0.2, 0.1])  # every token possible, none matching p
    drafts = torch.multinomial(q, n, replacement=True)
    qs: List[torch.Tensor | None] = [q.unsqueeze(0)] * n
    row = _VerifyRow(params, [1, 2, 3], [], 1)
    args = make_verify_args([row] * n, [[d] for d in drafts.tolist()], vocab, torch.device("cpu"), draft_probs=qs)
    out = verify_tokens(logits.repeat(n, 1), args).view(n, 2)
    first, after = out[:, 0], out[:, 1]
    dof = int((p0 > 0).sum()) - 1
    assert _chi2(first, p0) < CHI2_999[dof]
    accepted = first == drafts
    assert abs(float(accepted.float().mean()) - float(torch.minimum(p0, q).sum())) < 0.01
    assert _chi2(after[accepted], p1) < CHI2_999[dof]

    # the controls, on the same drafts
    def draw(keep: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return torch.where(keep, drafts, torch.multinomial(residual / residual.sum(), n, replacement=True))

    u = torch.rand(n)
    assert _chi2(draw(u * q[drafts] < p0[drafts], p0), p0) > 10 * CHI2_999[dof]
    assert _chi2(draw(u < p0[drafts], (p0 - q).clamp_min(0)), p0) > 10 * CHI2_999[dof]
    assert _chi2(draw(p0[drafts] > 0, p0), p0) > 10 * CHI2_999[dof]


def test_one_hot_draft_is_the_special_case() -> None:
    """An explicit one-hot q gives the same draws as the n-gram path's q = None (same seed)."""
    from minisgl.engine.spec_verify import accept_or_resample

    torch.manual_seed(2)
    p = torch.softmax(torch.randn(1000, 9), dim=-1)
    d = torch.randint(0, 9, (1000,))
    d[::7] = -1  # rows' last positions: no draft
    onehot = torch.zeros(1000, 9)
    onehot[torch.arange(1000)[d >= 0], d[d >= 0]] = 1.0
    torch.manual_seed(3)
    a = accept_or_resample(p, d)
    torch.manual_seed(3)
    b = accept_or_resample(p, d, onehot)
    assert torch.equal(a, b)
