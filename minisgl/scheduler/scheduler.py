"""The scheduler of one rank: a Policy (host, `policy.py`) driving a Runner (device,
`runner.py`) over one Engine."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, List, Set

import torch

from minisgl.engine import Engine
from minisgl.scheduler.config import SchedulerConfig
from minisgl.scheduler.policy import Policy, SchedulerStats, StepFailed
from minisgl.scheduler.request import TokenOutput
from minisgl.scheduler.runner import Runner, is_fatal
from minisgl.utils.hf import resolve_model_path

__all__ = ["Scheduler", "SchedulerStats", "StepFailed", "is_fatal"]


class Scheduler(Policy):
    def __init__(self, config: SchedulerConfig) -> None:
        if config.max_extend_tokens < 1:  # before the engine is built
            raise ValueError(f"max_extend_tokens must be >= 1, got {config.max_extend_tokens}")
        self.engine = Engine(config)
        self.device = self.engine.device
        # On a CPU the forward runs to completion inside the launch: there is nothing for the
        # host to overlap, and reading results a step late only delays every token by a step.
        # An explicit enable_overlap still wins (the tests run both ways).
        overlap = config.overlap and (config.enable_overlap is not None or self.device.type != "cpu")
        model_config = self.engine.config.model_config
        super().__init__(
            config,
            self._make_runner(self.engine),
            num_pages=self.engine.num_pages,
            max_seq_len=self.engine.max_seq_len,
            vocab_size=model_config.vocab_size,
            eos_ids=set(model_config.eos_token_ids) | _generation_eos(config.model_path),
            overlap=overlap,
            share_rows=config.tp_info.size > 1,
        )

    def _make_runner(self, engine: Engine) -> Runner:
        return Runner(engine)

    @property
    def token_pool(self) -> torch.Tensor:
        assert isinstance(self.runner, Runner)
        return self.runner.token_pool

    @torch.inference_mode()
    def step(self) -> List[TokenOutput]:
        return super().step()

    def shutdown(self) -> None:
        self.engine.shutdown()


def _generation_eos(model_path: str) -> Set[int]:
    try:
        path = Path(resolve_model_path(model_path)) / "generation_config.json"
        eos: Any = json.loads(path.read_text()).get("eos_token_id") if path.exists() else None
    except (OSError, ValueError):
        return set()
    if eos is None:
        return set()
    return {eos} if isinstance(eos, int) else set(eos)
