"""Batched sampling where every request has its own temperature, top-k, top-p, min-p and seed.

All-greedy batches take an argmax. In mixed batches the greedy rows ride along the draw at a tiny
temperature and then take the exact argmax (lowest token id on ties, like torch.argmax), so a
greedy request gives its solo tokens beside any sampled company: at T = 1e-6 two tied (or nearly
tied) logits still split the mass and the draw would pick between them. Order of filters: min-p on
the full tempered distribution, then top-k, then top-p over the renormalised remainder (keep a
token while the mass before it is < p, so the best token always survives).

On CUDA with triton every draw outside FlashInfer is a Gumbel-max
draw (minisgl/kernel/triton_sampling.py): argmax(logits / T + Gumbel noise) over the tokens the
filters keep, one read of the logits and no softmax when nobody filters; each row's noise comes
from its own seed (random, or the request's per-step seed), so a seeded request draws the same
token whichever path its batch takes. CPU draws by inverse CDF from one uniform per row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Tuple

import torch

from minisgl.core import Batch, SamplingParams
from minisgl.kernel.fused import use_fused, use_fused_on
from minisgl.utils.device import make_device_tensor

MIN_T = 1e-6
MIN_P = 1e-6


@dataclass
class BatchSamplingArgs:
    temperatures: torch.Tensor | None
    top_k: torch.Tensor | None = None
    top_p: torch.Tensor | None = None
    min_p: torch.Tensor | None = None
    # (row, per-step seed) for requests that asked for a seed: their draw depends only on the
    # seed and the token position, never on which other requests share the batch.
    seeded_rows: List[Tuple[int, int]] | None = None
    penalties: "Penalties | None" = None
    logprobs_k: int | None = None  # return logprobs with this many top alternatives
    bias: "LogitBias | None" = None  # logit_bias, and stop tokens banned before min_tokens
    # structured output: the token bitmask of the batch (host) and the rows it constrains
    grammar_mask: Tuple[torch.Tensor, List[int]] | None = None
    # rows of greedy requests in a mixed batch: their token is the exact argmax, not the draw's
    greedy_rows: torch.Tensor | None = None


@dataclass
class LogitBias:
    """Sparse additions to the logits (rows, tokens, values): a request's logit_bias, and -inf on
    its stop tokens while it has generated fewer than min_tokens."""

    rows: torch.Tensor  # [N]
    tokens: torch.Tensor  # [N]
    values: torch.Tensor  # [N] float
    depends_on_step: bool  # a min_tokens ban ends after some step: do not reuse across steps

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        logits = logits.to(torch.float32, copy=True)  # one copy; the model's buffer stays intact
        logits.index_put_((self.rows, self.tokens), self.values, accumulate=True)
        return logits


@dataclass
class Penalties:
    """Sparse token counts of the rows that use penalties, applied to the logits on device."""

    rows: torch.Tensor  # [N] batch row of each (row, token) pair
    tokens: torch.Tensor  # [N]
    output_counts: torch.Tensor  # [N] float: occurrences among generated tokens (0: prompt only)
    presence: torch.Tensor  # [B]
    frequency: torch.Tensor  # [B]
    repetition: torch.Tensor  # [B]

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        logits = logits.float().clone()
        rows, tokens = self.rows, self.tokens
        picked = logits[rows, tokens]
        rep = self.repetition[rows]
        picked = torch.where(picked > 0, picked / rep, picked * rep)
        generated = (self.output_counts > 0).float()
        picked = picked - self.presence[rows] * generated - self.frequency[rows] * self.output_counts
        logits[rows, tokens] = picked
        return logits


@dataclass
class Sampler:
    device: torch.device
    vocab_size: int
    # set by the scheduler once a request asks for structured output (minisgl.scheduler.grammar)
    grammar: Any = None

    def __post_init__(self) -> None:
        # Resolved once: a failing import retried every step costs milliseconds of host time.
        self._flashinfer = _load_flashinfer_sampler() if self.device.type == "cuda" else None
        self._cache_key: Tuple[int, ...] | None = None
        self._cache_args: BatchSamplingArgs | None = None
        self._cache_params: List[SamplingParams] = []

    def warmup(self, max_batch: int, dtype: torch.dtype) -> None:
        """CUDA: compile the Gumbel kernels for every batch size now, not mid-run."""
        if use_fused_on(self.device):
            from minisgl.kernel.triton_sampling import warmup

            warmup(max_batch, self.vocab_size, dtype, self.device)

    def prepare(self, batch: Batch) -> BatchSamplingArgs:
        """Host side, before the forward: turn per-request params into device tensors.

        Consecutive decode steps over the same requests reuse the previous tensors, unless a
        request's draw depends on its step (seed) or its history (penalties)."""
        params = [r.sampling_params for r in batch.reqs]
        key = tuple(map(id, params))
        if key == self._cache_key and self._cache_args is not None:
            return self._cache_args
        args = self._prepare(batch, params)
        cacheable = (
            args.seeded_rows is None
            and args.penalties is None
            and args.grammar_mask is None
            and (args.bias is None or not args.bias.depends_on_step)
        )
        # holding `params` keeps their ids from being reused by new objects while cached
        self._cache_key, self._cache_args, self._cache_params = (key, args, params) if cacheable else (None, None, [])
        return args

    def _prepare(self, batch: Batch, params: List[SamplingParams]) -> BatchSamplingArgs:
        penalties = self._prepare_penalties(batch, params) if any(p.has_penalties for p in params) else None
        wanted = [p.logprobs for p in params if p.logprobs is not None]
        logprobs_k = max(wanted) if wanted else None
        grammar_mask = None
        if self.grammar is not None and any(p.grammar is not None for p in params):
            grammar_mask = self.grammar.batch_mask([getattr(r, "grammar_matcher", None) for r in batch.reqs])
        bias = self._prepare_bias(batch, grammar_mask) if any(p.logit_bias or p.min_tokens for p in params) else None
        if all(p.is_greedy for p in params):
            return BatchSamplingArgs(temperatures=None, penalties=penalties, logprobs_k=logprobs_k, bias=bias, grammar_mask=grammar_mask)
        ts = [max(0.0 if p.is_greedy else p.temperature, MIN_T) for p in params]
        top_ks = [p.top_k if p.top_k >= 1 else self.vocab_size for p in params]
        top_ps = [min(max(p.top_p, MIN_P), 1.0) for p in params]
        min_ps = [0.0 if p.is_greedy else p.min_p for p in params]
        top_k = top_p = min_p = None
        if any(k != self.vocab_size for k in top_ks):
            top_k = make_device_tensor(top_ks, torch.int32, self.device)
        if any(p < 1.0 for p in top_ps):
            top_p = make_device_tensor(top_ps, torch.float32, self.device)
        if any(p > 0.0 for p in min_ps):
            min_p = make_device_tensor(min_ps, torch.float32, self.device)
        seeded = [
            (i, _step_seed(r.sampling_params.seed, r.device_len))
            for i, r in enumerate(batch.reqs)
            if r.sampling_params.seed is not None and not r.sampling_params.is_greedy
        ]
        temps = make_device_tensor(ts, torch.float32, self.device)
        greedy = [i for i, p in enumerate(params) if p.is_greedy]
        greedy_rows = make_device_tensor(greedy, torch.int64, self.device) if greedy else None
        return BatchSamplingArgs(temps, top_k, top_p, min_p, seeded or None, penalties, logprobs_k, bias, grammar_mask, greedy_rows)

    def _prepare_bias(self, batch: Batch, grammar_mask: Tuple[torch.Tensor, List[int]] | None = None) -> LogitBias | None:
        """logit_bias, and the min_tokens ban on stop tokens. The grammar wins over min_tokens: a
        constrained row whose grammar allows nothing but stop tokens (it is complete) keeps them,
        or every token would be masked and the draw would land outside the grammar."""
        constrained = set(grammar_mask[1]) if grammar_mask is not None else set()
        rows: List[int] = []
        tokens: List[int] = []
        values: List[float] = []
        banning = False
        for i, r in enumerate(batch.reqs):
            p = r.sampling_params
            if p.logit_bias:
                rows += [i] * len(p.logit_bias)
                tokens += list(p.logit_bias.keys())
                values += [float(v) for v in p.logit_bias.values()]
            # the token sampled now is output number device_len - prompt_len (0-based)
            if p.min_tokens and r.device_len - r.prompt_len < p.min_tokens:
                stops = getattr(r, "stop_ids", None)
                stops = set(p.stop_token_ids) if stops is None else stops
                if i in constrained and grammar_mask is not None and not _allows_other_than(grammar_mask[0][i], stops):
                    continue
                rows += [i] * len(stops)
                tokens += list(stops)
                values += [float("-inf")] * len(stops)
                banning = True  # ends after some step: these args must not be reused
        if not rows:
            return None
        dev = self.device
        return LogitBias(
            rows=make_device_tensor(rows, torch.int64, dev),
            tokens=make_device_tensor(tokens, torch.int64, dev),
            values=make_device_tensor(values, torch.float32, dev),
            depends_on_step=banning,
        )

    def _prepare_penalties(self, batch: Batch, params: List[SamplingParams]) -> Penalties:
        rows: List[int] = []
        tokens: List[int] = []
        counts: List[float] = []
        for i, r in enumerate(batch.reqs):
            p = r.sampling_params
            if not p.has_penalties:
                continue
            out_ids, out_counts = torch.unique(r.output_ids, return_counts=True)
            seen = dict(zip(out_ids.tolist(), out_counts.tolist()))
            if p.repetition_penalty != 1.0:
                for t in torch.unique(r.input_ids[: r.prompt_len]).tolist():
                    seen.setdefault(t, 0)
            rows += [i] * len(seen)
            tokens += list(seen.keys())
            counts += [float(c) for c in seen.values()]
        dev = self.device
        return Penalties(
            rows=make_device_tensor(rows, torch.int64, dev),
            tokens=make_device_tensor(tokens, torch.int64, dev),
            output_counts=make_device_tensor(counts, torch.float32, dev),
            presence=make_device_tensor([p.presence_penalty for p in params], torch.float32, dev),
            frequency=make_device_tensor([p.frequency_penalty for p in params], torch.float32, dev),
            repetition=make_device_tensor([p.repetition_penalty for p in params], torch.float32, dev),
        )

    def sample(self, logits: torch.Tensor, args: BatchSamplingArgs) -> torch.Tensor:
        logits = adjust_logits(logits, args.penalties, args.bias, args.grammar_mask, self.grammar)
        if args.temperatures is None:
            return greedy_tokens(logits)
        filters = args.top_k is not None or args.top_p is not None or args.min_p is not None
        gumbel = use_fused(logits)
        if gumbel and not filters:
            # the kernel's rows at T <= its GREEDY_T take the plain argmax already (no noise)
            return _gumbel_draw(logits, args.temperatures, args.seeded_rows)
        if self._flashinfer is not None and args.min_p is None and args.seeded_rows is None:
            tokens = self._flashinfer(logits.float(), args.temperatures, args.top_k, args.top_p)
            return _with_greedy_rows(tokens, logits, args.greedy_rows)
        probs = filtered_probs(logits.float(), args.temperatures, args.top_k, args.top_p, args.min_p)
        if gumbel:
            # Same noise and scores as the unfiltered path, the filtered-out tokens at -inf: a seeded
            # row without filters draws exactly what it would in a batch that nobody filters. (A
            # greedy row's own top-k/top-p may drop one of tied maxima, in sort order: its argmax
            # is taken over the unfiltered logits.)
            tokens = _gumbel_draw(logits.masked_fill(probs == 0, float("-inf")), args.temperatures, args.seeded_rows)
            return _with_greedy_rows(tokens, logits, args.greedy_rows)
        return _with_greedy_rows(_draw(probs, args.seeded_rows), logits, args.greedy_rows)


