"""N-gram prompt lookup: the draft proposer of `--speculative-algorithm ngram`.

A request's last n tokens are looked up in its own earlier tokens (prompt + output); the tokens
that followed the most recent earlier occurrence are the draft (copied on past the end when the
match is closer to the end than the draft is long: a repeating cycle continues). Longer n-grams are
tried first (a longer match predicts better). Pure host code on lists: no model, no device.

`propose` is the definition (a scan of the whole sequence); a request keeps an `NgramIndex`,
which answers the same from a table of each n-gram's latest start, updated as tokens arrive: a
step costs O(ngram_max), not O(context). `DraftLength` decides how many tokens a request drafts:
it follows the accepted lengths and backs off from a request whose drafts keep failing, so a
workload that does not copy stops paying for verify steps.
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple


def propose(tokens: Sequence[int], num_tokens: int, ngram_min: int, ngram_max: int) -> List[int]:
    """Up to `num_tokens` draft tokens continuing `tokens`, or [] when no n-gram of length
    `ngram_max` down to `ngram_min` occurs earlier in `tokens`."""
    size = len(tokens)
    if num_tokens <= 0:
        return []
    for n in range(min(ngram_max, size - 1), ngram_min - 1, -1):
        tail = list(tokens[size - n :])
        first = tail[0]
        # the latest earlier start s < size - n with tokens[s : s + n] == tail
        for s in range(size - n - 1, -1, -1):
            if tokens[s] == first and list(tokens[s : s + n]) == tail:
                return _continue(tokens, s + n, num_tokens)
    return []


def _continue(tokens: Sequence[int], start: int, num_tokens: int) -> List[int]:
    """The `num_tokens` that follow position `start` when the text from there is copied on past
    the end (an overlapping copy, as LZ77's): a match close to the end, inside a repeating
    cycle, still proposes a whole draft, continuing the cycle. Only the draft is built (this
    runs per speculating row per step: no copy of the request's tokens)."""
    size = len(tokens)
    draft: List[int] = []
    for i in range(num_tokens):
        j = start + i  # < size + i: start < size
        draft.append(tokens[j] if j < size else draft[j - size])
    return draft


class NgramIndex:
    """`propose` over one request's growing token list, incrementally. The table holds, for every
    n-gram (n in [ngram_min, ngram_max]) that ends before the sequence's last token, its latest
    start: exactly the candidates `propose` scans for (an occurrence of the tail that starts
    before the tail itself). Tokens may only be appended, which is how a request's list grows."""

    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        self.ngram_min, self.ngram_max = ngram_min, ngram_max
        self._latest: Dict[Tuple[int, ...], int] = {}
        self._indexed = 0  # n-grams ending at or before this position are in the table

    def propose(self, tokens: Sequence[int], num_tokens: int) -> List[int]:
        size = len(tokens)
        if num_tokens <= 0:
            return []
        self._index(tokens, size - 1)
        for n in range(min(self.ngram_max, size - 1), self.ngram_min - 1, -1):
            start = self._latest.get(tuple(tokens[size - n :]))
            if start is not None:
                return _continue(tokens, start + n, num_tokens)
        return []

    def _index(self, tokens: Sequence[int], end: int) -> None:
        """Add the n-grams ending at positions (exclusive ends) self._indexed + 1 .. end, in
        order, so a later start replaces an earlier one."""
        latest = self._latest
        for e in range(self._indexed + 1, end + 1):
            for n in range(self.ngram_min, min(self.ngram_max, e) + 1):
                latest[tuple(tokens[e - n : e])] = e - n
        self._indexed = max(self._indexed, end)


# Consecutive all-rejected verifies after which a request stops drafting, for 2**failures decode
# steps (capped): a verify step costs more than a decode step, and a row whose drafts never match
# (text that copies nothing) would otherwise pay it on every step.
MAX_BACKOFF_STEPS = 64


class DraftLength:
    """How many tokens one request drafts next. The length follows what the target accepts: one
    more than the last accepted run (so a fully accepted draft grows by one, up to the limit); after
    a verify that accepted nothing the request drafts nothing for 1, 2, 4, ... steps."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.next = limit
        self._failures = 0
        self._skip = 0

    def want(self) -> int:
        """Tokens to draft this step (0: decode without drafts)."""
        if self._skip > 0:
            self._skip -= 1
            return 0
        return self.next

    def observe(self, proposed: int, accepted: int) -> None:
        self.next = max(1, min(self.limit, accepted + 1))
        if accepted == 0 and proposed > 0:
            self._failures += 1
            self._skip = min(MAX_BACKOFF_STEPS, 2**self._failures)
        else:
            self._failures = 0
