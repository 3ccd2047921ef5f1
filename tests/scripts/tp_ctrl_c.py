"""Ctrl-C in the middle of a tp=2 generate: the interrupt is sent from the scheduler loop itself
once the first tokens are out (never from a timer, which a fast machine would outrun), so the
generate is always mid-way when it arrives. Prints INTERRUPTED, then AFTER <tokens> <ranks agree>."""

import os
import signal
import sys
from typing import Any, List

from minisgl.core import SamplingParams
from minisgl.llm import LLM


def main(model_dir: str) -> None:
    llm = LLM(model_dir, tp=2, dtype="float32", device="cpu", max_running_req=4,
              max_seq_len_override=512, num_page_override=4 * 512 + 8)  # fmt: skip
    step = llm.scheduler.step
    sent: List[bool] = []

    def step_then_interrupt() -> List[Any]:
        outputs = step()
        if any(o.token_id is not None for o in outputs) and not sent:
            sent.append(True)
            os.kill(os.getpid(), signal.SIGINT)  # held by LLM until this step is over
        return outputs

    llm.scheduler.step = step_then_interrupt  # type: ignore[method-assign]
    long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    try:
        llm.generate([[1, 2, 3]] * 4, long)
        print("NOT INTERRUPTED")
    except KeyboardInterrupt:
        print("INTERRUPTED")
    llm.scheduler.step = step  # type: ignore[method-assign]
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=5))
    fps = llm.scheduler.rank_fingerprints()
    llm.scheduler.check_invariants()
    print("AFTER", len(out[0].token_ids), fps[0] == fps[1], flush=True)
    llm.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
