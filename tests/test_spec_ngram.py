"""Speculative decoding by n-gram prompt lookup (issue 29, first part): the proposer on lists,
and greedy outputs with speculation on token-identical to speculation off (float32, tiny
llama) — with drafts accepted, in batches where some rows cannot speculate, with a stop token
or max_tokens landing inside an accepted run, a stop string, and aborts; no page leaks."""

from __future__ import annotations

import dataclasses
import random
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Tuple

import pytest
import torch
from sched_helpers import TINY, assert_idle_and_clean, llm_kwargs, run_steps, speculation_off

from minisgl.core import SamplingParams
from minisgl.llm import LLM
from minisgl.sampling_params import GrammarSpec
from minisgl.scheduler.spec_ngram import MAX_BACKOFF_STEPS, DraftLength, NgramIndex, propose

# ---- the proposer -------------------------------------------------------------------------


def _propose_reference(tokens: List[int], k: int, lo: int, hi: int) -> List[int]:
    """The same lookup written the obvious way: for n from hi down to lo, the latest earlier
    start whose n tokens equal the last n."""
    for n in range(hi, lo - 1, -1):
        if n >= len(tokens):
            continue
        tail = tokens[-n:]
        starts = [s for s in range(len(tokens) - n) if tokens[s : s + n] == tail]
        if starts:
            s = max(starts)
            period = len(tokens) - n - s  # the match repeats the text every `period` tokens
            return [tokens[s + n + i % period] for i in range(k)]
    return []


def test_propose_examples() -> None:
    assert propose([1, 2, 3, 9, 1, 2, 3], 4, 1, 4) == [9, 1, 2, 3]
    assert propose([1, 2, 3, 9, 1, 2, 3], 2, 1, 4) == [9, 1]
    # the longest n-gram wins over a later shorter match
    assert propose([5, 6, 7, 1, 6, 8, 5, 6], 3, 1, 3) == [7, 1, 6]
    assert propose([5, 6, 7, 1, 6, 8, 5, 6], 3, 1, 1) == [8, 5, 6]
    assert propose([4, 4, 4], 4, 1, 4) == [4, 4, 4, 4]  # a cycle continues past the end
    assert propose([1, 2, 1, 2, 1], 5, 1, 4) == [2, 1, 2, 1, 2]
    assert propose([1, 2, 3], 4, 1, 4) == []  # nothing repeats
    assert propose([1, 2, 3, 1], 4, 2, 4) == []  # a 1-gram match is below the minimum
    assert propose([7], 4, 1, 4) == [] and propose([], 4, 1, 4) == []


def test_propose_matches_reference() -> None:
    rng = random.Random(3)
    for _ in range(400):
        tokens = [rng.randrange(4) for _ in range(rng.randint(0, 30))]
        k, lo = rng.randint(1, 5), rng.randint(1, 3)
        hi = rng.randint(lo, 5)
        assert propose(tokens, k, lo, hi) == _propose_reference(tokens, k, lo, hi), (tokens, k, lo, hi)


def test_incremental_index_equals_the_scan() -> None:
    """NgramIndex (a table of each n-gram's latest start, grown with the tokens) proposes what
    the whole-sequence scan proposes, at every length as tokens arrive one or several at a time."""
    rng = random.Random(7)
    for _ in range(150):
        lo = rng.randint(1, 3)
        hi = rng.randint(lo, 5)
        index = NgramIndex(lo, hi)
        tokens = [rng.randrange(5) for _ in range(rng.randint(0, 4))]
        while len(tokens) < 60:
            k = rng.randint(1, 5)
            assert index.propose(tokens, k) == propose(tokens, k, lo, hi), (tokens, k, lo, hi)
            tokens += [rng.randrange(5) for _ in range(rng.randint(1, 5))]  # an accepted run


