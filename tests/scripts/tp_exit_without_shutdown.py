"""Leave the interpreter without LLM.shutdown() at tp=2: the worker rank must go with it.
Prints WORKER <pid> first, so the test can watch that process."""

import sys

from minisgl.llm import LLM

if __name__ == "__main__":
    llm = LLM(sys.argv[1], tp=2, dtype="float32", device="cpu", max_running_req=2, max_seq_len_override=64, num_page_override=40)
    print("WORKER", llm._workers.procs[0].pid, flush=True)  # type: ignore[union-attr]
