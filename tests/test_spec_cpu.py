"""Speculative decoding on the CPU's fast path (issue 29): bf16 verify steps run on the C decode
loop. Its own module: it needs an engine of its own (one per process), apart from
test_spec_ngram.py's module-scoped float32 one."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, List

import pytest
from helpers import TEST_DEVICE, record_runners
from sched_helpers import TINY, llm_kwargs
from test_spec_ngram import _both, _copy_heavy_prompts, _with_word_tokenizer

from minisgl.core import SamplingParams
from minisgl.llm import LLM


@pytest.mark.skipif(TEST_DEVICE != "cpu", reason="the CPU decode loop")
def test_bf16_verify_steps_run_on_the_decode_loop(tiny_model_dir: Callable[[str], Path], tmp_path: Path) -> None:
    """bf16 on the CPU: a verify step (each row's last token and its drafts) runs on the C decode
    loop, whose per-row arithmetic does not depend on the step's row count, so greedy outputs
    with speculation equal those without it token for token (in bf16, not only float32), and no
    verify step feeds more tokens than the loop takes (`fast_step_tokens`)."""
    from minisgl.engine.cpu_decode import CpuDecodeLoop
    from minisgl.kernel.cpu import cpu_kernels

    kern = cpu_kernels()
    if kern is None or not kern.has_gemv:
        pytest.skip("no C compiler or no AVX512-BF16 here")
    model_dir = _with_word_tokenizer(Path(tiny_model_dir(TINY)), tmp_path)
    llm = LLM(str(model_dir), **llm_kwargs(speculative_algorithm="ngram", dtype="bfloat16", max_running_req=4))
    try:
        engine = llm.scheduler.engine
        loop = engine.cpu_runner
        assert isinstance(loop, CpuDecodeLoop) and engine.fast_step_tokens == loop.rows >= 2
        fed: List[int] = []
        run = loop.run
        loop.run = lambda batch: (fed.append(int(batch.input_ids.numel())), run(batch))[1]  # type: ignore[method-assign]
        log = record_runners(engine)
        reqs = [(p, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)) for p in _copy_heavy_prompts(2, seed=4)]
        off, on, (proposed, accepted, rows) = _both(llm, reqs)
        assert on[0] == off[0] and accepted > 0 and rows > 0
        verify_steps = [i for i, step in enumerate(on[2]) if any(n > 1 for n in step.values())]
        assert verify_steps, "no accepted run"
        assert ("CpuDecodeLoop", "prefill") in log, "no verify step ran on the decode loop"
        assert ("ModuleRunner", "decode") not in log
        assert max(fed) <= loop.rows
    finally:
        llm.shutdown()
