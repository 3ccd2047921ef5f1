"""The harmony format of GPT-OSS (minisgl/server/harmony.py): replies written in channels read back
into reasoning_content, content and tool calls, streamed and not; the parser chosen for a harmony
chat template; the prompt side (earlier thoughts as `thinking`, one call per assistant message,
reasoning_effort) as GPT-OSS's template reads it.

The parser is checked on hand-written outputs, then against conversations that hypothesis draws
and this file renders itself (the expected reading is the drawn conversation, not the parser's
output), fed whole, character by character and in random pieces. The routes run in-process over a
canned frontend (tests/server_helpers.py), fed the pieces a tiny tokenizer carrying harmony's
special tokens detokenizes, token by token, as the tokenizer worker does.
"""

from __future__ import annotations

import json
import re
from typing import Any, Dict, List, Tuple

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_helpers import assert_error_body, canned_app, sse_data

from minisgl.server import harmony
from minisgl.server.harmony import HarmonyStream, parse
from minisgl.server.tools import HarmonyParser, HermesParser, pick_parser

WEATHER = '{"city": "Oslo", "unit": "c"}'
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
ASK = [{"role": "user", "content": "Weather in Oslo?"}]
# A small template reading what GPT-OSS's own does: reasoning_effort, tools, `thinking`, the first
# call of an assistant message (its arguments a mapping, rendered with tojson), tool results.
TEMPLATE = (
    "{%- if reasoning_effort is not defined %}{% set reasoning_effort = 'medium' %}{% endif -%}"
    "<|start|>system<|message|>Reasoning: {{ reasoning_effort }}<|end|>"
    "{%- if tools %}<|start|>developer<|message|>{% for t in tools %}type {{ t.function.name }};{% endfor %}<|end|>{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}"
    "{%- if m.thinking %}<|start|>assistant<|channel|>analysis<|message|>{{ m.thinking }}<|end|>{% endif %}"
    "{%- set call = m.tool_calls[0].function %}"
    "<|start|>assistant to=functions.{{ call.name }}<|channel|>commentary json<|message|>{{ call.arguments | tojson }}<|call|>"
    "{%- elif m.role == 'assistant' %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>"
    "{%- elif m.role == 'tool' %}<|start|>functions.f to=assistant<|channel|>commentary<|message|>{{ m.content }}<|end|>"
    "{%- else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|start|>assistant{% endif %}"
)
SPECIAL = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]


def _stream(text: str, pieces: List[str], parse_calls: bool = True) -> Tuple[str | None, str, List[Any]]:
    hs = HarmonyStream(parse_calls)
    reasoning, content, calls = "", "", []
    for piece in pieces:
        d = hs.feed(piece)
        reasoning, content, calls = reasoning + d.reasoning, content + d.content, calls + d.calls
    d = hs.finish()
    reasoning, content, calls = reasoning + d.reasoning, content + d.content, calls + d.calls
    assert "".join(pieces) == text
    return (reasoning if hs.saw_reasoning else None), content, calls


def _calls(calls: List[Any]) -> List[Tuple[str, Dict[str, Any]]]:
    return [(c.name, c.arguments) for c in calls]


# ---- the parser on hand-written outputs ----------------------------------------------------------