def test_draft_length_follows_acceptance_and_backs_off() -> None:
    d = DraftLength(4)
    assert d.want() == 4
    d.observe(4, 4)  # all accepted: stays at the limit
    assert d.want() == 4
    d.observe(4, 1)  # one accepted: draft one more than that next
    assert d.want() == 2
    d.observe(2, 2)  # a full run grows by one
    assert d.want() == 3
    skipped = []
    for _ in range(8):  # nothing accepted: 2, 4, 8, ... steps without drafts, capped
        d.observe(d.want() or 1, 0)
        n = 0
        while d.want() == 0:
            n += 1
        skipped.append(n)
    assert skipped == [min(MAX_BACKOFF_STEPS, 2**f) for f in range(1, 9)]
    d.observe(1, 1)  # an accepted draft ends the back-off
    assert d.want() == 2


def test_config_refuses_bad_values(tiny_model_dir: Callable[[str], Path]) -> None:
    from minisgl.distributed import DistributedInfo
    from minisgl.scheduler import SchedulerConfig

    base: Dict[str, Any] = {"model_path": str(tiny_model_dir(TINY)), "dtype": torch.float32}
    with pytest.raises(ValueError, match="speculative_algorithm"):
        SchedulerConfig(**base, tp_info=DistributedInfo(0, 1), speculative_algorithm="eagle")
    with pytest.raises(ValueError, match="speculative_ngram_min"):
        SchedulerConfig(
            **base, tp_info=DistributedInfo(0, 1), speculative_algorithm="ngram", speculative_ngram_min=3, speculative_ngram_max=2
        )
    # tensor parallelism takes it (rank 0 drafts, every rank runs the plan: tests/test_tp.py)
    assert SchedulerConfig(**base, tp_info=DistributedInfo(0, 2), speculative_algorithm="ngram").speculative_algorithm == "ngram"
    from minisgl.server.args import parse_args

    args = parse_args(["--speculative-algorithm", "ngram", "--speculative-num-tokens", "3", "--speculative-ngram-max", "5"])
    assert [args.engine_value(f"speculative_{k}") for k in ("algorithm", "num_tokens", "ngram_min", "ngram_max")] == ["ngram", 3, 1, 5]
    assert args.check_tp_layout() is None
    assert parse_args(["--speculative-algorithm", "ngram", "--tp", "2"]).check_tp_layout() is None


# ---- the engine: speculation on vs off ----------------------------------------------------


