"""The streaming path's batching: the tokenizer worker merges a request's replies of one flush,
the API server writes a stream's ready chunks at once, and many concurrent streams still get
every token exactly once and in order (end to end against the offline LLM: that test,
test_many_streams_get_every_token_in_order, runs on test_server_tokenizer_modes.py's server)."""

from __future__ import annotations

import asyncio
import json
from typing import Any, List

from minisgl.message import ReplyMsg
from minisgl.server.routes.common import ChunkWriter, coalesce
from minisgl.tokenizer.worker import merge_replies


def _reply(uid: int, text: str, ids: List[int], **kw: Any) -> ReplyMsg:
    return ReplyMsg(uid=uid, text=text, num_tokens=len(ids), token_ids=ids, completion_tokens=kw.pop("done", len(ids)), **kw)


def test_merge_replies_keeps_each_request_in_order() -> None:
    replies = [
        _reply(1, "a", [10], logprobs=[["a", -0.1, [], 10]], done=1),
        _reply(2, "x", [20], done=1),
        _reply(1, "b", [11], logprobs=[["b", -0.2, [], 11]], done=2),
        _reply(1, "", [2], finished=True, finish_reason="stop", matched_stop=2, done=3, prompt_tokens=7),
        _reply(2, "y", [21], done=2),
    ]
    out = merge_replies(replies)
    assert [r.uid for r in out] == [1, 2]
    one, two = out
    assert one.text == "ab" and one.token_ids == [10, 11, 2] and one.num_tokens == 3
    assert [e[0] for e in one.logprobs or []] == ["a", "b"]
    assert one.finished and one.finish_reason == "stop" and one.matched_stop == 2
    assert one.completion_tokens == 3 and one.prompt_tokens == 7
    assert two.text == "xy" and two.token_ids == [20, 21] and not two.finished
    single = [_reply(3, "z", [30])]
    assert merge_replies(single) is single


class _FakeStream:
    def __init__(self) -> None:
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.done = False


def test_coalesce_writes_ready_chunks_together() -> None:
    async def run() -> List[str]:
        stream = _FakeStream()

        async def body() -> Any:
            for i in range(6):
                if i == 0:
                    for j in range(1, 3):  # events 1 and 2 are already queued behind event 0
                        stream.queue.put_nowait(j)
                elif stream.queue.qsize():
                    stream.queue.get_nowait()
                yield f"data: {i}\n\n"
            stream.done = True
            yield "data: [DONE]\n\n"

        return [piece async for piece in coalesce(body(), stream)]  # type: ignore[arg-type]

    pieces = asyncio.run(run())
    assert "".join(pieces) == "".join(f"data: {i}\n\n" for i in range(6)) + "data: [DONE]\n\n"
    assert pieces[0] == "data: 0\n\ndata: 1\n\ndata: 2\n\n"  # written together while the queue held more
    assert len(pieces) < 7


def test_chunk_writer_is_valid_json() -> None:
    w = ChunkWriter("id-1", "text_completion", "m\u00e9", include_usage=True)
    line = w.choice({"index": 0, "text": 'h\u00e9\n"', "token_ids": [1]})
    assert line.startswith("data: ") and line.endswith("\n\n")
    obj = json.loads(line[6:])
    assert obj == {"id": "id-1", "object": "text_completion", "created": w.head["created"], "model": "m\u00e9",
                   "choices": [{"index": 0, "text": "h\u00e9\n\"", "token_ids": [1]}], "usage": None}  # fmt: skip
    assert json.loads(ChunkWriter("i", "o", "m", include_usage=False).choice({"index": 0})[6:])["choices"] == [{"index": 0}]
