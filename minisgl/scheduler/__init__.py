"""Continuous batching over one Engine: admission, chunked prefill, decode, prefix cache, overlap."""

from minisgl.scheduler.config import SchedulerConfig
from minisgl.scheduler.request import TokenOutput, UserRequest
from minisgl.scheduler.scheduler import Scheduler, SchedulerStats, StepFailed, is_fatal

__all__ = ["Scheduler", "SchedulerConfig", "SchedulerStats", "StepFailed", "TokenOutput", "UserRequest", "is_fatal"]
