"""The server on the embedded SmolLM2-135M-Instruct (no --model), in float32: greedy answers
equal LLM.generate's, streams add up to the same text, and multi-byte characters survive
streaming (no U+FFFD in any delta)."""

from __future__ import annotations

from typing import Any, Dict, List

import httpx
import pytest
from server_helpers import ServerProcess

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "请用中文回答：你好吗？"}],  # greedy: Chinese, then a run of 👏
]
MAX_TOKENS = 24
EXTRA = ("--dtype", "float32", "--num-pages", "8192", "--max-seq-len", "2048")


@pytest.fixture(scope="module")
def embedded(tmp_path_factory: pytest.TempPathFactory, embedded_model_dir: str) -> Any:
    srv = ServerProcess(None, *EXTRA, log_path=tmp_path_factory.mktemp("embedded") / "server.log")
    try:
        # the reference is computed while the server starts
        from minisgl.core import SamplingParams
        from minisgl.llm import LLM

        llm = LLM(None, dtype="float32", num_page_override=8192, max_seq_len_override=2048)
        try:
            # one at a time, in the order the tests send them: the same batch shapes and the same
            # prefix-cache hits as on the server (SmolLM2 has near-ties that float paths can flip)
            ref = [llm.generate([chat], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))[0] for chat in CHATS]
        finally:
            llm.shutdown()
        srv.wait_ready()
        yield srv, ref
    finally:
        srv.stop()


def test_embedded_model_is_the_default(embedded: Any) -> None:
    srv, _ = embedded
    assert [m.id for m in srv.openai().models.list().data] == ["SmolLM2-135M-Instruct"]
    assert "SmolLM2-135M-Instruct" in srv.log()


def test_greedy_chat_matches_llm(embedded: Any) -> None:
    srv, ref = embedded
    body: Dict[str, Any] = {"model": "SmolLM2-135M-Instruct", "messages": CHATS[0], "max_tokens": MAX_TOKENS, "temperature": 0}
    out = httpx.post(srv.base_url + "/v1/chat/completions", json=body, timeout=300).json()  # README's curl example
    assert out["object"] == "chat.completion"
    assert out["choices"][0]["message"]["content"] == ref[0].text
    assert out["usage"]["completion_tokens"] == ref[0].completion_tokens


def test_streams_keep_multibyte_characters_whole(embedded: Any) -> None:
    srv, ref = embedded
    client = srv.openai()
    for chat, expected in zip(CHATS[1:], ref[1:]):
        deltas: List[str] = []
        for chunk in client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=chat, temperature=0, max_tokens=MAX_TOKENS, stream=True
        ):
            if chunk.choices and chunk.choices[0].delta.content:
                deltas.append(chunk.choices[0].delta.content)
        assert "".join(deltas) == expected.text
        if "\ufffd" not in expected.text:
            assert all("\ufffd" not in d for d in deltas), deltas
    assert any(ord(c) > 0x2FF for r in ref[1:] for c in r.text), [r.text for r in ref]  # the model did write non-ASCII
