"""Prompt logprobs (what lm-eval's loglikelihood tasks read): computed during prefill, equal to
HF's log-softmax over the same prompt in float32 within 1e-4, across chunked prefill, overlap
scheduling and a warm prefix cache (a request that wants them is never served from the cache)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import random_prompts
from sched_helpers import TINY, greedy, running_llm


@pytest.mark.parametrize("chunk", [16, 4096])
def test_prompt_logprobs_match_hf(tiny_model_dir: Any, hf_oracle: Any, chunk: int) -> None:
    prompts = random_prompts([45, 7, 2, 30], seed=5)
    oracle = hf_oracle(TINY)
    with running_llm(tiny_model_dir(TINY), max_extend_tokens=chunk, page_size=4) as llm:
        llm.generate(prompts, greedy(3))  # warm the prefix cache with the same prompts
        results = llm.generate(prompts + [prompts[0]], [greedy(3, prompt_logprobs=3)] * len(prompts) + [greedy(3)])
        assert results[-1].prompt_logprobs is None and results[-1].cached_tokens > 0  # the others skipped the cache
        for prompt, result in zip(prompts, results):
            assert result.cached_tokens == 0
            expect = torch.log_softmax(oracle.logits(prompt), dim=-1)
            entries = result.prompt_logprobs
            assert entries is not None and len(entries) == len(prompt) - 1
            for p, (token, logprob, tops) in enumerate(entries):
                assert token == prompt[p + 1]
                assert abs(logprob - expect[p, token].item()) < 1e-4
                top_vals, top_ids = expect[p].topk(3)
                assert [t for t, _ in tops] == top_ids.tolist()
                assert max(abs(v - e) for (_, v), e in zip(tops, top_vals.tolist())) < 1e-4
            # generation itself is unchanged by asking
            assert result.token_ids == oracle.greedy(prompt, 3)[0]