def adjust_logits(
    logits: torch.Tensor, penalties: Penalties | None, bias: LogitBias | None,
    grammar_mask: Tuple[torch.Tensor, List[int]] | None, grammar: Any,
) -> torch.Tensor:  # fmt: skip
    """What a request's sampling parameters do to its logits before the draw, in this order:
    penalties, then logit_bias and the min_tokens ban, then the grammar mask (`grammar`: the
    scheduler's backend). `logits` itself is left intact (the model's buffer)."""
    if penalties is not None:
        logits = penalties.apply(logits)
    if bias is not None:
        logits = bias.apply(logits)
    if grammar_mask is not None:
        logits = logits.to(torch.float32, copy=True)  # never mask the model's own buffer
        grammar.apply(logits, *grammar_mask)
    return logits


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """The argmax of each row, the lowest token id on ties (torch.argmax's rule, and the C one's)."""
    if logits.device.type == "cpu":
        from minisgl.kernel.cpu import argmax_rows

        # the C row argmax: torch's CPU argmax (and its bf16 cast) is a visible share of a decode step
        fast = argmax_rows(logits)
        if fast is not None:
            return fast
        if logits.dtype != torch.float32:
            logits = logits.float()  # CPU argmax over bf16 is slower than cast + argmax
    return torch.argmax(logits, dim=-1)


