"""--skip-tokenizer-init (token ids in, token ids out), --tokenizer FOLDER, and --load-format dummy.

The model folder here holds the tiny chat Llama's config and weights but no tokenizer files. One
server runs it with --skip-tokenizer-init, one with --tokenizer pointing at the tiny model's own
folder (which has the embedded SmolLM2 tokenizer). The oracle is the offline `LLM` on the
original folder: greedy token ids must match exactly. A third server serves a config.json-only
folder with random weights (--load-format dummy), checked against `LLM(use_dummy_weight=True)`.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

import httpx
import pytest
from server_helpers import REPO, ServerProcess

PROMPTS = [[1, 450, 4996, 17354, 1701], [1, 9038, 2501, 263, 931, 29892], [17, 28, 39, 41]]
N_NEW = 12
SERVER_FLAGS = ("--dtype", "float32", "--max-seq-len", "512", "--num-pages", "4096", "--max-running-requests", "16")


def _copy_without_tokenizer(src: str, dst: Path, weights: bool = True) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    for p in Path(src).iterdir():
        is_weight = p.suffix == ".safetensors"
        if p.name in ("config.json", "generation_config.json") or (weights and is_weight):
            shutil.copy(p, dst / p.name)
    return dst


@pytest.fixture(scope="module")
def bare_model(tiny_chat_model: str, tmp_path_factory: pytest.TempPathFactory) -> Path:  # noqa: F811
    return _copy_without_tokenizer(tiny_chat_model, tmp_path_factory.mktemp("bare") / "tiny_bare")


@pytest.fixture(scope="module")
def config_only(tiny_chat_model: str, tmp_path_factory: pytest.TempPathFactory) -> Path:  # noqa: F811
    return _copy_without_tokenizer(tiny_chat_model, tmp_path_factory.mktemp("cfg") / "tiny_config_only", weights=False)


@pytest.fixture(scope="module")
def reference(tiny_chat_model: str, config_only: Path) -> Dict[str, Any]:  # noqa: F811
    from minisgl.core import SamplingParams
    from minisgl.llm import LLM

    greedy = SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True)
    llm = LLM(tiny_chat_model, dtype="float32", max_seq_len_override=512, num_page_override=4096, max_running_req=16)
    try:
        ref = {"ids": [r.token_ids for r in llm.generate(PROMPTS, greedy)], "text": llm.generate(["The quick brown fox"], greedy)[0]}
        ref["text_prompt_ids"] = llm.encode("The quick brown fox")
    finally:
        llm.shutdown()
    dummy = LLM(str(config_only), dtype="float32", max_seq_len_override=512, num_page_override=4096, max_running_req=16,
                use_dummy_weight=True)  # fmt: skip
    try:
        ref["dummy_ids"] = [r.token_ids for r in dummy.generate(PROMPTS, greedy)]
    finally:
        dummy.shutdown()
    return ref


@pytest.fixture(scope="module")
def ids_server(bare_model: Path, tmp_path_factory: pytest.TempPathFactory, reference: Dict[str, Any]):
    srv = ServerProcess(str(bare_model), *SERVER_FLAGS, "--skip-tokenizer-init", log_path=tmp_path_factory.mktemp("s") / "ids.log")
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


def _post(srv: ServerProcess, path: str, body: Dict[str, Any]) -> httpx.Response:
    return httpx.post(srv.base_url + path, json=body, timeout=120)


def _stream(srv: ServerProcess, path: str, body: Dict[str, Any]) -> List[Any]:
    events: List[Any] = []
    with httpx.stream("POST", srv.base_url + path, json={**body, "stream": True}, timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: ") :]
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


# ---- --skip-tokenizer-init -------------------------------------------------------------------


def test_token_ids_out_match_llm(ids_server: ServerProcess, reference: Dict[str, Any]) -> None:
    body = {"prompt": PROMPTS, "max_tokens": N_NEW, "temperature": 0, "ignore_eos": True}
    resp = _post(ids_server, "/v1/completions", body)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    assert [c["token_ids"] for c in out["choices"]] == reference["ids"]
    assert all(c["text"] == "" and c["finish_reason"] == "length" for c in out["choices"])
    assert out["usage"]["completion_tokens"] == N_NEW * len(PROMPTS)
    assert out["usage"]["prompt_tokens"] == sum(len(p) for p in PROMPTS)
    # /generate: the same ids as output_ids
    gen = _post(
        ids_server,
        "/generate",
        {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": N_NEW, "temperature": 0, "ignore_eos": True}},
    )
    assert gen.status_code == 200, gen.text
    assert gen.json()["output_ids"] == reference["ids"][0] and gen.json()["text"] == ""


def test_streamed_chunks_carry_their_token_ids(ids_server: ServerProcess, reference: Dict[str, Any]) -> None:
    body = {"prompt": PROMPTS[1], "max_tokens": N_NEW, "temperature": 0, "ignore_eos": True, "stream_options": {"include_usage": True}}
    events = _stream(ids_server, "/v1/completions", body)
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e["choices"]]
    ids = [t for c in chunks for t in c["choices"][0]["token_ids"]]
    assert ids == reference["ids"][1]
    assert all(c["choices"][0]["text"] == "" for c in chunks)
    assert all(c["choices"][0]["token_ids"] for c in chunks)  # no chunk without a token
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert events[-2]["usage"]["completion_tokens"] == N_NEW


def test_eos_from_config_stops_and_ignore_eos_overrides(ids_server: ServerProcess) -> None:
    # the tiny model's config says eos_token_id = 2; a bias makes it the greedy choice
    body = {"prompt": PROMPTS[0], "max_tokens": 5, "temperature": 0, "logit_bias": {"2": 100}}
    out = _post(ids_server, "/v1/completions", body).json()["choices"][0]
    assert out["finish_reason"] == "stop" and out["stop_reason"] == 2 and out["token_ids"] == [2]
    out = _post(ids_server, "/v1/completions", {**body, "ignore_eos": True}).json()["choices"][0]
    assert out["finish_reason"] == "length" and out["token_ids"] == [2] * 5
    out = _post(ids_server, "/v1/completions", {**body, "logit_bias": {"7": 100}, "stop_token_ids": [7]}).json()["choices"][0]
    assert out["finish_reason"] == "stop" and out["stop_reason"] == 7


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"prompt": "hello"}, "prompt"),
        ("/v1/completions", {"prompt": ["hello", "world"]}, "prompt"),
        ("/v1/completions", {"prompt": [1, 2, 3], "stop": ["\n"]}, "stop"),
        ("/v1/completions", {"prompt": [1, 2, 3], "logprobs": 2}, "logprobs"),
        ("/v1/completions", {"prompt": [1, 2, 3], "echo": True}, "echo"),
        ("/v1/completions", {"prompt": [1, 2, 3], "response_format": {"type": "json_object"}}, "response_format"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "messages"),
        ("/tokenize", {"prompt": "hello"}, None),
        ("/detokenize", {"tokens": [1, 2]}, None),
        ("/generate", {"text": "hello"}, "text"),
        ("/generate", {"input_ids": [1, 2], "sampling_params": {"stop": "x"}}, "sampling_params.stop"),
        ("/generate", {"input_ids": [1, 2], "return_logprob": True}, "return_logprob"),
        ("/generate", {"input_ids": [1, 2], "sampling_params": {"regex": "a+"}}, "sampling_params.regex"),
        ("/v1/completions", {"prompt": [1, 2, 3], "guided_regex": "a+"}, "guided_regex"),
    ],
)
def test_text_requests_are_refused_with_a_reason(ids_server: ServerProcess, path: str, body: Dict[str, Any], param: str | None) -> None:
    resp = _post(ids_server, path, body)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["code"] == "tokenizer_required" and err["param"] == param and err["type"] == "invalid_request_error"
    assert "--skip-tokenizer-init" in err["message"]
    # streams are refused the same way, before any event
    if path == "/v1/completions":
        assert httpx.post(ids_server.base_url + path, json={**body, "stream": True}, timeout=60).status_code == 400


def test_ids_server_stays_healthy_and_idle(ids_server: ServerProcess) -> None:
    assert httpx.get(ids_server.base_url + "/health").json() == {"status": "ok"}
    info = httpx.get(ids_server.base_url + "/server_info").json()
    assert info["skip_tokenizer_init"] is True and info["tokenizer_path"] is None
    ids_server.wait_idle()


# ---- --tokenizer FOLDER ----------------------------------------------------------------------


def test_separate_tokenizer_folder(bare_model: Path, tiny_chat_model: str, reference: Dict[str, Any], tmp_path: Path) -> None:  # noqa: F811
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        if (Path(tiny_chat_model) / name).exists():
            shutil.copy(Path(tiny_chat_model) / name, tok_dir / name)
    srv = ServerProcess(str(bare_model), *SERVER_FLAGS, "--tokenizer", str(tok_dir), log_path=tmp_path / "tok.log")
    try:
        srv.wait_ready()
        body = {"prompt": "The quick brown fox", "max_tokens": N_NEW, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        out = _post(srv, "/v1/completions", body).json()
        ref = reference["text"]
        assert out["choices"][0]["text"] == ref.text and out["choices"][0]["token_ids"] == ref.token_ids
        tok = _post(srv, "/tokenize", {"prompt": "The quick brown fox"}).json()
        assert tok["tokens"] == reference["text_prompt_ids"]
        chat = _post(
            srv, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "return_token_ids": True}
        )
        assert chat.status_code == 200, chat.text
        choice = chat.json()["choices"][0]
        assert len(choice["token_ids"]) == chat.json()["usage"]["completion_tokens"]
        # a streamed chat with return_token_ids: every token's id arrives exactly once
        events = _stream(srv, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6,
                                                       "temperature": 0, "return_token_ids": True, "ignore_eos": True})  # fmt: skip
        streamed = [t for e in events[:-1] for c in e["choices"] for t in c.get("token_ids", [])]
        assert len(streamed) == 6
        # a grammar: the scheduler process compiles it with the tokenizer of --tokenizer, which it
        # finds by the model's path (the model folder itself has none)
        body = {"prompt": "JSON:", "max_tokens": 8, "temperature": 0, "response_format": {"type": "json_object"}}
        resp = _post(srv, "/v1/completions", body)
        assert resp.status_code == 200, resp.text + srv.log()[-2000:]
        assert resp.json()["choices"][0]["text"].lstrip().startswith("{")
    finally:
        srv.stop()


# ---- --load-format dummy ---------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["--skip-tokenizer-init", "--tokenizer"])
def test_dummy_weights_folder_is_servable(
    config_only: Path,
    tiny_chat_model: str,
    reference: Dict[str, Any],
    tmp_path: Path,
    mode: str,  # noqa: F811
) -> None:
    """A config.json-only folder serves random weights with either flag; the seeded dummy weights
    give the offline LLM's greedy ids."""
    flags = [mode] if mode == "--skip-tokenizer-init" else [mode, tiny_chat_model]
    srv = ServerProcess(str(config_only), *SERVER_FLAGS, *flags, "--load-format", "dummy", log_path=tmp_path / "dummy.log")
    try:
        srv.wait_ready()
        body = {"prompt": PROMPTS, "max_tokens": N_NEW, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        out = _post(srv, "/v1/completions", body).json()
        assert [c["token_ids"] for c in out["choices"]] == reference["dummy_ids"]
        if mode == "--tokenizer":  # and text, chat through the template
            chat = _post(srv, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
            assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] >= 1, chat.text
    finally:
        srv.stop()


def _launch_fails(*args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "minisgl", "--port", "1", *args], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    return proc.stderr


def test_missing_files_are_named_before_start_up(config_only: Path, bare_model: Path) -> None:
    assert "--load-format dummy" in _launch_fails("--model", str(config_only), "--skip-tokenizer-init")
    err = _launch_fails("--model", str(bare_model))
    assert "no tokenizer" in err and "--tokenizer" in err and "--skip-tokenizer-init" in err
    assert "exclude each other" in _launch_fails("--model", str(bare_model), "--skip-tokenizer-init", "--tokenizer", str(bare_model))


def test_continuous_usage_stats(ids_server: ServerProcess) -> None:
    """vLLM's stream_options.continuous_usage_stats (guidellm sends it): usage on every chunk."""
    body = {"prompt": PROMPTS[2], "max_tokens": N_NEW, "temperature": 0, "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
    events = _stream(ids_server, "/v1/completions", body)
    chunks = [e for e in events[:-1] if e["choices"]]
    done = [c["usage"]["completion_tokens"] for c in chunks]
    assert done == list(range(1, N_NEW + 1)) or (done == sorted(done) and done[-1] == N_NEW)
    assert all(c["usage"]["prompt_tokens"] == len(PROMPTS[2]) for c in chunks)
    assert all(c["usage"]["total_tokens"] == c["usage"]["prompt_tokens"] + c["usage"]["completion_tokens"] for c in chunks)
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == N_NEW


@pytest.mark.parametrize("n_streams", [48])
def test_many_streams_get_every_token_in_order(ids_server: ServerProcess, reference: Dict[str, Any], n_streams: int) -> None:
    """Concurrent streams (more than the scheduler's 16 rows): the ids of every stream, chunks
    concatenated, equal the offline LLM's greedy ids; no token is lost or repeated by merging."""

    async def one(client: httpx.AsyncClient, i: int) -> List[int]:
        body = {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": N_NEW, "temperature": 0, "ignore_eos": True, "stream": True}
        ids: List[int] = []
        async with client.stream("POST", ids_server.base_url + "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    ids += json.loads(line[6:])["choices"][0]["token_ids"]
        return ids

    async def run() -> List[List[int]]:
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=n_streams)) as client:
            return await asyncio.gather(*(one(client, i) for i in range(n_streams)))

    got = asyncio.run(run())
    assert got == [reference["ids"][i % len(PROMPTS)] for i in range(n_streams)]
    ids_server.wait_idle()
