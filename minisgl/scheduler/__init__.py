"""Continuous batching over one Engine: a host-only policy (admission, chunked prefill,
retraction, prefix cache) that plans each step, and a runner that executes the plan."""

from minisgl.scheduler.config import SchedulerConfig
from minisgl.scheduler.policy import SchedulerStats
from minisgl.scheduler.request import TokenOutput, UserRequest
from minisgl.scheduler.runner import is_fatal
from minisgl.scheduler.scheduler import Scheduler, StepFailed

__all__ = ["Scheduler", "SchedulerConfig", "SchedulerStats", "StepFailed", "TokenOutput", "UserRequest", "is_fatal"]
