"""Grammar-constrained decoding with xgrammar: compiled grammars, one matcher per request, and
the token bitmask of a batch.

Why xgrammar: it is what vLLM and SGLang use; its compiler precomputes, per grammar state, which
tokens of the vocabulary are allowed, so filling a request's mask costs microseconds; it runs on
CPU (and applies masks to CUDA logits with its own kernel); its JSON-schema converter covers the
schemas clients send (objects, arrays, enums, numbers, lengths). The library is imported only when
a request asks for a grammar, and the tokenizer it needs is loaded then.

The mask of step N+1 depends on the token of step N, so a batch with constrained requests runs
the scheduler loop synchronously (as penalties do); free requests in the same batch are sampled
exactly as they would be alone (their rows of the mask are untouched).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any, List, Sequence

import torch

from minisgl.sampling_params import GrammarSpec, InvalidRequest
from minisgl.utils.logger import init_logger

logger = init_logger(__name__)

CACHE_SIZE = 256  # compiled grammars kept (keyed by kind and text)
MAX_WHITESPACE = 4  # a run of JSON whitespace is at most this long: a model cannot stall in it


class GrammarBackend:
    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        try:
            import xgrammar
        except ImportError as exc:  # pragma: no cover - xgrammar is a dependency
            raise InvalidRequest("structured output needs the xgrammar package (pip install xgrammar)", param="response_format") from exc
        self.xgr = xgrammar
        self.vocab_size = vocab_size
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1)
        self._cache: "OrderedDict[tuple[str, str], Any]" = OrderedDict()
        self._cache_lock = threading.Lock()  # compiles run on scheduler/grammar_compile.py's threads

    def compile(self, spec: GrammarSpec) -> Any:
        """The compiled grammar; InvalidRequest (400) if the grammar is invalid."""
        key = (spec.kind, spec.value)
        with self._cache_lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                return compiled
        try:
            if spec.kind == "json_object":
                compiled = self.compiler.compile_json_schema('{"type": "object"}', max_whitespace_cnt=MAX_WHITESPACE)
            elif spec.kind == "json_schema":
                json.loads(spec.value)
                compiled = self.compiler.compile_json_schema(spec.value, max_whitespace_cnt=MAX_WHITESPACE)
            elif spec.kind == "regex":
                compiled = self.compiler.compile_regex(spec.value)
            elif spec.kind == "tool_call":
                compiled = self.compiler.compile_grammar(self._tool_call_grammar(spec.value))
            else:
                compiled = self.compiler.compile_grammar(spec.value)
        except (RuntimeError, ValueError) as exc:
            reason = str(exc).strip().splitlines()[-1][:300]
            raise InvalidRequest(f"invalid {spec.kind} grammar: {reason}", param="response_format") from None
        with self._cache_lock:
            self._cache[key] = compiled
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _tool_call_grammar(self, value: str) -> Any:
        d = json.loads(value)
        g = self.xgr.Grammar
        parts = [g.from_ebnf(f"root ::= {json.dumps(text)}") for text in (d["prefix"],) if text]
        parts.append(g.from_json_schema(json.dumps(d["schema"]), any_whitespace=False))
        parts += [g.from_ebnf(f"root ::= {json.dumps(text)}") for text in (d["suffix"],) if text]
        return g.concat(*parts) if len(parts) > 1 else parts[0]

    def matcher(self, spec: GrammarSpec) -> Any:
        return self.xgr.GrammarMatcher(self.compile(spec))

    def batch_mask(self, matchers: Sequence[Any]) -> tuple[torch.Tensor, List[int]]:
        """The bitmask of a batch (host, int32 [B, ceil(vocab / 32)]) and the rows it constrains."""
        mask = self.xgr.allocate_token_bitmask(len(matchers), self.vocab_size)
        rows = []
        for i, m in enumerate(matchers):
            if m is not None:
                m.fill_next_token_bitmask(mask, i)
                rows.append(i)
        return mask, rows

    def apply(self, logits: torch.Tensor, mask: torch.Tensor, rows: List[int]) -> None:
        self.xgr.apply_token_bitmask_inplace(logits, mask.to(logits.device, non_blocking=True), vocab_size=self.vocab_size, indices=rows)