def _with_greedy_rows(tokens: torch.Tensor, logits: torch.Tensor, greedy_rows: torch.Tensor | None) -> torch.Tensor:
    """The draw's tokens with the greedy rows' replaced by their exact argmax."""
    if greedy_rows is None:
        return tokens
    tokens = tokens.to(torch.int64)
    tokens[greedy_rows] = greedy_tokens(logits.index_select(0, greedy_rows)).to(torch.int64)
    return tokens


def _allows_other_than(mask_row: torch.Tensor, tokens: Any) -> bool:
    """Whether a grammar bitmask row (int32 words, bit t % 32 of word t // 32) allows a token
    outside `tokens`."""
    words = mask_row.clone()
    for t in tokens:
        if 0 <= t < words.numel() * 32:
            bit = 1 << (t & 31)
            words[t >> 5] = int(words[t >> 5]) & ~(bit - (1 << 32) if bit >= 1 << 31 else bit)
    return bool(words.any())


def _load_flashinfer_sampler() -> Any:
    try:
        from minisgl.engine.sample_flashinfer import sample_flashinfer

        return sample_flashinfer
    except ImportError:
        return None


def _step_seed(seed: int, position: int) -> int:
    return (seed * 1_000_003 + position) % (1 << 63)


def _gumbel_draw(logits: torch.Tensor, temperatures: torch.Tensor, seeded_rows: List[Tuple[int, int]] | None) -> torch.Tensor:
    """Gumbel-max draw on CUDA: fresh random seeds from torch's generator (honours manual_seed,
    no host sync), then the seeded requests' step seeds written over theirs in one copy."""
    from minisgl.kernel.triton_sampling import gumbel_sample

    seeds = torch.randint(0, 2**62, (logits.shape[0],), dtype=torch.int64, device=logits.device)
    if seeded_rows:
        rows_and_seeds = make_device_tensor(list(zip(*seeded_rows)), torch.int64, logits.device)
        seeds.index_put_((rows_and_seeds[0],), rows_and_seeds[1])
    return gumbel_sample(logits, temperatures, seeds)


