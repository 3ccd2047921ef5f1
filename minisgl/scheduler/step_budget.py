"""The prompt tokens a step may carry beside decoding streams, from measured step times.

A step that prefills prompt tokens while requests decode delays every one of their next tokens
by its whole length. On a CPU a step of 8,192 prompt tokens takes seconds, so `--max-step-ms`
caps the prompt tokens of such a step at what keeps it near a target latency. The step time is
modelled as `fixed + per_token x prompt tokens`:

- `fixed`: an EWMA of the time of decode-only steps (the part of a step its decode rows cost);
- `per_token`: the EWMAs of (step time - fixed) and of the prompt tokens of the steps that carried
  prompt tokens, one over the other (so large chunks, whose timing is mostly prompt work, weigh
  more than a one-token prompt whose step is mostly fixed cost).

The target is `--max-step-ms`, or (the CPU default) `AUTO_FACTOR` x the measured decode step.
Until both parts are measured, and whenever the estimate leaves less, a step carries `FLOOR`
prompt tokens, so prompts still get in at a steady rate however slow the machine. A step without
decode rows is never capped: nobody waits on it but the prompts themselves.

The trade-off: a smaller step keeps streams smooth (their largest gap near the target) but a
long prompt needs more steps, and each pays the decode rows' fixed cost again: its time to
first token grows. Host only: the scheduler reports each step's time (`observe`), the policy
asks `prompt_tokens()` when it plans a step with decode rows.
"""

from __future__ import annotations

AUTO_FACTOR = 3.0  # default target: this many decode steps
FLOOR = 16  # prompt tokens a capped step carries at least (benchmark/mixed_gap.py --defaults: docs/PERFORMANCE.md)
ALPHA = 0.2  # weight of the newest observation in each EWMA


def _ewma(old: float | None, new: float) -> float:
    return new if old is None else old + ALPHA * (new - old)


class StepBudget:
    """Measured step costs and the prompt-token cap they give (see the module docstring)."""

    def __init__(self, target_ms: float | None) -> None:
        if target_ms is not None and not target_ms > 0.0:
            raise ValueError(f"max_step_ms must be > 0 (0 turns the budget off), got {target_ms}")
        self.target_ms = target_ms  # None: AUTO_FACTOR x the decode step
        self.decode_ms: float | None = None  # EWMA of decode-only steps
        self._excess_ms: float | None = None  # EWMA of (step - decode_ms) over prompt-carrying steps
        self._tokens: float | None = None  # EWMA of their prompt tokens

    @property
    def token_ms(self) -> float | None:
        """Estimated milliseconds per prompt token."""
        if self._excess_ms is None or self._tokens is None:
            return None
        return self._excess_ms / self._tokens

    @property
    def target(self) -> float | None:
        if self.target_ms is not None:
            return self.target_ms
        return AUTO_FACTOR * self.decode_ms if self.decode_ms is not None else None

    def observe(self, decode_rows: int, prompt_tokens: int, ms: float) -> None:
        """A step that ran `decode_rows` decode rows and `prompt_tokens` prompt tokens took `ms`."""
        if prompt_tokens <= 0:
            if decode_rows > 0:
                self.decode_ms = _ewma(self.decode_ms, ms)
            return
        # A prefill-only step pays a fixed cost too (the weights are read once per step): before
        # a decode step is measured the whole step counts as prompt work (an overestimate).
        fixed = self.decode_ms or 0.0
        self._excess_ms = _ewma(self._excess_ms, max(0.0, ms - fixed))
        self._tokens = _ewma(self._tokens, float(prompt_tokens))

    def prompt_tokens(self) -> int:
        """The prompt tokens a step with decode rows may carry now (at least FLOOR)."""
        target, token_ms, fixed = self.target, self.token_ms, self.decode_ms
        if target is None or token_ms is None or fixed is None:
            return FLOOR
        if token_ms <= 0.0:
            return 1 << 30  # prompt tokens measured as free: no cap
        return max(FLOOR, int((target - fixed) / token_ms))
