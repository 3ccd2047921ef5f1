"""Structured output: grammar-constrained decoding with xgrammar in the batched sampler.

A tiny random Llama with a small byte-level BPE tokenizer trained here (so the test needs no model
package and runs on CUDA too: MINISGL_TEST_DEVICE=cuda) cannot write JSON on its own, so whatever
valid JSON comes out is the grammar's doing. Every schema bounds its strings,
numbers and arrays, so a random model also has to finish within max_tokens. Checked with an
independent validator (jsonschema) and `re.fullmatch`; free requests sharing the batch must be
token-exact with running alone.
"""

from __future__ import annotations

import json
import re
from typing import Any, Dict, List

import pytest
import torch
from helpers import TEST_DEVICE

from minisgl.core import SamplingParams
from minisgl.llm import LLM
from minisgl.sampling_params import GrammarSpec, InvalidRequest

jsonschema = pytest.importorskip("jsonschema")  # a test dependency (pyproject [test])

SCHEMAS: List[Dict[str, Any]] = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}}, "required": ["colour", "ok"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {"x": {"type": "number", "minimum": 0, "maximum": 1}, "y": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["x", "y"], "additionalProperties": False}}, "required": ["point"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}, "id": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["tags", "id"], "additionalProperties": False},
    {"enum": ["yes", "no", "maybe"]},
]  # fmt: skip


CORPUS = [
    '{"name": "Ada", "age": 36, "ok": true, "tags": ["a", "b"], "point": {"x": 0.5, "y": 1}}',
    "[1, 2, 3, -4, 5] yes no maybe red green blue on off answer: code: 123-AB",
    "The quick brown fox jumps over the lazy dog. Write some JSON number 42 email: abc@def.com org",
] * 20


def build_tiny_bpe_model(out: Any) -> str:
    """A byte-level BPE tokenizer (every string encodable) trained on CORPUS, and a tiny Llama."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(CORPUS, vocab_size=420, min_frequency=2, special_tokens=["<|endoftext|>"])
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>", bos_token="<|endoftext|>")
    tok.save_pretrained(out)
    torch.manual_seed(7)
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    config = LlamaConfig(
        vocab_size=448, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.2, bos_token_id=eos, eos_token_id=eos,
    )  # fmt: skip
    LlamaForCausalLM(config).eval().save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory):
    path = build_tiny_bpe_model(tmp_path_factory.mktemp("bpe_llama"))
    engine = LLM(path, dtype="float32", device=TEST_DEVICE, max_seq_len_override=512, num_page_override=8192, max_running_req=16)
    try:
        yield engine
    finally:
        engine.shutdown()


def test_json_schemas_validate(llm: LLM) -> None:
    prompts = [f"Write some JSON number {i}:" for i in range(len(SCHEMAS))]
    params = [SamplingParams(max_tokens=200, grammar=GrammarSpec("json_schema", json.dumps(s))) for s in SCHEMAS]
    sampled = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=200, grammar=GrammarSpec("json_schema", json.dumps(s)))
        for i, s in enumerate(SCHEMAS)
    ]
    for result, schema in zip(llm.generate(prompts + prompts, params + sampled), SCHEMAS + SCHEMAS):
        assert result.finish_reason == "stop", (schema, result.text)
        jsonschema.validate(json.loads(result.text), schema)
    llm.scheduler.check_invariants()


def test_json_object_and_regex(llm: LLM) -> None:
    obj = llm.generate(["{"], SamplingParams(temperature=1.0, seed=1, max_tokens=120, grammar=GrammarSpec("json_object")))[0]
    if obj.finish_reason == "stop":  # a random model may also fill 120 tokens with a valid prefix
        assert isinstance(json.loads(obj.text), dict)
    else:
        assert obj.text.lstrip().startswith("{")
    pattern = r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)"
    results = llm.generate(["email: ", "mail to "], [SamplingParams(max_tokens=40, grammar=GrammarSpec("regex", pattern))] * 2)
    for r in results:
        assert r.finish_reason == "stop" and re.fullmatch(pattern, r.text), r.text
    ebnf = 'root ::= "answer: " ("yes" | "no")'
    r = llm.generate(["?"], SamplingParams(max_tokens=20, grammar=GrammarSpec("ebnf", ebnf)))[0]
    assert r.text in ("answer: yes", "answer: no")


def test_free_requests_in_a_constrained_batch_are_unchanged(llm: LLM) -> None:
    free = [f"Tell me about {w}" for w in ("cats", "rivers", "stars")]
    alone = llm.generate(free, SamplingParams(max_tokens=24, ignore_eos=True))
    constrained = SamplingParams(max_tokens=60, grammar=GrammarSpec("json_schema", json.dumps(SCHEMAS[1])))
    mixed = llm.generate(free + ["json:"], [SamplingParams(max_tokens=24, ignore_eos=True)] * 3 + [constrained])
    assert [r.token_ids for r in mixed[:3]] == [r.token_ids for r in alone]
    jsonschema.validate(json.loads(mixed[3].text), SCHEMAS[1])


def test_bad_grammars_are_refused(llm: LLM) -> None:
    for spec in (
        GrammarSpec("json_schema", '{"type": "objec"}'),
        GrammarSpec("json_schema", "{not json"),
        GrammarSpec("regex", "a("),
        GrammarSpec("ebnf", "root ::= ("),
        GrammarSpec("xml", "x"),
    ):
        with pytest.raises(InvalidRequest) as info:
            llm.generate(["x"], SamplingParams(max_tokens=4, grammar=spec))
        assert info.value.param == "response_format"
    llm.scheduler.check_invariants()