@pytest.fixture(scope="module", params=[1, 4], ids=["page1", "page4"])
def llm(request: pytest.FixtureRequest, tiny_model_dir: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[LLM]:
    """One LLM with speculation on (one engine per process); `speculation_off` runs it without. With
    page_size 4 a verify row's drafts often need a page of their own."""
    model_dir = _with_word_tokenizer(Path(tiny_model_dir(TINY)), tmp_path_factory.mktemp("spec"))
    llm = LLM(str(model_dir), **llm_kwargs(speculative_algorithm="ngram", page_size=request.param))
    try:
        yield llm
    finally:
        llm.shutdown()


def _copy_heavy_prompts(n: int, seed: int) -> List[List[int]]:
    """Prompts that repeat a short pattern: proposals from the first step on."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        pattern = [rng.randrange(1, 256) for _ in range(rng.randint(2, 8))]
        prompts.append((pattern * 12)[: rng.randint(12, 40)])
    return prompts


def _both(llm: LLM, reqs: List[Tuple[List[int], SamplingParams]], **kw: Any) -> Tuple[Any, Any, Any]:
    """The same requests with speculation off, then on: (off, on, the spec counters "on" added).
    The prefix cache is emptied before each so both prefill the same way."""
    sched = llm.scheduler
    with speculation_off(sched):
        sched.reset_prefix_cache()
        off = run_steps(sched, reqs, **kw)
        assert_idle_and_clean(sched)
    before = sched.stats()
    on = run_steps(sched, reqs, **kw)
    after = sched.stats()
    assert_idle_and_clean(sched)
    proposed = after.spec_proposed_tokens - before.spec_proposed_tokens
    accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
    rows = after.spec_verify_rows - before.spec_verify_rows
    return off, on, (proposed, accepted, rows)


def test_greedy_identical_with_accepted_drafts(llm: LLM) -> None:
    prompts = _copy_heavy_prompts(8, seed=1)
    reqs = [(p, SamplingParams(temperature=0.0, max_tokens=64 + 7 * i)) for i, p in enumerate(prompts)]
    off, on, (proposed, accepted, rows) = _both(llm, reqs)
    assert on[0] == off[0] and on[1] == off[1]
    assert rows > 0 and accepted > 0, (proposed, accepted, rows)
    assert (accepted + rows) / rows > 1.0  # mean tokens per verify row
    assert any(n > 1 for step in on[2] for n in step.values()), "no step emitted an accepted run"
    stats = llm.scheduler.stats()
    assert stats.spec_mean_accepted_length > 1.0 and 0.0 < stats.spec_acceptance_rate <= 1.0


def test_mixed_batch_some_rows_cannot_speculate(llm: LLM) -> None:
    """Plain, penalized, logit_bias, min_tokens, logprobs and grammar greedy rows speculate
    (verification applies those per position) beside a seeded row, which does not, in the same
    steps; every row's output equals speculation off (the grammar row's stays in its grammar)."""
    prompts = _copy_heavy_prompts(7, seed=2)
    params = [
        SamplingParams(temperature=0.0, max_tokens=60),
        SamplingParams(temperature=0.9, seed=5, max_tokens=40),
        SamplingParams(temperature=0.0, max_tokens=50, repetition_penalty=1.3),
        SamplingParams(temperature=0.0, max_tokens=50, logit_bias={7: 3.0}),
        SamplingParams(temperature=0.0, max_tokens=50, min_tokens=20, stop_token_ids=[33]),
        SamplingParams(temperature=0.0, max_tokens=45, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=70),
        SamplingParams(temperature=0.0, max_tokens=24, grammar=GrammarSpec("regex", "(w[1-9])+")),
    ]
    prompts.append(prompts[0])
    off, on, (_, accepted, rows) = _both(llm, list(zip(prompts, params)))
    assert len(on[0][7]) == 24 and all(1 <= t <= 9 for t in on[0][7])  # the grammar held
    assert on[0] == off[0] and on[1] == off[1]
    assert rows > 0
    assert any(len(step) > 1 and max(step.values()) > 1 for step in on[2]), "no step mixed a verify row with others"
    ran = {i for step in on[2] for i, n in step.items() if n > 1}  # rows that had an accepted run
    assert 1 not in ran, f"a seeded row speculated: {ran}"
    assert 7 in ran, "the grammar row had no accepted run (its drafts are cut to the grammar and masked per position)"


@pytest.mark.parametrize("wrong_at", [None, 1])
def test_penalty_bias_and_min_tokens_rows_speculate(llm: LLM, monkeypatch: pytest.MonkeyPatch, wrong_at: int | None) -> None:
    """Rows with penalties, logit_bias, min_tokens or a grammar (greedy and sampled) verify drafts
    with the sampler's adjustments per position: with an oracle proposer (each row's true
    continuation, or one with a wrong token at `wrong_at`, which the grammar row's draft is cut
    before) every greedy row has accepted runs and its output equals speculation off; the
    sampled ones run to their length."""
    import minisgl.scheduler.policy as policy

    prompts = _copy_heavy_prompts(4, seed=6)
    params = [
        SamplingParams(temperature=0.0, max_tokens=40, repetition_penalty=1.3, frequency_penalty=0.3, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=40, logit_bias={7: 3.0, 9: -2.0}, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=40, min_tokens=30, stop_token_ids=[33]),
        SamplingParams(temperature=0.0, max_tokens=40, presence_penalty=0.8, logit_bias={5: 1.5}, min_tokens=10, stop_token_ids=[5]),
        SamplingParams(temperature=0.0, max_tokens=24, grammar=GrammarSpec("regex", "(w[1-9])+"), min_tokens=4),
    ]
    prompts.append(prompts[0])
    sched = llm.scheduler
    with speculation_off(sched):
        ref, _, _ = run_steps(sched, list(zip(prompts, params)))
    monkeypatch.setattr(policy, "NgramIndex", _OracleProposer(prompts, [ref[i] for i in range(5)], wrong_at).index)
    off, on, (proposed, accepted, rows) = _both(llm, list(zip(prompts, params)))
    assert on[0] == off[0] == ref and on[1] == off[1]
    ran = {i for step in on[2] for i, n in step.items() if n > 1}
    assert ran == {0, 1, 2, 3, 4} and accepted > 0 and (wrong_at is None) == (accepted == proposed)
    sampled = [dataclasses.replace(p, temperature=0.9, max_tokens=30, ignore_eos=True, stop_token_ids=[]) for p in params[:4]]
    got, _, _ = run_steps(sched, list(zip(prompts, sampled)))
    assert all(len(got[i]) == 30 for i in range(4))
    assert_idle_and_clean(sched)


class _OracleProposer:
    """Proposes each request's true greedy continuation (from a run with speculation off), as
    a draft model equal to the target would: every draft is accepted, so runs are k + 1 tokens
    long and a stop lands inside one. `wrong_at`: draft index replaced by a wrong token (a
    partial acceptance; None: all right)."""

    def __init__(self, prompts: List[List[int]], outputs: List[List[int]], wrong_at: int | None = None) -> None:
        self.known = list(zip(prompts, outputs))
        self.wrong_at = wrong_at

    def index(self, ngram_min: int, ngram_max: int) -> "_OracleProposer":
        """Stands in for the policy's NgramIndex factory: every request asks this oracle."""
        return self

    def propose(self, tokens: List[int], k: int) -> List[int]:
        for prompt, out in self.known:
            n = len(prompt)
            if tokens[:n] == prompt and tokens[n:] == out[: len(tokens) - n]:
                draft = list(out[len(tokens) - n : len(tokens) - n + k])
                if self.wrong_at is not None and self.wrong_at < len(draft):
                    draft[self.wrong_at] = (draft[self.wrong_at] + 1) % 256
                return draft
        return []