def sample_torch(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None = None,
    seeded_rows: List[Tuple[int, int]] | None = None,
) -> torch.Tensor:
    """The torch sampler: filters, then an inverse-CDF draw (CPU; the CUDA reference)."""
    return _draw(filtered_probs(logits, temperatures, top_k, top_p, min_p), seeded_rows)


def filtered_probs(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
) -> torch.Tensor:
    """softmax(logits / T) with min-p, top-k and top-p applied (dropped tokens at 0, not renormalised)."""
    probs = torch.softmax(logits / temperatures.unsqueeze(1), dim=-1)
    if min_p is not None:
        threshold = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
        probs = probs.masked_fill(probs < threshold, 0.0)
    if top_k is not None or top_p is not None:
        sorted_probs, sorted_idx = probs.sort(dim=-1, descending=True)
        if top_k is not None:
            rank = torch.arange(probs.shape[1], device=probs.device).unsqueeze(0)
            sorted_probs = sorted_probs.masked_fill(rank >= top_k.unsqueeze(1), 0.0)
        if top_p is not None:
            sorted_probs = sorted_probs / sorted_probs.sum(dim=-1, keepdim=True)
            before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass ranked ahead of each token
            sorted_probs = sorted_probs.masked_fill(before >= top_p.unsqueeze(1), 0.0)
        # Back to vocabulary order before drawing: a row's draw must not depend on whether
        # another row in the batch made the batch take this sorted path (seeded requests).
        probs = torch.zeros_like(probs).scatter_(1, sorted_idx, sorted_probs)
    return probs


def _draw(probs: torch.Tensor, seeded_rows: List[Tuple[int, int]] | None) -> torch.Tensor:
    """Inverse-CDF draw: one uniform per row (cheap on CPU, whose RNG is slow, and free of
    torch.multinomial's host sync on CUDA); seeded rows take their uniform from their own
    generator. A zero-probability entry never wins: its CDF value equals its predecessor's."""
    cdf = probs.cumsum(dim=-1)
    u = torch.rand(probs.shape[0], 1, device=probs.device)
    for row, step_seed in seeded_rows or ():
        gen = torch.Generator(device=probs.device).manual_seed(step_seed)
        u[row] = torch.rand(1, generator=gen, device=probs.device)
    picked = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(1)
    return picked.clamp_max_(probs.shape[1] - 1)