ANALYSIS = "<|channel|>analysis<|message|>The user wants Oslo's weather.<|end|>"
CASES: List[Tuple[str, str, str | None, str, List[Tuple[str, Dict[str, Any]]]]] = [
    ("analysis then final", ANALYSIS + "<|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>",
     "The user wants Oslo's weather.", "It is sunny.", []),
    ("recipient after the channel", ANALYSIS + "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
     f"<|message|>{WEATHER}<|call|>", "The user wants Oslo's weather.", "", [("get_weather", json.loads(WEATHER))]),
    ("recipient in the role part", f" to=functions.get_weather<|channel|>commentary json<|message|>{WEATHER}<|call|>",
     None, "", [("get_weather", json.loads(WEATHER))]),
    ("<|constrain|> right after the recipient", f"<|channel|>commentary to=functions.get_weather<|constrain|>json<|message|>{WEATHER}<|call|>",
     None, "", [("get_weather", json.loads(WEATHER))]),
    ("two calls", f"<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{WEATHER}<|call|>"
     '<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{"tz": "CET"}<|call|>',
     None, "", [("get_weather", json.loads(WEATHER)), ("get_time", {"tz": "CET"})]),
    ("a preamble before the call", ANALYSIS + "<|start|>assistant<|channel|>commentary<|message|>Let me look that up.<|end|>"
     f"<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{WEATHER}<|call|>",
     "The user wants Oslo's weather.", "Let me look that up.", [("get_weather", json.loads(WEATHER))]),
    ("two analysis messages are set apart", ANALYSIS + "<|start|>assistant<|channel|>analysis<|message|>Then answer.<|end|>"
     "<|start|>assistant<|channel|>final<|message|>Sunny.<|return|>", "The user wants Oslo's weather.\n\nThen answer.", "Sunny.", []),
    ("cut off mid-analysis (max_tokens)", "<|channel|>analysis<|message|>First, the cit", "First, the cit", "", []),
    ("cut off inside a header", ANALYSIS + "<|start|>assistant<|channel|>fin", "The user wants Oslo's weather.", "", []),
    ("cut off mid-arguments: the text is content", '<|channel|>commentary to=functions.get_weather json<|message|>{"city": "Os',
     None, '{"city": "Os', []),
    ("arguments that are not JSON stay content", "<|channel|>commentary to=functions.get_weather json<|message|>city=Oslo<|call|>",
     None, "city=Oslo", []),
    ("a body missing its end marker ends at the next <|start|>", "<|channel|>analysis<|message|>hmm"
     "<|start|>assistant<|channel|>final<|message|>Hi<|return|>", "hmm", "Hi", []),
    ("a header abandoned by an end marker says nothing", "<|channel|>analysis<|end|><|start|>assistant<|channel|>final<|message|>Hi<|end|>",
     None, "Hi", []),
    ("plain text without markers is content", "Just an answer.", None, "Just an answer.", []),
    ("a final message with no channel is content", "<|message|>Hi<|return|>", None, "Hi", []),
    ("<|endoftext|> ends it too", "<|channel|>final<|message|>Hi<|endoftext|>", None, "Hi", []),
]  # fmt: skip


