"""A tp=2 LLM built at import time, without `if __name__ == "__main__":`: spawned ranks re-import
this file, so LLM must fail fast with a hint instead of waiting for the rendezvous timeout."""

import sys

from minisgl.llm import LLM

llm = LLM(sys.argv[1], tp=2, dtype="float32", device="cpu", max_running_req=2, max_seq_len_override=64, num_page_override=40)
