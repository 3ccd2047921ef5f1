"""The prompt-token budget of steps beside decoding streams (`--max-step-ms`,
scheduler/step_budget.py), fed synthetic step times: no test here depends on the machine's speed.
The oracle is the step-time model the timings come from: a step of P prompt tokens beside decode
rows takes FIXED + PER_TOKEN x P ms, so a target T allows (T - FIXED) / PER_TOKEN tokens."""

from __future__ import annotations

import pytest

from minisgl.scheduler.step_budget import AUTO_FACTOR, FLOOR, StepBudget

FIXED, PER_TOKEN = 15.0, 0.05  # ms of a decode step, ms per prompt token


def feed(budget: StepBudget, steps: int, prompt_tokens: int, fixed: float = FIXED, per_token: float = PER_TOKEN) -> None:
    """Alternate decode-only steps and steps carrying `prompt_tokens` beside 4 decode rows."""
    for _ in range(steps):
        budget.observe(4, 0, fixed)
        budget.observe(4, prompt_tokens, fixed + per_token * prompt_tokens)


def test_cap_follows_the_measured_costs() -> None:
    auto = StepBudget(None)
    assert auto.prompt_tokens() == FLOOR  # nothing measured yet: the floor
    feed(auto, 1, 500)
    want = (AUTO_FACTOR * FIXED - FIXED) / PER_TOKEN  # 600 tokens
    assert auto.prompt_tokens() == pytest.approx(want, abs=1)
    fixed_target = StepBudget(100.0)
    feed(fixed_target, 1, 500)
    assert fixed_target.prompt_tokens() == pytest.approx((100.0 - FIXED) / PER_TOKEN, abs=1)
    # the machine gets twice as slow: the estimates follow (EWMA), the fixed target allows half,
    # the automatic one (3 decode steps, twice as long now) the same
    feed(fixed_target, 60, 500, 2 * FIXED, 2 * PER_TOKEN)
    feed(auto, 60, 500, 2 * FIXED, 2 * PER_TOKEN)
    assert fixed_target.prompt_tokens() == pytest.approx((100.0 - 2 * FIXED) / (2 * PER_TOKEN), abs=1)
    assert auto.prompt_tokens() == pytest.approx(want, abs=1)


def test_floor_and_weighting() -> None:
    slow = StepBudget(20.0)
    feed(slow, 5, 100, per_token=1.0)  # 5 ms over the decode step buys 5 tokens: the floor wins
    assert slow.prompt_tokens() == FLOOR
    # big chunks weigh more than tiny prompts, whose step is mostly fixed cost plus timing noise
    mixed = StepBudget(None)
    mixed.observe(4, 0, FIXED)
    for _ in range(20):
        mixed.observe(4, 1, FIXED + 3.0)  # a one-token prompt whose step ran 3 ms long (noise)
        mixed.observe(4, 1000, FIXED + PER_TOKEN * 1000)
    assert mixed.token_ms == pytest.approx(PER_TOKEN, rel=0.1)
    # a prefill-only step before any decode step counts whole (an overestimate, so a smaller cap)
    first = StepBudget(None)
    first.observe(0, 1000, FIXED + PER_TOKEN * 1000)
    assert first.token_ms == pytest.approx(FIXED / 1000 + PER_TOKEN)
    with pytest.raises(ValueError, match="max_step_ms"):
        StepBudget(0.0)
