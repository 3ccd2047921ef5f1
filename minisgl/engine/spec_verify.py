"""Verification of draft tokens (speculative decoding): the target's token at each fed position
of a verify step, such that "accept the drafts while the target's token equals the draft, then
take the target's token" is exact.

Greedy positions take the argmax. A sampled position j with draft d (a deterministic, one-hot
draft) keeps d with probability p(d) and otherwise draws from p with d removed, renormalised —
standard speculative sampling with q = onehot(d), whose output is distributed exactly as p. The
last position of a row (no draft after it) draws from p. p is the sampler's own distribution:
softmax(logits / T) with min-p, top-k and top-p (`sample.filtered_probs`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

import torch

from minisgl.engine.sample import MIN_P, MIN_T, filtered_probs, greedy_tokens
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


def make_verify_args(params: List[SamplingParams], drafts: List[List[int]], vocab_size: int, device: torch.device) -> VerifyArgs:
    """Host side: `params` and `drafts` of the rows with drafts, in batch order."""
    flat: List[int] = []
    sampled: List[int] = []
    ts: List[float] = []
    ks: List[int] = []
    ps: List[float] = []
    mins: List[float] = []
    for p, d in zip(params, drafts):
        if not p.is_greedy:
            n = len(d) + 1
            sampled += range(len(flat), len(flat) + n)
            ts += [max(p.temperature, MIN_T)] * n
            ks += [p.top_k if p.top_k >= 1 else vocab_size] * n
            ps += [min(max(p.top_p, MIN_P), 1.0)] * n  # (as the sampler clamps it)
            mins += [p.min_p] * n
        flat += d + [-1]
    args = VerifyArgs(make_device_tensor(flat, torch.int64, device), None)
    if sampled:
        args.sampled = make_device_tensor(sampled, torch.int64, device)
        args.temperatures = make_device_tensor(ts, torch.float32, device)
        if any(k != vocab_size for k in ks):
            args.top_k = make_device_tensor(ks, torch.int32, device)
        if any(p < 1.0 for p in ps):
            args.top_p = make_device_tensor(ps, torch.float32, device)
        if any(m > 0.0 for m in mins):
            args.min_p = make_device_tensor(mins, torch.float32, device)
    return args


def verify_tokens(logits: torch.Tensor, args: VerifyArgs) -> torch.Tensor:
    """The target's token at each verify position ([N] int64)."""
    tokens = greedy_tokens(logits).to(torch.int64)
    if args.sampled is None:
        return tokens
    assert args.temperatures is not None
    rows = args.sampled
    probs = filtered_probs(logits.index_select(0, rows).float(), args.temperatures, args.top_k, args.top_p, args.min_p)
    tokens[rows] = accept_or_resample(probs, args.drafts.index_select(0, rows))
    return tokens


def accept_or_resample(probs: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    """Per row of `probs` ([M, V], unnormalised): the draft with probability p(draft), else a
    draw from p without the draft; a row whose draft is -1 draws from p."""
    probs = probs / probs.sum(dim=-1, keepdim=True)
    has_draft = drafts >= 0
    safe = drafts.clamp_min(0)
    p_draft = probs.gather(1, safe.unsqueeze(1)).squeeze(1)
    accept = has_draft & (torch.rand(probs.shape[0], device=probs.device) < p_draft)
    residual = probs.scatter(1, safe.unsqueeze(1), torch.zeros_like(p_draft).unsqueeze(1))
    residual = torch.where(has_draft.unsqueeze(1), residual, probs)
    # (a draft of probability 1 is always accepted: its all-zero residual is never used)
    cdf = residual.cumsum(dim=-1)
    u = torch.rand(probs.shape[0], 1, device=probs.device)
    drawn = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(1).clamp_max_(probs.shape[1] - 1)
    return torch.where(accept, drafts, drawn)