def _first_inside_run(out: List[int], k: int) -> int:
    """An index whose token occurs there first and that is not the last of its run: with
    every draft accepted, after the prefill's token the runs are out[1 : k + 2], ..."""
    return next(j for j in range(1, len(out)) if out[j] not in out[:j] and (j - 1) % (k + 1) != k)


def test_logprobs_rows_speculate_with_the_same_logprobs(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """A row that returns logprobs (and prompt logprobs) gets each accepted token's logprob and
    top alternatives from its verify position: the same tokens and top ids as speculation off,
    values within float32 noise (a verify position attends as a prefill row, not a decode row)."""
    import minisgl.scheduler.policy as policy

    prompts = _copy_heavy_prompts(3, seed=8)
    params = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=3, prompt_logprobs=2 if i == 0 else None)
              for i in range(3)]  # fmt: skip
    sched = llm.scheduler
    with speculation_off(sched):
        off = llm.generate(prompts, params)
    monkeypatch.setattr(policy, "NgramIndex", _OracleProposer(prompts, [r.token_ids for r in off], wrong_at=2).index)
    before = sched.stats()
    on = llm.generate(prompts, params)
    assert sched.stats().spec_accepted_tokens > before.spec_accepted_tokens
    for a, b in zip(off, on):
        assert b.token_ids == a.token_ids
        assert a.logprobs is not None and b.logprobs is not None and len(b.logprobs) == len(a.logprobs) == 30
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
        assert a.top_logprobs is not None and b.top_logprobs is not None
        for ta, tb in zip(a.top_logprobs, b.top_logprobs):
            assert len(tb) == 3 and max(abs(x[1] - y[1]) for x, y in zip(ta, tb)) < 1e-4
            assert {t for t, _ in ta} == {t for t, _ in tb}
    assert on[0].prompt_logprobs is not None and len(on[0].prompt_logprobs) == len(off[0].prompt_logprobs or [])
    assert_idle_and_clean(sched)


