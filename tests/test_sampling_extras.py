"""logit_bias and min_tokens, applied in the batched sampler: checked against plain greedy runs
of the same tiny float32 model (the oracle: what the model picks without them)."""

from __future__ import annotations

from typing import Any

from sched_helpers import TINY, greedy, running_llm

from minisgl.core import SamplingParams

PROMPTS = [[5, 17, 33, 2, 9, 41, 7, 8], [11, 3, 250, 64, 1, 99]]


def test_logit_bias_bans_and_forces_tokens(tiny_model_dir: Any) -> None:
    with running_llm(tiny_model_dir(TINY)) as llm:
        ref = [r.token_ids for r in llm.generate(PROMPTS, greedy(6))]
        first = ref[0][0]
        banned, forced, free = llm.generate(
            PROMPTS + [PROMPTS[0]],
            [
                SamplingParams(max_tokens=6, logit_bias={first: -100.0}),
                SamplingParams(max_tokens=6, logit_bias={42: 100.0}),
                SamplingParams(max_tokens=6),  # shares the batch: unchanged
            ],
        )
        assert banned.token_ids[0] != first
        assert forced.token_ids == [42] * 6
        assert free.token_ids == ref[0]
        # sampled rows obey it too
        hot = llm.generate([PROMPTS[1]], SamplingParams(temperature=1.0, max_tokens=8, seed=3, logit_bias={42: 100.0}))[0]
        assert hot.token_ids == [42] * 8


def test_min_tokens_holds_back_stop_tokens(tiny_model_dir: Any) -> None:
    with running_llm(tiny_model_dir(TINY)) as llm:
        ref = llm.generate([PROMPTS[0]], greedy(12, ignore_eos=True))[0].token_ids
        stop = ref[2]
        early = llm.generate([PROMPTS[0]], greedy(12, ignore_eos=True, stop_token_ids=[stop]))[0]
        assert early.finish_reason == "stop" and early.token_ids == ref[:3]
        held = llm.generate([PROMPTS[0]], greedy(12, ignore_eos=True, stop_token_ids=[stop], min_tokens=6))[0]
        assert stop not in held.token_ids[:6] and len(held.token_ids) >= 6
        assert held.token_ids[:2] == ref[:2]  # nothing changes before the stop token would come
