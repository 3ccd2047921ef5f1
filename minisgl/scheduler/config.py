"""SchedulerConfig: an EngineConfig plus the scheduling knobs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from minisgl.engine.config import EngineConfig
from minisgl.utils.cli import SCHEDULING, knob, nonnegative_float, positive_float, positive_int
from minisgl.utils.env import read_env


def overlap_disabled_by_env() -> bool:
    return read_env().disable_overlap_scheduling


@dataclass(frozen=True)
class SchedulerConfig(EngineConfig):
    # Per-step token budget for prefill (chunked prefill splits longer prompts).
    max_extend_tokens: int = knob(
        8192,
        "tokens per step at most (prompt chunks + the decode rows mixed in); longer prompts are prefilled in chunks",
        group=SCHEDULING,
        flags=("--chunked-prefill-size", "--max-prefill-length"),
        type=positive_int,
    )
    # A step that prefills beside decoding streams delays each of their next tokens by its whole
    # length: its prompt tokens are capped so that it takes about this long, estimated from the
    # measured step times (scheduler/step_budget.py). None: 3x the measured decode step on a CPU,
    # off on CUDA; 0: off (only max_extend_tokens bounds a step).
    max_step_ms: float | None = knob(
        None,
        "target length (ms) of a step that prefills beside decoding streams: its prompt tokens are capped to fit, "
        "from measured step times (at least 16 a step); 0: off",
        group=SCHEDULING,
        type=nonnegative_float,
        default_text="3x a decode step on a CPU, off on CUDA",
    )
    cache_type: str = knob(
        "radix",
        "prefix cache: radix (reuse shared prefixes) or naive (none)",
        group=SCHEDULING,
        flags=("--cache",),
        choices=("radix", "naive"),
    )
    # None: on, unless MINISGL_DISABLE_OVERLAP_SCHEDULING=1.
    enable_overlap: bool | None = knob(
        None, "do not prepare step N+1 while step N runs", group=SCHEDULING, flags=("--disable-overlap",), switch=False
    )
    # "optimistic": admit while the pool holds the prompt plus an estimate of what running
    # requests will still generate, retract (and later recompute) requests when a decode step
    # runs out of pages. "worst-case": reserve prompt + max_tokens at admission, never retract.
    admission: Literal["optimistic", "worst-case"] = knob(
        "optimistic",
        "optimistic: admit on an estimate of what running requests will still generate and retract "
        "(later recompute) requests when the KV pool runs out; worst-case: reserve prompt + max_tokens, never retract",
        group=SCHEDULING,
        choices=("optimistic", "worst-case"),
    )
    # Scales the estimated share of max_tokens a running request will still generate (> 1:
    # admit fewer, retract less; the share is capped at 1, i.e. worst-case reservation).
    schedule_conservativeness: float = knob(
        1.0,
        "scales the optimistic estimate of tokens still to come (> 1: admit fewer, retract less)",
        group=SCHEDULING,
        type=positive_float,
    )
    # The estimate starts at init and moves each decode step (time constant decay_steps)
    # toward 1.25x the share that recently finished requests used (min before any finished,
    # never below min); each retraction raises it.
    init_new_token_ratio: float = 0.5
    min_new_token_ratio: float = 0.05
    new_token_ratio_decay_steps: int = 32
    # Decode rows ride along with prefill chunks in one batch under max_extend_tokens, so a
    # running stream never waits a whole prefill step (False: prefill and decode alternate).
    mixed_batches: bool = knob(
        True, "prefill and decode alternate instead of sharing a step", group=SCHEDULING, flags=("--disable-mixed-batches",), switch=False
    )
    # "fcfs": arrival order. "priority": SamplingParams.priority first (lower first; FIFO among
    # equals), and retraction takes the least urgent first.
    schedule_policy: Literal["fcfs", "priority"] = knob(
        "fcfs",
        "fcfs: arrival order; priority: the request field 'priority' first (lower first), retraction takes the least urgent",
        group=SCHEDULING,
        choices=("fcfs", "priority"),
    )

    # Speculative decoding (scheduler/spec_proposer.py): decoding rows get drafts (n-gram prompt
    # lookup, or a smaller draft model) and verify them in one extend step; the rest of the batch
    # decodes as usual.
    speculative_algorithm: str | None = knob(
        None,
        "ngram: rows propose the tokens that followed the latest earlier match of their last n tokens "
        "(prompt + output); draft: a smaller model sharing the tokenizer (--speculative-draft-model) proposes them. "
        "Drafts are verified in one step (outputs keep their distribution; forces the non-overlap loop)",
        group=SCHEDULING,
        choices=("ngram", "draft"),
        default_text="off",
    )
    # The draft model of speculative_algorithm "draft" (a path or hub id, same vocabulary as the
    # model): its own weights and KV pool, run eagerly at tp 1 (scheduler/spec_draft.py).
    speculative_draft_model: str | None = knob(
        None,
        "the draft model of --speculative-algorithm draft: a smaller checkpoint with the same vocabulary",
        group=SCHEDULING,
        default_text="none",
    )
    speculative_num_tokens: int = knob(4, "draft tokens proposed per speculating row and step at most", group=SCHEDULING, type=positive_int)
    speculative_ngram_min: int = knob(1, "shortest n-gram the lookup matches", group=SCHEDULING, type=positive_int)
    speculative_ngram_max: int = knob(4, "longest n-gram the lookup matches (tried first)", group=SCHEDULING, type=positive_int)

    def __post_init__(self) -> None:
        if self.max_extend_tokens < 1:
            raise ValueError(f"max_extend_tokens must be >= 1, got {self.max_extend_tokens}")
        if self.max_step_ms is not None and not 0.0 <= self.max_step_ms <= 1e6:
            raise ValueError(f"max_step_ms must be in [0, 1e6] (0: off), got {self.max_step_ms}")
        if self.admission not in ("optimistic", "worst-case"):
            raise ValueError(f"admission must be 'optimistic' or 'worst-case', got {self.admission!r}")
        if self.schedule_policy not in ("fcfs", "priority"):
            raise ValueError(f"schedule_policy must be 'fcfs' or 'priority', got {self.schedule_policy!r}")
        if not 0.0 < self.schedule_conservativeness <= 1e6:
            raise ValueError(f"schedule_conservativeness must be in (0, 1e6], got {self.schedule_conservativeness}")
        if not 0.0 < self.min_new_token_ratio <= self.init_new_token_ratio <= 1.0:
            raise ValueError(
                "new-token ratios must satisfy 0 < min_new_token_ratio <= init_new_token_ratio <= 1, got "
                f"{self.min_new_token_ratio} and {self.init_new_token_ratio}"
            )
        if self.new_token_ratio_decay_steps < 1:
            raise ValueError(f"new_token_ratio_decay_steps must be >= 1, got {self.new_token_ratio_decay_steps}")
        if self.speculative_algorithm not in (None, "ngram", "draft"):
            raise ValueError(f"speculative_algorithm must be None (off), 'ngram' or 'draft', got {self.speculative_algorithm!r}")
        if self.speculative_algorithm == "draft":
            if self.speculative_draft_model is None:
                raise ValueError("speculative_algorithm='draft' needs speculative_draft_model (--speculative-draft-model PATH)")
            if self.tp_info.size > 1:
                raise ValueError(
                    f"speculative_algorithm='draft' runs the draft model at tp 1 only (got tp={self.tp_info.size}); use 'ngram' with tp > 1"
                )
        elif self.speculative_draft_model is not None:
            raise ValueError(
                f"speculative_draft_model={self.speculative_draft_model!r} is only used with speculative_algorithm='draft' "
                f"(got {self.speculative_algorithm!r})"
            )
        if self.speculative_num_tokens < 1:
            raise ValueError(f"speculative_num_tokens must be >= 1, got {self.speculative_num_tokens}")
        if not 1 <= self.speculative_ngram_min <= self.speculative_ngram_max:
            raise ValueError(
                "speculative n-gram lengths must satisfy 1 <= speculative_ngram_min <= speculative_ngram_max, got "
                f"{self.speculative_ngram_min} and {self.speculative_ngram_max}"
            )

    @property
    def overlap(self) -> bool:
        if self.enable_overlap is not None:
            return self.enable_overlap
        return not overlap_disabled_by_env()
