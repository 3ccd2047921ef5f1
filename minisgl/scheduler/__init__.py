"""Continuous batching over one Engine: a host-only policy (admission, chunked prefill,
retraction, prefix cache) that plans each step, and a runner that executes the plan."""

import importlib
from typing import TYPE_CHECKING, Any

# Torch-free: the server's command line is built from SchedulerConfig's fields without the
# engine; the rest loads on first use.
from minisgl.message.outputs import SchedulerStats, TokenOutput
from minisgl.scheduler.config import SchedulerConfig

if TYPE_CHECKING:
    from minisgl.scheduler.request import UserRequest
    from minisgl.scheduler.runner import is_fatal
    from minisgl.scheduler.scheduler import Scheduler, StepFailed

_LAZY = {"Scheduler": "scheduler", "StepFailed": "scheduler", "is_fatal": "runner", "UserRequest": "request"}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)


__all__ = ["Scheduler", "SchedulerConfig", "SchedulerStats", "StepFailed", "TokenOutput", "UserRequest", "is_fatal"]