def test_drafts_that_never_match_back_off(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """A request whose every draft is wrong (its first token always rejected) stops drafting for
    2, 4, 8, ... steps: over 80 tokens it pays for a handful of verify steps, not 80; its output
    equals speculation off."""
    import minisgl.scheduler.policy as policy

    prompts = _copy_heavy_prompts(1, seed=9)
    sched = llm.scheduler
    with speculation_off(sched):
        ref, _, _ = run_steps(sched, [(prompts[0], SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True))])
    monkeypatch.setattr(policy, "NgramIndex", _OracleProposer(prompts, [ref[0]], wrong_at=0).index)
    off, on, (proposed, accepted, rows) = _both(llm, [(prompts[0], SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True))])
    assert on[0] == off[0] == ref and accepted == 0
    # verifies at steps 0, 3, 8, 17, 34, 67 (2**f steps skipped after the f-th failure)
    assert 0 < rows <= 6, rows


@pytest.mark.parametrize("wrong_at", [None, 2])
def test_stop_token_and_max_tokens_inside_an_accepted_run(llm: LLM, monkeypatch: pytest.MonkeyPatch, wrong_at: int | None) -> None:
    import minisgl.scheduler.policy as policy

    prompts = _copy_heavy_prompts(4, seed=5)
    sched = llm.scheduler
    with speculation_off(sched):
        ref, _, _ = run_steps(sched, [(p, SamplingParams(temperature=0.0, max_tokens=60)) for p in prompts])
    outputs = [ref[i] for i in range(len(prompts))]
    monkeypatch.setattr(policy, "NgramIndex", _OracleProposer(prompts, outputs, wrong_at).index)
    k = sched.config.speculative_num_tokens
    cuts = [_first_inside_run(out, k if wrong_at is None else wrong_at) for out in outputs]
    stop_reqs = [(p, SamplingParams(temperature=0.0, max_tokens=60, stop_token_ids=[out[j]])) for p, out, j in zip(prompts, outputs, cuts)]
    length_reqs = [(p, SamplingParams(temperature=0.0, max_tokens=j + 1)) for p, j in zip(prompts, cuts)]
    off, on, (proposed, accepted, rows) = _both(llm, stop_reqs + length_reqs)
    assert on[0] == off[0] and on[1] == off[1]
    n = len(prompts)
    for i, j in enumerate(cuts):
        assert on[0][i] == outputs[i][: j + 1] and on[1][i] == "stop"
        assert on[0][n + i] == outputs[i][: j + 1] and on[1][n + i] == "length"
    if wrong_at is None:
        assert accepted == proposed > 0
    else:
        assert 0 < accepted < proposed


def test_aborts_leave_no_pages(llm: LLM) -> None:
    prompts = _copy_heavy_prompts(10, seed=4)
    reqs = [(p, SamplingParams(temperature=0.0, max_tokens=80)) for p in prompts]
    abort_at = {i: 3 + 5 * i for i in range(0, 10, 2)}  # every other request, at different points
    off, on, _ = _both(llm, reqs, abort_at=abort_at)  # (_both checks the pools)
    for i in range(10):
        if i in abort_at:
            assert on[1][i] == "abort" and on[0][i][: abort_at[i]] == off[0][i][: abort_at[i]]
        else:
            assert on[0][i] == off[0][i] and on[1][i] == off[1][i]


