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
import re
import threading
from collections import OrderedDict
from typing import Any, Dict, List, Sequence

import torch

from minisgl.sampling_params import GrammarSpec, InvalidRequest
from minisgl.utils.logger import init_logger

logger = init_logger(__name__)

CACHE_SIZE = 256  # compiled grammars kept (keyed by kind and text)
MAX_WHITESPACE = 4  # a run of JSON whitespace is at most this long: a model cannot stall in it
MAX_REASON_CHARS = 300  # the library's reason for refusing a grammar, quoted at most this long


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
        """The compiled grammar; InvalidRequest (400) naming the client's field if it is invalid."""
        key = (spec.kind, spec.value)
        with self._cache_lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                return compiled
        try:
            if spec.kind == "tool_call":
                grammar = self._tool_turn_grammar(spec.value)
            else:
                grammar = self._grammar(spec.kind, spec.value, spec.param)
            compiled = self.compiler.compile_grammar(grammar)
        except InvalidRequest:
            raise
        except (RuntimeError, ValueError, TypeError) as exc:  # what the parts' own checks did not catch
            raise refusal(spec.kind, exc, spec.param) from None
        with self._cache_lock:
            self._cache[key] = compiled
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _grammar(self, kind: str, value: str, param: str) -> Any:
        """One client grammar as an xgrammar Grammar; its errors in our words (`refusal`)."""
        g = self.xgr.Grammar
        if kind not in ("json_object", "json_schema", "regex", "ebnf"):
            raise InvalidRequest(f"unknown grammar kind {kind!r}", param=param)
        if kind == "json_schema":
            try:
                json.loads(value)
            except json.JSONDecodeError as exc:
                raise InvalidRequest(f"invalid JSON schema: it is not JSON ({exc})", param=param) from None
        try:
            if kind == "json_object":
                return g.from_json_schema('{"type": "object"}', max_whitespace_cnt=MAX_WHITESPACE)
            if kind == "json_schema":
                return g.from_json_schema(value, max_whitespace_cnt=MAX_WHITESPACE)
            if kind == "regex":
                return g.from_regex(value)
            return g.from_ebnf(value)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise refusal(kind, exc, param) from None

    def _tool_turn_grammar(self, value: str) -> Any:
        """A tool turn (minisgl.server.tools.tool_turn_grammar): one call, or one or more
        separated calls, in the parser's syntax, each call's JSON matching one tool's schema; with
        an `answer`, the alternative of a final answer in that grammar instead of calls."""
        turn = json.loads(value)
        calls = []
        for call in turn["calls"]:
            self._grammar("json_schema", json.dumps(call["schema"]), call["param"])  # a bad schema is refused by its tool's index
            calls.append({"type": "json_schema", "json_schema": call["schema"], "max_whitespace_cnt": MAX_WHITESPACE})
        one = _sequence(_literal(turn["begin"]), _choice(calls), _literal(turn["end"]))
        many = _sequence(one, {"type": "star", "content": _sequence(_literal(turn["separator"]), one)}) if turn["parallel"] else one
        call_turn = _sequence(_literal(turn["prefix"]), many, _literal(turn["suffix"]))
        calls_grammar = self.xgr.Grammar.from_structural_tag(json.dumps({"type": "structural_tag", "format": call_turn}))
        answer = turn.get("answer")
        if answer is None:
            return calls_grammar
        # the answer is built exactly as it would be alone, then offered as the other branch
        return self.xgr.Grammar.union(calls_grammar, self._grammar(answer["kind"], answer["value"], answer["param"]))

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


def _literal(text: str) -> Dict[str, Any] | None:
    return {"type": "const_string", "value": text} if text else None


def _sequence(*parts: Dict[str, Any] | None) -> Dict[str, Any]:
    present = [p for p in parts if p is not None]
    return present[0] if len(present) == 1 else {"type": "sequence", "elements": present}


def _choice(options: List[Dict[str, Any]]) -> Dict[str, Any]:
    return options[0] if len(options) == 1 else {"type": "or", "elements": options}


_LIBRARY_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")  # "[03:17:50] /project/cpp/x.cc:94: "
_WHAT = {
    "json_object": "invalid JSON schema",
    "json_schema": "invalid JSON schema",
    "regex": "invalid regex",
    "ebnf": "invalid EBNF grammar",
    "tool_call": "invalid tool-call grammar",
}


def refusal(kind: str, exc: BaseException, param: str) -> InvalidRequest:
    """xgrammar's error as a 400 in our words: what is wrong, and the library's reason in short
    (without its timestamp and source location)."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    reason = _LIBRARY_PREFIX.sub("", lines[-1] if lines else "")
    for noise in ("Regex parsing error ", "EBNF parser error "):
        reason = reason.removeprefix(noise)
    if kind == "regex":  # a regex becomes EBNF inside xgrammar: its line/column are not the client's
        reason = re.sub(r"^at line \d+, column \d+: ", "", reason)
    what = _WHAT.get(kind, f"invalid {kind} grammar")
    if not reason:
        return InvalidRequest(what, param=param)
    sep = " " if reason.startswith("at ") else ": "
    return InvalidRequest(f"{what}{sep}{reason[:MAX_REASON_CHARS]}", param=param)
