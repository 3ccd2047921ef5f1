"""Verification of draft tokens (speculative decoding): the target's token at each fed position
of a verify step, such that "accept the drafts while the target's token equals the draft, then
take the target's token" is exact.

Greedy positions take the argmax. A sampled position j with draft d drawn from the proposer's
distribution q keeps d with probability min(1, p(d) / q(d)) and otherwise draws from the
residual norm(max(0, p - q)) — speculative sampling, whose output is distributed exactly as p.
A draft model's proposals come with their q rows (`VerifyArgs.draft_probs`); an n-gram draft is
deterministic, q = onehot(d), where the same rule reads: keep d with probability p(d), else draw
from p with d removed. The last position of a row (no draft after it) has q = 0: it draws from p.
p is the sampler's own distribution: softmax(logits / T) with min-p, top-k and top-p
(`sample.filtered_probs`).

Before either, each position's logits get what the sampler would apply to that token (sample.py,
in its order): penalties counted over the output so far plus the drafts before the position,
logit_bias, the stop tokens' ban while the position's output number is below min_tokens, and a
structured-output row's grammar mask in the state after the drafts before the position (its
matcher advanced through them and rolled back; the policy cut the draft where the grammar would
reject it).
Position j only decides a token when drafts 0..j-1 were accepted, and then that history is
exactly the one the non-speculative sampler would see.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Tuple

import torch

from minisgl.engine.sample import (
    MIN_P,
    MIN_T,
    LogitBias,
    Penalties,
    _allows_other_than,
    adjust_logits,
    filtered_probs,
    greedy_tokens,
)
from minisgl.sampling_params import SamplingParams
from minisgl.utils.device import make_device_tensor


@dataclass
class VerifyArgs:
    """Per verify position (the flattened fed rows of the rows with drafts): the draft it is
    compared with (-1: a row's last position) and, for the sampled rows' positions, their
    sampling parameters (`sampled` indexes those positions)."""

    drafts: torch.Tensor  # [N] int64
    sampled: torch.Tensor | None  # [M] int64 positions of sampled rows; None: every row is greedy
    temperatures: torch.Tensor | None = None  # [M]
    top_k: torch.Tensor | None = None
    top_p: torch.Tensor | None = None
    min_p: torch.Tensor | None = None
    penalties: Penalties | None = None  # per position: the output so far + the drafts before it
    bias: LogitBias | None = None  # per position: logit_bias, the min_tokens ban
    # per position of the grammar rows: (host bitmask [N, words], the positions it constrains)
    grammar_mask: Tuple[torch.Tensor, List[int]] | None = None
    logprobs_k: int | None = None  # some row returns logprobs: at every position, with this many top ones
    # [M, V] float32 per sampled position: the distribution its draft was drawn from (a row's last
    # position: zeros); None: every draft is deterministic (q = onehot(draft), the n-gram's)
    draft_probs: torch.Tensor | None = None


def make_verify_args(
    reqs: List[Any], drafts: List[List[int]], vocab_size: int, device: torch.device, grammar: Any = None,
    draft_probs: List[torch.Tensor | None] | None = None,
) -> VerifyArgs:  # fmt: skip
    """Host side: the requests with drafts and their drafts, in batch order. A request's
    `token_ids` are its prompt and accepted output (the drafts are not among them; a TP follower
    keeps them for the rows with penalties, from the plans' history), its `device_len` counts
    the drafts; `grammar` (scheduler/grammar.py's backend) masks the rows with a matcher.
    `draft_probs`: per row the [>= len(draft), V] distributions its drafts were drawn from
    (a draft model's sampled rows), or None for a deterministic draft."""
    params: List[SamplingParams] = [r.sampling_params for r in reqs]
    flat: List[int] = []
    sampled: List[int] = []
    ts: List[float] = []
    ks: List[int] = []
    ps: List[float] = []
    mins: List[float] = []
    qs: List[torch.Tensor] = []
    has_q = draft_probs is not None and any(q is not None for q in draft_probs)
    no_draft = torch.zeros(1, vocab_size, dtype=torch.float32, device=device) if has_q else None  # a row's last position
    for i, (p, d) in enumerate(zip(params, drafts)):
        if not p.is_greedy:
            n = len(d) + 1
            sampled += range(len(flat), len(flat) + n)
            ts += [max(p.temperature, MIN_T)] * n
            ks += [p.top_k if p.top_k >= 1 else vocab_size] * n
            ps += [min(max(p.top_p, MIN_P), 1.0)] * n  # (as the sampler clamps it)
            mins += [p.min_p] * n
            if has_q:
                assert draft_probs is not None
                qs += _draft_rows(draft_probs[i], d, no_draft)
        flat += d + [-1]
    args = VerifyArgs(make_device_tensor(flat, torch.int64, device), None)
    if sampled:
        args.sampled = make_device_tensor(sampled, torch.int64, device)
        if has_q:
            args.draft_probs = torch.cat(qs).to(device=device, dtype=torch.float32)
        args.temperatures = make_device_tensor(ts, torch.float32, device)
        if any(k != vocab_size for k in ks):
            args.top_k = make_device_tensor(ks, torch.int32, device)
        if any(p < 1.0 for p in ps):
            args.top_p = make_device_tensor(ps, torch.float32, device)
        if any(m > 0.0 for m in mins):
            args.min_p = make_device_tensor(mins, torch.float32, device)
    wanted = [p.logprobs for p in params if p.logprobs is not None]
    args.logprobs_k = max(wanted) if wanted else None
    if any(p.has_penalties for p in params):
        args.penalties = _position_penalties(reqs, drafts, device)
    if any(getattr(r, "grammar_matcher", None) is not None for r in reqs):
        assert grammar is not None, "a grammar row speculates without the grammar backend"
        args.grammar_mask = _position_masks(reqs, drafts, grammar)
    if any(p.logit_bias or p.min_tokens for p in params):
        args.bias = _position_bias(reqs, drafts, device, args.grammar_mask)
    return args


def _draft_rows(q: torch.Tensor | None, draft: List[int], no_draft: Any) -> List[torch.Tensor]:
    """A sampled row's q at each of its verify positions, as pieces to concatenate: its drafts'
    distributions (one-hot for a deterministic draft), then `no_draft` (zeros) at its last
    position (no draft there: p itself is drawn)."""
    if q is not None:
        return [q if q.shape[0] == len(draft) else q[: len(draft)], no_draft]  # (a cut draft: its first rows)
    rows = torch.zeros(len(draft), no_draft.shape[1], dtype=torch.float32, device=no_draft.device)
    rows[torch.arange(len(draft), device=no_draft.device), torch.tensor(draft, dtype=torch.int64, device=no_draft.device)] = 1.0
    return [rows, no_draft]


def _position_masks(reqs: List[Any], drafts: List[List[int]], grammar: Any) -> Tuple[torch.Tensor, List[int]]:
    """Each grammar row's bitmask at each of its positions: the matcher's state after the drafts
    before it (advanced, then rolled back: the matcher ends where it began)."""
    total = sum(len(d) + 1 for d in drafts)
    mask = grammar.xgr.allocate_token_bitmask(total, grammar.vocab_size)
    rows: List[int] = []
    pos = 0
    for req, d in zip(reqs, drafts):
        matcher = getattr(req, "grammar_matcher", None)
        if matcher is None:
            pos += len(d) + 1
            continue
        advanced = 0
        for j in range(len(d) + 1):
            matcher.fill_next_token_bitmask(mask, pos + j)
            rows.append(pos + j)
            if j < len(d):
                ok = matcher.accept_token(d[j])
                assert ok, "a draft the grammar rejects (the policy cuts drafts to the grammar)"
                advanced += 1
        if advanced:
            matcher.rollback(advanced)
        pos += len(d) + 1
    return mask, rows


def _position_penalties(reqs: List[Any], drafts: List[List[int]], device: torch.device) -> Penalties:
    """The sampler's Penalties (sample.Sampler._prepare_penalties) with one row per verify
    position: a row's counts at position j are its output's plus those of drafts[:j]."""
    rows: List[int] = []
    tokens: List[int] = []
    counts: List[float] = []
    presence: List[float] = []
    frequency: List[float] = []
    repetition: List[float] = []
    pos = 0
    for req, d in zip(reqs, drafts):
        p = req.sampling_params
        seen: Dict[int, int] = {}
        if p.has_penalties:
            for t in req.token_ids[req.prompt_len :]:
                seen[t] = seen.get(t, 0) + 1
            if p.repetition_penalty != 1.0:
                for t in set(req.token_ids[: req.prompt_len]):
                    seen.setdefault(t, 0)
        for j in range(len(d) + 1):
            if p.has_penalties:
                if j > 0:
                    seen[d[j - 1]] = seen.get(d[j - 1], 0) + 1
                rows += [pos] * len(seen)
                tokens += list(seen.keys())
                counts += [float(c) for c in seen.values()]
            presence.append(p.presence_penalty)
            frequency.append(p.frequency_penalty)
            repetition.append(p.repetition_penalty)
            pos += 1
    return Penalties(
        rows=make_device_tensor(rows, torch.int64, device),
        tokens=make_device_tensor(tokens, torch.int64, device),
        output_counts=make_device_tensor(counts, torch.float32, device),
        presence=make_device_tensor(presence, torch.float32, device),
        frequency=make_device_tensor(frequency, torch.float32, device),
        repetition=make_device_tensor(repetition, torch.float32, device),
    )


def _position_bias(
    reqs: List[Any], drafts: List[List[int]], device: torch.device, grammar_mask: Tuple[torch.Tensor, List[int]] | None
) -> LogitBias | None:
    """The sampler's LogitBias (sample.Sampler._prepare_bias) per verify position: logit_bias at
    every position, -inf on the stop tokens at a position whose output number is below
    min_tokens, except where the grammar allows nothing but stop tokens (as the sampler)."""
    constrained = set(grammar_mask[1]) if grammar_mask is not None else set()
    rows: List[int] = []
    tokens: List[int] = []
    values: List[float] = []
    pos = 0
    for req, d in zip(reqs, drafts):
        p = req.sampling_params
        # position 0 samples output number device_len - prompt_len of the step before the
        # drafts (device_len includes them here; on a TP follower token_ids may lag, this not)
        produced = req.device_len - len(d) - req.prompt_len
        for j in range(len(d) + 1):
            if p.logit_bias:
                rows += [pos] * len(p.logit_bias)
                tokens += list(p.logit_bias.keys())
                values += [float(v) for v in p.logit_bias.values()]
            if p.min_tokens and produced + j < p.min_tokens:
                stops = sorted(req.stop_ids)
                if pos in constrained and grammar_mask is not None and not _allows_other_than(grammar_mask[0][pos], stops):
                    pos += 1
                    continue
                rows += [pos] * len(stops)
                tokens += stops
                values += [float("-inf")] * len(stops)
            pos += 1
    if not rows:
        return None
    return LogitBias(
        rows=make_device_tensor(rows, torch.int64, device),
        tokens=make_device_tensor(tokens, torch.int64, device),
        values=make_device_tensor(values, torch.float32, device),
        depends_on_step=True,
    )


def verify_tokens(logits: torch.Tensor, args: VerifyArgs, grammar: Any = None) -> torch.Tensor:
    """The target's token at each verify position ([N] int64)."""
    logits = adjusted_logits(logits, args, grammar)
    tokens = greedy_tokens(logits).to(torch.int64)
    if args.sampled is None:
        return tokens
    assert args.temperatures is not None
    rows = args.sampled
    probs = filtered_probs(logits.index_select(0, rows).float(), args.temperatures, args.top_k, args.top_p, args.min_p)
    tokens[rows] = accept_or_resample(probs, args.drafts.index_select(0, rows), args.draft_probs)
    return tokens


def adjusted_logits(logits: torch.Tensor, args: VerifyArgs, grammar: Any = None) -> torch.Tensor:
    """Each position's logits as the sampler adjusts them for that token (`sample.adjust_logits`,
    with this step's per-position penalties, bias and masks); `logits` itself is left intact."""
    return adjust_logits(logits, args.penalties, args.bias, args.grammar_mask, grammar)


def accept_or_resample(probs: torch.Tensor, drafts: torch.Tensor, draft_probs: torch.Tensor | None = None) -> torch.Tensor:
    """Per row of `probs` ([M, V] p, unnormalised) and its draft d drawn from q (`draft_probs`
    [M, V]; None: q = onehot(d)): d with probability min(1, p(d) / q(d)), else a draw from
    norm(max(0, p - q)). A row whose draft is -1 (q = 0) draws from p. Then the token is
    distributed as p whatever q was: P(x) = min(q(x), p(x)) + P(reject) * residual(x) = p(x)."""
    probs = probs / probs.sum(dim=-1, keepdim=True)
    has_draft = drafts >= 0
    safe = drafts.clamp_min(0)
    p_draft = probs.gather(1, safe.unsqueeze(1)).squeeze(1)
    if draft_probs is None:
        # q = onehot(d) (an n-gram draft), without a [M, V] q: q(d) = 1, and max(0, p - q) is p
        # with d's entry zeroed (p(d) <= 1)
        q_draft = has_draft.to(probs.dtype)
        residual = probs.scatter(1, safe.unsqueeze(1), torch.zeros_like(p_draft).unsqueeze(1))
    else:
        q = draft_probs.to(probs.dtype)
        q = q / q.sum(dim=-1, keepdim=True).clamp_min(1e-30)  # (a last position's zeros stay zeros)
        q_draft = q.gather(1, safe.unsqueeze(1)).squeeze(1)
        residual = (probs - q).clamp_min_(0.0)
    # u < p/q written as u * q < p: no division, and q(d) = 0 (never drawn) never accepts
    accept = has_draft & (torch.rand(probs.shape[0], device=probs.device) * q_draft < p_draft)
    # p <= q everywhere means p = q: the draft is always accepted and the residual is never used;
    # rounding can leave it (near) all-zero, so p stands in rather than a draw from nothing
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    residual = torch.where(empty | ~has_draft.unsqueeze(1), probs, residual)
    cdf = residual.cumsum(dim=-1)
    u = torch.rand(probs.shape[0], 1, device=probs.device)
    drawn = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(1).clamp_max_(probs.shape[1] - 1)
    return torch.where(accept, drafts, drawn)