def test_stop_string_inside_an_accepted_run(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """LLM.generate with a stop string: ended at the same token with speculation on, the rest
    of the step's accepted run discarded."""
    import minisgl.scheduler.policy as policy

    prompt = _copy_heavy_prompts(1, seed=6)[0]
    sched = llm.scheduler
    with speculation_off(sched):
        ref, _, _ = run_steps(sched, [(prompt, SamplingParams(temperature=0.0, max_tokens=60))])
    out = ref[0]
    monkeypatch.setattr(policy, "NgramIndex", _OracleProposer([prompt], [out]).index)
    j = _first_inside_run(out, sched.config.speculative_num_tokens)
    params = SamplingParams(temperature=0.0, max_tokens=60, stop=[llm.tokenizer.decode([out[j]])])
    results = {}
    for spec in (False, True):
        sched.reset_prefix_cache()
        with speculation_off(sched) if not spec else nullcontext():
            res = llm.generate([prompt], params)[0]
        results[spec] = (res.token_ids, res.text, res.finish_reason)
        assert_idle_and_clean(sched)
    assert results[True] == results[False]
    assert results[True][2] == "stop" and results[True][0] == out[: j + 1]


def _with_word_tokenizer(model_dir: Path, tmp_path: Path) -> Path:
    """A copy of the tiny checkpoint with a word-level tokenizer: token i is the word 'w{i}'."""
    import shutil

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    out = tmp_path / "with_tokenizer"
    shutil.copytree(model_dir, out)
    vocab = {f"w{i}": i for i in range(256)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0").save_pretrained(out)
    return out


def test_metrics_export_the_spec_counters(llm: LLM) -> None:
    """/metrics' registry gets the scheduler's speculation counters (as the server pushes them)."""
    from minisgl.server.metrics import ServerMetrics

    prompts = _copy_heavy_prompts(3, seed=1)
    run_steps(llm.scheduler, [(p, SamplingParams(temperature=0.0, max_tokens=40)) for p in prompts])
    stats = llm.scheduler.stats()
    assert stats.spec_proposed_tokens > 0
    metrics = ServerMetrics()
    metrics.update_stats(stats)
    text = metrics.render().decode()
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if line.startswith("minisgl_spec_")}
    assert values["minisgl_spec_proposed_tokens_total"] == stats.spec_proposed_tokens
    assert values["minisgl_spec_accepted_tokens_total"] == stats.spec_accepted_tokens
    assert values["minisgl_spec_acceptance_rate"] == pytest.approx(stats.spec_accepted_tokens / stats.spec_proposed_tokens)
    assert values["minisgl_spec_mean_accepted_length"] == pytest.approx(
        (stats.spec_accepted_tokens + stats.spec_verify_rows) / stats.spec_verify_rows
    )


# ---- sampled rows: rejection sampling against a one-hot draft -----------------------------

CHI2_999 = {5: 20.52, 3: 16.27}  # chi-square 99.9% quantiles by degrees of freedom


def _chi2(tokens: torch.Tensor, p: torch.Tensor) -> float:
    """Pearson's statistic of `tokens` against the distribution `p`, over the tokens p allows."""
    counts = torch.bincount(tokens, minlength=p.numel()).double()
    n = counts.sum()
    keep = p > 0
    assert counts[~keep].sum() == 0, "a token the distribution excludes was drawn"
    expected = n * p[keep].double()
    return float(((counts[keep] - expected) ** 2 / expected).sum())


class _VerifyRow:
    """What make_verify_args reads of a request: its params, prompt + accepted output, and
    device_len (the drafts counted), stop ids."""

    def __init__(self, params: SamplingParams, prompt: List[int], output: List[int], num_drafts: int, stops: Any = ()) -> None:
        self.sampling_params, self.token_ids, self.prompt_len = params, prompt + output, len(prompt)
        self.device_len = len(self.token_ids) + num_drafts
        self.stop_ids = set(stops)


def test_verify_positions_get_the_samplers_adjustments() -> None:
    """Penalties, logit_bias and the min_tokens ban at each verify position equal what the
    non-speculative sampler (the oracle: sample.Sampler) applies to a request whose output is
    the accepted output plus the drafts before that position."""
    from minisgl.core import Batch, Req
    from minisgl.engine.sample import Sampler
    from minisgl.engine.spec_verify import adjusted_logits, make_verify_args

    vocab, dev = 40, torch.device("cpu")
    prompt, output, drafts = [3, 5, 7, 5], [9, 3, 9], [3, 11, 9, 33]
    cases = [
        SamplingParams(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.25),
        SamplingParams(temperature=0.7, logit_bias={11: 2.5, 4: -3.0}),
        SamplingParams(temperature=0.0, min_tokens=6, stop_token_ids=[33, 2], frequency_penalty=0.5, logit_bias={2: 1.0}),
    ]
    torch.manual_seed(3)
    logits = torch.randn(len(drafts) + 1, vocab)
    for params in cases:
        stops = {33, 2}
        args = make_verify_args([_VerifyRow(params, prompt, output, len(drafts), stops)], [drafts], vocab, dev)
        ours = adjusted_logits(logits, args)
        sampler = Sampler(dev, vocab)
        for j in range(len(drafts) + 1):
            req = Req(input_ids=torch.tensor(prompt), table_idx=0, cached_len=0, output_len=64, uid=j, sampling_params=params,
                      cache_handle=None)  # fmt: skip
            req.append_host(torch.tensor(output + drafts[:j]))
            req.device_len = len(prompt) + len(output) + j
            req.stop_ids = stops  # type: ignore[attr-defined]
            ref = sampler._prepare(Batch(reqs=[req], phase="decode"), [params])
            row = logits[j : j + 1]
            if ref.penalties is not None:
                row = ref.penalties.apply(row)
            if ref.bias is not None:
                row = ref.bias.apply(row)
            assert torch.equal(ours[j].float(), row[0].float()), (params, j)
        assert not torch.equal(ours.float(), logits), "the case adjusts nothing"


def test_rejection_sampling_keeps_the_target_distribution() -> None:
    """Verify positions of 200k sampled rows on a 6-token vocabulary: the first emitted token
    is distributed as the target's p (temperature and top-k applied), and the token after an
    accepted draft as the next position's p. A naive acceptance (always keep the draft, or
    resample from p without removing it) fails the same test."""
    from minisgl.core import SamplingParams
    from minisgl.engine.spec_verify import make_verify_args, verify_tokens

    torch.manual_seed(0)
    vocab, n, temperature = 6, 200_000, 0.8
    logits = torch.randn(2, vocab) * 1.5
    params = SamplingParams(temperature=temperature, top_k=4)

    def target(row: torch.Tensor) -> torch.Tensor:  # independent of the sampler's code
        p = torch.softmax(row / temperature, dim=-1)
        p[p < p.topk(4).values[-1]] = 0.0
        return p / p.sum()

    p0, p1 = target(logits[0]), target(logits[1])
    draft = int(p0.argmax())  # the likeliest token: accepted often, rejected often enough
    row = _VerifyRow(params, [1, 2, 3], [], 1)
    args = make_verify_args([row] * n, [[draft]] * n, vocab, torch.device("cpu"))
    rows = logits.repeat(n, 1)  # row 2i: the position fed the last token, 2i + 1: the draft's
    out = verify_tokens(rows, args).view(n, 2)
    first, after = out[:, 0], out[:, 1]
    dof = int((p0 > 0).sum()) - 1
    assert _chi2(first, p0) < CHI2_999[dof]
    accepted = first == draft
    assert _chi2(after[accepted], p1) < CHI2_999[dof]
    # the controls: naive acceptances are caught
    assert _chi2(torch.full((n,), draft), p0) > 100 * CHI2_999[dof]
    accept = torch.rand(n) < p0[draft]
    naive = torch.where(accept, torch.full((n,), draft), torch.multinomial(p0, n, replacement=True))
    assert _chi2(naive, p0) > 10 * CHI2_999[dof]


def test_sampled_rows_speculate(llm: LLM) -> None:
    """Unseeded sampled rows verify drafts too (seeded ones do not: their tokens must stay the
    non-speculative ones); they finish within max_tokens and leave no pages."""
    prompts = _copy_heavy_prompts(4, seed=7)
    before = llm.scheduler.stats().spec_verify_rows
    reqs = [(p, SamplingParams(temperature=0.7, top_p=0.9, max_tokens=30)) for p in prompts]
    tokens, reasons, _ = run_steps(llm.scheduler, reqs)
    assert_idle_and_clean(llm.scheduler)
    assert llm.scheduler.stats().spec_verify_rows > before
    assert all(len(tokens[i]) == 30 and reasons[i] == "length" for i in range(len(prompts)))
