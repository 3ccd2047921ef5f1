"""SchedulerConfig: an EngineConfig plus the scheduling knobs."""

from __future__ import annotations

from dataclasses import dataclass

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

    @property
    def overlap(self) -> bool:
        if self.enable_overlap is not None:
            return self.enable_overlap
        return not overlap_disabled_by_env()
