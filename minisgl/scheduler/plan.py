"""StepPlan: what the policy decided for one step, as plain integers and lists.

The policy (host only) builds one per launched step; the runner (the only scheduler code that
touches the device) executes it. At tp > 1 rank 0 pickles it to the other ranks, whose runners
execute the same plan on their shard: nothing else crosses between the ranks' schedulers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Tuple

from minisgl.sampling_params import SamplingParams

# (table row, first column, values): a run of page-table or token-pool entries to write
Write = Tuple[int, int, List[int]]


@dataclass
class NewRow:
    """A request a runner sees for the first time. Only a runner that keeps its own request
    objects (a TP follower) needs it: for the sampler's inputs (params, penalty history, the
    stop ids min_tokens bans, the grammar its mask comes from)."""

    uid: int
    prompt: List[int]
    params: SamplingParams
    stop_ids: List[int]


@dataclass
class PromptLogprobs:
    """Prefill rows whose logits give prompt logprobs: flattened token rows, the prompt token
    each predicts, and per batch row how many of them it owns (in row order)."""

    rows: List[int]
    targets: List[int]
    counts: List[int]


@dataclass
class StepPlan:
    phase: str  # "prefill" (possibly mixed: decode rows first) or "decode"
    uids: List[int]
    rows: List[int]  # each request's table row (page table and token pool)
    starts: List[int]  # tokens [start, end) of each row are fed this step (start = cached_len)
    ends: List[int]
    emits: List[bool]  # the row's sampled token is real (False: a non-final prompt chunk)
    num_decode_rows: int = 0  # a mixed step's decode rows (one token each) come first
    page_writes: List[Write] = field(default_factory=list)
    token_writes: List[Write] = field(default_factory=list)
    # (main page, window page) pairs of the pages allocated for this step (a model with sliding
    # layers: kvcache/window.py): the runner writes each slot's entry of the pool's translation
    window_writes: List[Tuple[int, int]] = field(default_factory=list)
    prompt_logprobs: PromptLogprobs | None = None
    # For runners with their own request objects (TP followers), applied before the rows:
    releases: List[int] = field(default_factory=list)  # uids that finished: forget them
    new_rows: List[NewRow] = field(default_factory=list)
    history: Dict[int, List[int]] = field(default_factory=dict)  # uid -> tokens accepted since the last plan
    # A verify step (speculative decoding): per row its draft tokens, fed after its last token
    # ([] for a row that does not speculate: a one-token extend); empty for any other step.
    drafts: List[List[int]] = field(default_factory=list)
    # ... and per row the distributions its drafts were drawn from (a draft model's sampled rows:
    # a device tensor, in this process only; None: deterministic drafts). Never sent: a draft
    # model runs at tp 1.
    draft_probs: List[Any] = field(default_factory=list, repr=False, compare=False)
    # The policy's own request objects, for a runner in the same process (never sent: a
    # follower resolves `uids` to its own objects).
    reqs: List[Any] = field(default_factory=list, repr=False, compare=False)

    @property
    def size(self) -> int:
        return len(self.uids)

    @property
    def is_decode(self) -> bool:
        return self.phase == "decode"

    @property
    def is_prefill(self) -> bool:
        return self.phase == "prefill"

    def __getstate__(self) -> Dict[str, Any]:
        state = dict(self.__dict__)
        state["reqs"] = []
        state["draft_probs"] = []
        return state
