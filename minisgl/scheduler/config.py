"""SchedulerConfig: an EngineConfig plus the scheduling knobs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from minisgl.engine.config import EngineConfig
from minisgl.utils.env import read_env


def overlap_disabled_by_env() -> bool:
    return read_env().disable_overlap_scheduling


@dataclass(frozen=True)
class SchedulerConfig(EngineConfig):
    # Per-step token budget for prefill (chunked prefill splits longer prompts).
    max_extend_tokens: int = 8192
    cache_type: str = "radix"  # "radix" (prefix reuse) or "naive"
    # None: on, unless MINISGL_DISABLE_OVERLAP_SCHEDULING=1.
    enable_overlap: bool | None = None
    # "optimistic": admit while the pool holds the prompt plus an estimate of what running
    # requests will still generate, retract (and later recompute) requests when a decode step
    # runs out of pages. "worst-case": reserve prompt + max_tokens at admission, never retract.
    admission: Literal["optimistic", "worst-case"] = "optimistic"
    # Scales the estimated share of max_tokens a running request will still generate (> 1:
    # admit fewer, retract less; the share is capped at 1, i.e. worst-case reservation).
    schedule_conservativeness: float = 1.0
    # The estimate starts at init and moves each decode step (time constant decay_steps)
    # toward 1.25x the share that recently finished requests used (min before any finished,
    # never below min); each retraction raises it.
    init_new_token_ratio: float = 0.5
    min_new_token_ratio: float = 0.05
    new_token_ratio_decay_steps: int = 32
    # Decode rows ride along with prefill chunks in one batch under max_extend_tokens, so a
    # running stream never waits a whole prefill step (False: prefill and decode alternate).
    mixed_batches: bool = True
    # "fcfs": arrival order. "priority": SamplingParams.priority first (lower first; FIFO among
    # equals), and retraction takes the least urgent first.
    schedule_policy: Literal["fcfs", "priority"] = "fcfs"

    def __post_init__(self) -> None:
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

    @property
    def overlap(self) -> bool:
        if self.enable_overlap is not None:
            return self.enable_overlap
        return not overlap_disabled_by_env()
