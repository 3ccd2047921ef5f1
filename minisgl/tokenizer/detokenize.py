"""Incremental detokenization and stop strings.

`IncrementalDetokenizer` turns a growing list of token ids into text deltas. Decoding each token
alone is wrong (a multi-byte character such as 你 or 😀 is split over several byte-level tokens,
and SentencePiece decodes a word's leading space by context), and decoding everything every step
is quadratic. The standard window: `prefix_offset..read_offset` are tokens already turned into
text, kept as left context; decode `ids[prefix_offset:]` and emit what lies past the context's
text, unless it ends in U+FFFD (an incomplete character): then hold it until the next token
completes it. When the request ends, whatever is held is flushed as it decodes.

`StopMatcher` finds stop strings in the decoded text, trims the output at the first match, and
holds back a tail that might be the start of a stop string, so a stream never shows text that a
later token turns into a stop.
"""

from __future__ import annotations

from typing import Any, List, Sequence, Tuple

REPLACEMENT = "\ufffd"


def raw_decoder(tokenizer: Any) -> Any:
    """The tokenizers-library object under a fast HF tokenizer, when decoding through it gives
    exactly what `tokenizer.decode` gives (no clean-up of tokenization spaces), else None. HF's
    decode wraps that one Rust call in several times its cost of Python (argument conversion,
    kwargs, checks); detokenization calls it twice per token of every stream."""
    raw = getattr(tokenizer, "_tokenizer", None)
    if raw is None or not callable(getattr(raw, "decode", None)) or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return None
    return raw


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True, raw: Any = None) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.raw = raw  # raw_decoder(tokenizer), found once per tokenizer by the caller
        self.ids: List[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def _decode(self, ids: Sequence[int]) -> str:
        if self.raw is not None:
            return self.raw.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids: Sequence[int], final: bool = False) -> str:
        """Append tokens and return the text they complete (everything, when `final`)."""
        self.ids.extend(token_ids)
        if self.tokenizer is None:  # --skip-tokenizer-init: token ids only, never any text
            return ""
        if len(self.ids) == self.read_offset:
            return ""
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or (new_text.endswith(REPLACEMENT) and not final):
            return ""  # nothing visible yet (special token), or an incomplete character: hold
        delta = new_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return delta

    def flush(self) -> str:
        return self.add([], final=True)


class StopMatcher:
    def __init__(self, stops: Sequence[str], include: bool = False) -> None:
        self.stops = [s for s in stops if s]
        self.include = include  # release the matched stop string too (include_stop_str_in_output)
        self.max_len = max((len(s) for s in self.stops), default=0)
        self.text = ""  # all text decoded so far
        self.sent = 0  # chars of `text` released to the client

    def feed(self, delta: str, final: bool) -> Tuple[str, str | None]:
        """Add decoded text; return (text to release, the stop string matched or None)."""
        self.text += delta
        if self.stops:
            best = -1
            matched = None
            for stop in self.stops:
                pos = self.text.find(stop, self.sent)  # released text never starts a stop string
                if pos != -1 and (best == -1 or pos < best):
                    best, matched = pos, stop
            if matched is not None:
                out = self.text[self.sent : best + (len(matched) if self.include else 0)]
                self.sent = len(self.text)
                return out, matched
        end = len(self.text)
        if not final and self.stops:
            end -= self._partial_tail()
        out = self.text[self.sent : end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return out, None

    def _partial_tail(self) -> int:
        """Length of the longest suffix of the unreleased text that starts some stop string."""
        pending = self.text[self.sent :]
        for k in range(min(len(pending), self.max_len - 1), 0, -1):
            tail = pending[-k:]
            if any(stop.startswith(tail) for stop in self.stops):
                return k
        return 0


class DetokState:
    """Everything the tokenizer worker keeps for one running request."""

    def __init__(
        self,
        tokenizer: Any,
        stops: Sequence[str],
        want_logprobs: bool,
        skip_special_tokens: bool,
        prompt_tokens: int,
        include_stop_str: bool = False,
        raw: Any = None,
    ) -> None:
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens, raw)
        self.stop = StopMatcher(stops, include_stop_str)
        self.want_logprobs = want_logprobs
        self.prompt_tokens = prompt_tokens
        self.prompt_ids: List[int] = []  # the first prompt token, for prompt logprobs
        self.completion_tokens = 0