@pytest.mark.parametrize("text,reasoning,content,calls", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_parser_on_hand_written_outputs(text: str, reasoning: str | None, content: str, calls: List[Any]) -> None:
    got = parse(text)
    assert (got[0], got[1], _calls(got[2])) == (reasoning, content, calls)
    # streamed character by character, the same reading (markers split everywhere)
    streamed = _stream(text, list(text))
    assert (streamed[0], streamed[1], _calls(streamed[2])) == (reasoning, content, calls)
    # the tool-parser face of it (`--tool-call-parser harmony`)
    assert [(c.name, c.arguments) for c in HarmonyParser().parse(text)[1]] == calls


def test_without_tools_a_call_is_content_and_long_plain_text_streams() -> None:
    text = f"<|channel|>commentary to=functions.get_weather json<|message|>{WEATHER}<|call|>"
    assert parse(text, parse_calls=False) == (None, WEATHER, [])
    # no marker in a header's worth of text: plain content, released before the output ends
    hs = HarmonyStream()
    long = "x" * (harmony.MAX_HEADER_CHARS + 1)
    assert hs.feed(long).content == long and hs.feed(" more").content == " more"


# ---- drawn conversations -------------------------------------------------------------------------

# no ASCII letters in bodies: a letter in reasoning or content can only be a leaked header
BODY = st.text(st.sampled_from(list("0123456789 .,!?-_\n<>|{}é你😀")), max_size=12).filter(lambda t: "<|" not in t)
WORD = st.text(st.sampled_from(list("0123456789 .,!?-_<>|{}é你😀")), max_size=6).filter(lambda t: "<|" not in t)  # JSON escapes no letter
NAME = st.from_regex(r"[a-z_][a-z0-9_]{0,8}", fullmatch=True)
ARGS = st.dictionaries(WORD, st.integers(-5, 5) | WORD, max_size=3)
MESSAGE = st.one_of(
    st.tuples(st.sampled_from(["analysis", "final", "preamble"]), BODY),
    st.tuples(st.just("call"), st.tuples(NAME, ARGS, st.booleans())),
)


def _render(conversation: List[Tuple[str, Any]]) -> List[str]:
    """The output as atoms: a marker is one (a special token), every other character one."""
    atoms: List[str] = []
    for i, (kind, value) in enumerate(conversation):
        last = i == len(conversation) - 1
        if i:
            atoms += ["<|start|>", *"assistant"]
        if kind == "call":
            name, args, in_role = value
            if in_role:
                atoms += [*f" to=functions.{name}", "<|channel|>", *"commentary json", "<|message|>"]
            else:
                atoms += ["<|channel|>", *f"commentary to=functions.{name} ", "<|constrain|>", *"json", "<|message|>"]
            atoms += [*json.dumps(args, ensure_ascii=False), "<|call|>"]
            continue
        channel = {"analysis": "analysis", "final": "final", "preamble": "commentary"}[kind]
        atoms += ["<|channel|>", *channel, "<|message|>", *value, "<|return|>" if last and kind == "final" else "<|end|>"]
    return atoms


def _expected(conversation: List[Tuple[str, Any]]) -> Tuple[str | None, str, List[Tuple[str, Dict[str, Any]]]]:
    thoughts = [v for k, v in conversation if k == "analysis"]
    content = [v for k, v in conversation if k in ("final", "preamble") and v]
    calls = [(v[0], v[1]) for k, v in conversation if k == "call"]
    return ("\n\n".join(t for t in thoughts if t) if thoughts else None), "\n\n".join(content), calls


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conversation=st.lists(MESSAGE, min_size=1, max_size=5), cuts=st.lists(st.integers(0, 400), max_size=12))
def test_drawn_conversations_read_back_streamed_or_not(conversation: List[Tuple[str, Any]], cuts: List[int]) -> None:
    text = "".join(_render(conversation))
    want = _expected(conversation)
    got = parse(text)
    assert (got[0], got[1], _calls(got[2])) == want
    bounds = sorted({0, len(text), *(c for c in cuts if c < len(text))})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    for split in (pieces, list(text)):
        streamed = _stream(text, split)
        assert (streamed[0], streamed[1], _calls(streamed[2])) == want


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conversation=st.lists(MESSAGE, min_size=1, max_size=4), cut=st.integers(0, 300), cuts=st.lists(st.integers(0, 300), max_size=8))
def test_an_output_cut_off_anywhere_leaks_no_marker(conversation: List[Tuple[str, Any]], cut: int, cuts: List[int]) -> None:
    """max_tokens may end an output at any token: whatever it reads, no marker and no header text
    (every letter) comes out, and the stream reads what the whole text reads."""
    atoms = _render(conversation)
    text = "".join(atoms[: min(cut, len(atoms))])
    reasoning, content, calls = parse(text)
    assert not re.search(r"[A-Za-z]|<\|", (reasoning or "") + content), (text, reasoning, content)
    bounds = sorted({0, len(text), *(c for c in cuts if c < len(text))})
    streamed = _stream(text, [text[a:b] for a, b in zip(bounds, bounds[1:])])
    assert (streamed[0], streamed[1], _calls(streamed[2])) == (reasoning, content, _calls(calls))


# ---- openai-harmony, OpenAI's own renderer and parser, as the oracle -----------------------------


@pytest.fixture(scope="module")
def encoding() -> Any:
    """openai-harmony's GPT-OSS encoding. It needs the o200k_base vocabulary: fetched from the
    network, or (offline) a folder named by TIKTOKEN_ENCODINGS_BASE; without either, these skip."""
    oh = pytest.importorskip("openai_harmony")
    try:
        return oh.load_harmony_encoding(oh.HarmonyEncodingName.HARMONY_GPT_OSS)
    except Exception as exc:  # openai_harmony.HarmonyError: no vocabulary file here
        pytest.skip(f"openai-harmony cannot load the o200k_base vocabulary: {exc}")


