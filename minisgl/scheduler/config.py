"""SchedulerConfig: an EngineConfig plus the scheduling knobs."""

from __future__ import annotations

import os
from dataclasses import dataclass

from minisgl.engine.config import EngineConfig


def overlap_disabled_by_env() -> bool:
    return os.environ.get("MINISGL_DISABLE_OVERLAP_SCHEDULING", "0").lower() in ("1", "true", "yes")


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
