"""Continuous batching over one Engine: a host-only policy (admission, chunked prefill,
retraction, prefix cache) that plans each step, and a runner that executes the plan."""

from typing import TYPE_CHECKING

# Torch-free: the server's command line is built from SchedulerConfig's fields without the
# engine; the rest loads on first use.
from minisgl.message.outputs import SchedulerStats, TokenOutput
from minisgl.scheduler.config import SchedulerConfig
from minisgl.utils.misc import lazy_exports

if TYPE_CHECKING:
    from minisgl.scheduler.request import UserRequest
    from minisgl.scheduler.runner import is_fatal
    from minisgl.scheduler.scheduler import Scheduler, StepFailed

__getattr__ = lazy_exports(__name__, {"Scheduler": "scheduler", "StepFailed": "scheduler", "is_fatal": "runner", "UserRequest": "request"})


__all__ = ["Scheduler", "SchedulerConfig", "SchedulerStats", "StepFailed", "TokenOutput", "UserRequest", "is_fatal"]
