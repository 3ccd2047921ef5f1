"""N-gram prompt lookup: the draft proposer of `--speculative-algorithm ngram`.

A request's last n tokens are looked up in its own earlier tokens (prompt + output); the tokens
that followed the most recent earlier occurrence are the draft (copied on past the end when the
match is closer to the end than the draft is long: a repeating cycle continues). Longer n-grams are tried first
(a longer match predicts better). Pure host code on lists: no model, no device.
"""

from __future__ import annotations

from typing import List, Sequence


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
