"""Proposers of speculative decoding: what the policy asks for each decoding row's draft.

The policy decides how many tokens each row may draft (its `DraftLength`, max_tokens, the
pages to spare, the CPU loop's rows) and asks the proposer for them; the verify step then checks
every draft in one target forward (engine/spec_verify.py). Two proposers exist:

- `NgramProposer` (`--speculative-algorithm ngram`, scheduler/spec_ngram.py): a host lookup in
  the row's own tokens; deterministic drafts (q = onehot(d) for rejection sampling). Asked row by
  row, so a row's caps see the drafts the rows before it actually got.
- `DraftModelProposer` (`--speculative-algorithm draft`, scheduler/spec_draft.py): a smaller
  model with its own KV pool, drafting every row of the step in one forward per draft position;
  a sampled row's drafts come with the distributions q they were drawn from
  (`draft_probs`), which verification needs for min(1, p/q) and the residual max(0, p - q).

An EAGLE-style head fits the second shape: a `batched` proposer whose forwards also read the
target's hidden states (the verify step has them for every fed position: `Batch.prompt_hidden`),
which `accepted` would receive beside the accepted length.

Everything here is host code; a proposer that runs a model owns its device state itself.
"""

from __future__ import annotations

from typing import Any, Callable, List, Protocol, Sequence

from minisgl.scheduler.spec_ngram import NgramIndex


class Proposer(Protocol):
    # True: every row of a step drafts in one call (a model forward per draft position), so the
    # policy fixes the lengths (and reserves the pages) before asking; False: one row at a time.
    batched: bool

    def propose(self, reqs: Sequence[Any], lengths: Sequence[int], grammar: Any) -> List[List[int]]:
        """Per row up to `lengths[i]` draft tokens continuing `reqs[i].token_ids` (all of them
        known on the host: `len(token_ids) == device_len`); `grammar`: the policy's backend."""
        ...

    def draft_probs(self, req: Any) -> Any:
        """The [len(draft), V] distributions the request's last drafts were drawn from (a device
        tensor), or None: deterministic drafts (q = onehot)."""
        ...

    def accepted(self, req: Any) -> None:
        """After a verify row's acceptance: `req.cached_len` is where the target's KV ends (the
        last token and the accepted drafts); draft state past it is rolled back."""
        ...

    def release(self, req: Any) -> None:
        """The request finished, was aborted or retracted: drop what it holds (a retracted one
        starts over when it resumes)."""
        ...

    def check_idle(self) -> None:
        """With no request admitted: nothing is held (asserts)."""
        ...


class NgramProposer:
    """N-gram prompt lookup: each request keeps an `NgramIndex` (made by `make_index`, on first
    use) in `req.draft_state`."""

    batched = False

    def __init__(self, make_index: Callable[[], NgramIndex]) -> None:
        self.make_index = make_index

    def propose(self, reqs: Sequence[Any], lengths: Sequence[int], grammar: Any) -> List[List[int]]:
        drafts: List[List[int]] = []
        for req, k in zip(reqs, lengths):
            if req.draft_state is None:
                req.draft_state = self.make_index()
            drafts.append(req.draft_state.propose(req.token_ids, k) if k > 0 else [])
        return drafts

    def draft_probs(self, req: Any) -> Any:
        return None

    def accepted(self, req: Any) -> None:
        pass

    def release(self, req: Any) -> None:
        pass  # (the index lives on the request; a resumed request's tokens only grew)

    def check_idle(self) -> None:
        pass


def within_grammar(matcher: Any, draft: List[int]) -> List[int]:
    """The longest prefix of `draft` the grammar accepts (a token past a rejected one, or past
    the grammar's end, could never be emitted); the matcher is left where it was."""
    accepted = 0
    for token in draft:
        if matcher.is_terminated() or not matcher.accept_token(token):
            break
        accepted += 1
    if accepted:
        matcher.rollback(accepted)
    return draft[:accepted]
