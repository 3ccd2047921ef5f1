"""Tokenization (prompts, chat templates) and incremental, UTF-8-safe detokenization.

`worker.run_tokenizer_worker` is the process that sits between the API server and the scheduler.
"""

from minisgl.tokenizer.detokenize import DetokState, IncrementalDetokenizer, StopMatcher
from minisgl.tokenizer.tokenize import PromptEncoder

__all__ = ["DetokState", "IncrementalDetokenizer", "PromptEncoder", "StopMatcher"]