class _Decoder:
    """openai-harmony's decoder behind the interface IncrementalDetokenizer calls."""

    def __init__(self, encoding: Any) -> None:
        self.encoding = encoding

    def decode(self, ids: List[int], skip_special_tokens: bool = False) -> str:
        return self.encoding.decode(list(ids))


ORACLE_BODY = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=16).filter(lambda t: "<|" not in t)
ORACLE_MESSAGE = st.one_of(
    st.tuples(st.sampled_from(["analysis", "final", "commentary"]), ORACLE_BODY),
    st.tuples(st.just("call"), st.tuples(NAME, st.dictionaries(ORACLE_BODY, st.integers() | ORACLE_BODY, max_size=3))),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(conversation=st.lists(ORACLE_MESSAGE, min_size=1, max_size=4), cuts=st.lists(st.integers(0, 300), max_size=8))
def test_conversations_openai_harmony_renders_read_back(encoding: Any, conversation: List[Tuple[str, Any]], cuts: List[int]) -> None:
    """openai-harmony renders drawn assistant messages to tokens and parses them back itself; our
    reading of the text (whole, in random pieces, and as the detokenizer releases it token by
    token) is what its parse means."""
    import openai_harmony as oh

    from minisgl.tokenizer.detokenize import IncrementalDetokenizer

    messages = []
    for channel, value in conversation:
        if channel == "call":
            name, args = value
            msg = oh.Message.from_role_and_content(oh.Role.ASSISTANT, json.dumps(args, ensure_ascii=False))
            messages.append(msg.with_channel("commentary").with_recipient(f"functions.{name}").with_content_type("<|constrain|>json"))
        else:
            messages.append(oh.Message.from_role_and_content(oh.Role.ASSISTANT, value).with_channel(channel))
    tokens = [t for m in messages for t in encoding.render(m)]
    prompt = encoding.render_conversation_for_completion(oh.Conversation.from_messages([]), oh.Role.ASSISTANT)
    assert tokens[: len(prompt)] == prompt  # `<|start|>assistant`: the prompt's, not the output's
    tokens = tokens[len(prompt) :]
    thoughts, content, calls = [], [], []
    for m in encoding.parse_messages_from_completion_tokens(tokens, oh.Role.ASSISTANT):
        text = "".join(part.text for part in m.content)
        if m.recipient:
            calls.append((m.recipient.removeprefix("functions."), json.loads(text)))
        elif m.channel == "analysis":
            thoughts.append(text)
        elif text:
            content.append(text)
    want = ("\n\n".join(t for t in thoughts if t) if thoughts else None), "\n\n".join(content), calls
    text = encoding.decode(tokens)
    got = parse(text)
    assert (got[0], got[1], _calls(got[2])) == want
    bounds = sorted({0, len(text), *(c for c in cuts if c < len(text))})
    detok = IncrementalDetokenizer(_Decoder(encoding), skip_special_tokens=False)
    by_token = [detok.add([t], final=i == len(tokens) - 1) for i, t in enumerate(tokens)]
    for pieces in ([text[a:b] for a, b in zip(bounds, bounds[1:])], by_token):
        streamed = _stream(text, pieces)
        assert (streamed[0], streamed[1], _calls(streamed[2])) == want


def test_the_stop_tokens_are_return_and_call(encoding: Any) -> None:
    """openai-harmony's stop tokens of an assistant turn are the ids GPT-OSS's generation_config
    lists (200002, 200012): <|return|> and <|call|>, the end markers the parser reads."""
    stops = encoding.stop_tokens_for_assistant_actions()
    assert sorted(stops) == [200002, 200012] and {encoding.decode([t]) for t in stops} == {harmony.RETURN, harmony.CALL}


# ---- parser selection ----------------------------------------------------------------------------


def test_a_harmony_template_selects_the_harmony_parser() -> None:
    assert harmony.is_harmony_template(TEMPLATE) and not harmony.is_harmony_template("{{ messages }}</think>")
    assert harmony.enabled("auto", "auto", TEMPLATE) and not harmony.enabled("auto", "auto", "{{ messages }}")
    assert harmony.enabled("harmony", "auto", None) and harmony.enabled("auto", "harmony", None)
    assert isinstance(pick_parser("harmony", None), HarmonyParser)
    # a named parser beside it turns it off for that template, and says so at start-up
    assert not harmony.enabled("none", "auto", TEMPLATE) and not harmony.enabled("auto", "hermes", TEMPLATE)
    why = harmony.disabled_warning("none", "auto", TEMPLATE)
    assert why is not None and "--reasoning-parser none" in why and harmony.disabled_warning("auto", "auto", TEMPLATE) is None
    assert isinstance(pick_parser("auto", TEMPLATE), HermesParser)  # what the flags then leave
    for flags in (("harmony", "hermes"), ("think", "harmony"), ("none", "harmony")):
        with pytest.raises(ValueError, match="--(reasoning|tool-call)-parser"):
            harmony.enabled(*flags, TEMPLATE)
    with pytest.raises(ValueError, match="harmony"):
        canned_app("x", "--reasoning-parser", "harmony", "--tool-call-parser", "mistral")


def test_gpt_oss_generation_config_stops_on_return_and_call(tmp_path: Any) -> None:
    """GPT-OSS ends a reply with <|return|> (200002) and a call with <|call|> (200012): its
    generation_config lists both (and <|endoftext|>) as eos, which the scheduler stops on."""
    from minisgl.scheduler.scheduler import _generation_eos

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GptOssForCausalLM"], "eos_token_id": 200002}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [200002, 199999, 200012]}))
    assert _generation_eos(str(tmp_path)) == {200002, 199999, 200012}


# ---- the routes, fed by a tokenizer with harmony's special tokens --------------------------------


@pytest.fixture(scope="module")
def harmony_tokenizer(embedded_model_dir: str) -> Any:
    """The embedded model's tokenizer with harmony's markers as special tokens (one id each)."""
    from minisgl.utils.hf import load_tokenizer

    tok = load_tokenizer(embedded_model_dir)
    tok.add_special_tokens({"additional_special_tokens": SPECIAL})
    tok.chat_template = TEMPLATE
    return tok


def _detokenized(tokenizer: Any, text: str) -> List[str]:
    """The pieces the tokenizer worker sends for `text` generated token by token (special tokens kept)."""
    from minisgl.tokenizer.detokenize import DetokState

    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert all(tokenizer.convert_ids_to_tokens(tokenizer.convert_tokens_to_ids(m)) == m for m in SPECIAL)
    state = DetokState(tokenizer, [], False, False, 0)
    pieces = [state.stop.feed(state.detok.add([t], final=i == len(ids) - 1), final=i == len(ids) - 1)[0] for i, t in enumerate(ids)]
    assert "".join(pieces) == text
    return pieces


REPLY = (
    ANALYSIS + "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>"
    f"<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{WEATHER}<|call|>"
)


def _harmony_app(tokenizer: Any, text: str, *flags: str, **canned: Any) -> Any:
    from minisgl.tokenizer.worker import describe_tokenizer

    description = describe_tokenizer(tokenizer, TEMPLATE)
    return canned_app(
        text, *flags, chat_template=TEMPLATE, tokenizer_description=description, pieces=_detokenized(tokenizer, text), **canned
    )


def test_chat_completions_read_the_channels(harmony_tokenizer: Any) -> None:
    client, frontend = _harmony_app(harmony_tokenizer, REPLY)
    body = {"messages": ASK, "tools": TOOLS, "max_tokens": 64}
    choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    message = choice["message"]
    assert message["reasoning_content"] == message["reasoning"] == "The user wants Oslo's weather."
    assert message["content"] == "Checking." and choice["finish_reason"] == "tool_calls"
    [call] = message["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == json.loads(WEATHER)
    sent = frontend.sent[0]
    assert sent.skip_special_tokens is False  # the markers must reach the parser
    # <|return|> and <|call|> end the turn whatever the checkpoint's generation_config says
    ends = harmony_tokenizer.convert_tokens_to_ids([harmony.RETURN, harmony.CALL])
    assert sent.sampling.stop_token_ids == sorted(ends)
    # the template renders the tools itself (GPT-OSS's writes every description: a missing one is empty)
    assert sent.tools == [{**t, "function": {**t["function"], "description": ""}} for t in TOOLS] and sent.messages == ASK

    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as resp:
        chunks = sse_data(resp)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == message["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == "Checking."
    assert not any("<|" in (d.get("content") or "") + d.get("reasoning_content", "") for d in deltas)
    streamed = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert [(tc["index"], tc["function"]["name"], json.loads(tc["function"]["arguments"])) for tc in streamed] == [
        (0, "get_weather", json.loads(WEATHER))
    ]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"

    client.post("/v1/chat/completions", json={**body, "ignore_eos": True, "stop_token_ids": [5]})
    assert frontend.sent[-1].sampling.stop_token_ids == [5]  # ignore_eos: only the client's own
    # without tools the same reply keeps its call as content; a final answer is plain content
    plain = client.post("/v1/chat/completions", json={"messages": ASK}).json()["choices"][0]
    assert plain["finish_reason"] == "stop" and plain["message"]["content"] == "Checking.\n\n" + WEATHER


def test_a_reply_cut_off_mid_analysis(harmony_tokenizer: Any) -> None:
    text = "<|channel|>analysis<|message|>Oslo is in Norway, so"
    client, _ = _harmony_app(harmony_tokenizer, text, finish_reason="length")
    choice = client.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 8}).json()["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["reasoning_content"] == "Oslo is in Norway, so"
    assert choice["message"]["content"] == ""
    with client.stream("POST", "/v1/chat/completions", json={"messages": ASK, "max_tokens": 8, "stream": True}) as resp:
        deltas = [c["choices"][0]["delta"] for c in sse_data(resp)]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Oslo is in Norway, so"
    assert "".join(d.get("content") or "" for d in deltas) == ""


def test_responses_api_items_from_the_channels(harmony_tokenizer: Any) -> None:
    client, frontend = _harmony_app(harmony_tokenizer, REPLY)
    tools = [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]
    body = {"input": ASK, "tools": tools, "reasoning": {"effort": "low"}}
    plain = client.post("/v1/responses", json=body).json()
    assert frontend.sent[0].chat_template_kwargs == {"reasoning_effort": "low"} and plain["reasoning"]["effort"] == "low"
    assert [item["type"] for item in plain["output"]] == ["reasoning", "message", "function_call"]
    thought, message, call = plain["output"]
    assert thought["content"] == [{"type": "reasoning_text", "text": "The user wants Oslo's weather."}]
    assert message["content"][0]["text"] == "Checking."
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == json.loads(WEATHER)
    with client.stream("POST", "/v1/responses", json={**body, "stream": True}) as resp:
        events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: ")]
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == "The user wants Oslo's weather."
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "Checking."
    final = events[-1]["response"]
    assert final["status"] == "completed" and [i["type"] for i in final["output"]] == ["reasoning", "message", "function_call"]
    # passed back as input with the call's result: the thought reaches the template as `thinking`
    # (GPT-OSS's renders it before the call), beside the call instead of the preamble
    result = {"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}
    again = client.post("/v1/responses", json={**body, "input": [*ASK, *plain["output"], result]})
    assert again.status_code == 200, again.text
    turn = frontend.sent[-1].messages
    assert [m["role"] for m in turn] == ["user", "assistant", "tool"]
    assert turn[1]["thinking"] == "The user wants Oslo's weather." and turn[1]["content"] == ""
    assert turn[1]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": json.loads(WEATHER)}


def test_forced_calls_are_refused_for_harmony(harmony_tokenizer: Any) -> None:
    client, _ = _harmony_app(harmony_tokenizer, REPLY)
    body = {"messages": ASK, "tools": TOOLS}
    assert_error_body(client.post("/v1/chat/completions", json={**body, "tool_choice": "required"}), 400, "tool_choice")
    fmt = {"type": "json_object"}
    assert_error_body(client.post("/v1/chat/completions", json={**body, "response_format": fmt}), 400, "response_format")


# ---- the prompt side -----------------------------------------------------------------------------

EARLIER = [
    *ASK,
    {"role": "assistant", "content": "", "reasoning_content": "Two cities: two calls.", "tool_calls": [
        {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": WEATHER}},
        {"id": "call_b", "type": "function", "function": {"name": "get_time", "arguments": '{"tz": "CET"}'}}]},
    {"role": "tool", "tool_call_id": "call_b", "content": "12:00"},
    {"role": "tool", "tool_call_id": "call_a", "content": "sunny"},
]  # fmt: skip


def test_earlier_turns_reach_the_template_as_it_reads_them(harmony_tokenizer: Any) -> None:
    client, frontend = _harmony_app(harmony_tokenizer, "<|channel|>final<|message|>Sunny, noon.<|return|>")
    resp = client.post("/v1/chat/completions", json={"messages": EARLIER, "tools": TOOLS, "reasoning_effort": "high"})
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["message"]["content"] == "Sunny, noon."
    sent = frontend.sent[0]
    assert sent.chat_template_kwargs == {"reasoning_effort": "high"}
    roles = [(m["role"], m.get("tool_call_id") or [c["id"] for c in m.get("tool_calls", [])]) for m in sent.messages]
    assert roles == [("user", []), ("assistant", ["call_a"]), ("tool", "call_a"), ("assistant", ["call_b"]), ("tool", "call_b")]
    assert sent.messages[1]["thinking"] == "Two cities: two calls." and "thinking" not in sent.messages[3]
    assert all("reasoning_content" not in m for m in sent.messages)
    # rendered by the template: the thought, each call with its JSON arguments, each result after its call
    from minisgl.tokenizer.tokenize import PromptEncoder

    ids = PromptEncoder(harmony_tokenizer).encode_chat(sent.messages, sent.chat_template_kwargs, sent.tools)
    prompt = harmony_tokenizer.decode(ids)
    assert prompt.startswith("<|start|>system<|message|>Reasoning: high<|end|><|start|>developer<|message|>type get_weather;")
    assert (
        "<|start|>assistant<|channel|>analysis<|message|>Two cities: two calls.<|end|>"
        f"<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{json.dumps(json.loads(WEATHER))}<|call|>"
        "<|start|>functions.f to=assistant<|channel|>commentary<|message|>sunny<|end|>"
        '<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{"tz": "CET"}<|call|>'
        "<|start|>functions.f to=assistant<|channel|>commentary<|message|>12:00<|end|><|start|>assistant"
    ) in prompt


def test_reasoning_effort_is_checked() -> None:
    client, _ = canned_app("x", chat_template=TEMPLATE)
    err = assert_error_body(
        client.post("/v1/chat/completions", json={"messages": ASK, "reasoning_effort": "extreme"}), 400, "reasoning_effort"
    )
    assert "low" in err["message"] and "high" in err["message"]
    kwargs = {"messages": ASK, "reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "high"}}
    assert_error_body(client.post("/v1/chat/completions", json=kwargs), 400, "reasoning_effort")
    # a template without the variable would ignore it: refused, naming the field
    plain, _ = canned_app("x")
    err = assert_error_body(plain.post("/v1/chat/completions", json={"messages": ASK, "reasoning_effort": "low"}), 400, "reasoning_effort")
    assert "chat template" in err["message"]


def test_reasoning_on_earlier_messages_elsewhere() -> None:
    """Other templates get `reasoning_content` as it was sent (Qwen3's reads it); a user message
    cannot carry it, and its two names must agree."""
    client, frontend = canned_app("ok")
    turn = [*ASK, {"role": "assistant", "content": "Hi", "reasoning": "greet"}, {"role": "user", "content": "again"}]
    assert client.post("/v1/chat/completions", json={"messages": turn}).status_code == 200
    assert frontend.sent[0].messages[1] == {"role": "assistant", "content": "Hi", "reasoning_content": "greet"}
    bad = [{"role": "user", "content": "x", "reasoning_content": "no"}]
    assert_error_body(client.post("/v1/chat/completions", json={"messages": bad}), 400, "messages")
    both = [*ASK, {"role": "assistant", "content": "Hi", "reasoning": "a", "reasoning_content": "b"}]
    assert_error_body(client.post("/v1/chat/completions", json={"messages": both}), 400, "messages")
