"""/v1/embeddings (the embed task): vectors against HF transformers' pooled hidden states.

The oracle is `AutoModel.from_pretrained(dir)(input_ids).last_hidden_state` in float32, pooled
(last token, mean, first) and L2-normalized as the checkpoint or the command line says. Two
servers: a causal LM started with `--task embed` whose sentence-transformers files ask for
last-token pooling + Normalize, and a bare decoder checkpoint (LlamaModel, no LM head) started
with `--pooling mean --no-normalize`; both with a small chunked-prefill size, so long inputs are
prefilled in several chunks. cls pooling runs in-process on a Scheduler.
"""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path
from typing import Any, Dict, Iterator, List, Sequence

import httpx
import numpy as np
import pytest
import torch
from server_helpers import ServerProcess, assert_error_body

MAX_SEQ_LEN = 256
ATOL = 1e-4


# ---------------------------------------------------------------------------------------------
# checkpoints and the oracle
# ---------------------------------------------------------------------------------------------


def _copy_tokenizer(src: str, dst: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (Path(src) / name).exists():
            shutil.copy(Path(src) / name, dst / name)


def _write_sentence_transformers(dst: Path, pooling_key: str, normalize: bool) -> None:
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}]
    modules.append({"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"})
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (dst / "modules.json").write_text(json.dumps(modules))
    (dst / "1_Pooling").mkdir(exist_ok=True)
    modes = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "weightedmean_tokens", "lasttoken")
    config = {f"pooling_mode_{m}": m == pooling_key for m in modes}
    (dst / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, **config}))


def _randomize(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # HF inits norms to ones: make a mis-loaded norm visible
                p.copy_(1.0 + 0.2 * torch.randn_like(p))


def build_qwen3_lm(out: Path, tokenizer_dir: str) -> Path:
    """A tiny Qwen3ForCausalLM with sentence-transformers files: last-token pooling, Normalize."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(7)
    config = Qwen3Config(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, initializer_range=0.2, tie_word_embeddings=True,
    )  # fmt: skip
    model = Qwen3ForCausalLM(config).eval()
    _randomize(model)
    model.save_pretrained(out)
    _copy_tokenizer(tokenizer_dir, out)
    _write_sentence_transformers(out, "lasttoken", normalize=True)
    return out


def build_bare_llama(out: Path, tokenizer_dir: str) -> Path:
    """A tiny LlamaModel: the decoder alone, no LM head, weight names without 'model.'."""
    from transformers import LlamaConfig, LlamaModel

    torch.manual_seed(8)
    config = LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.2,
    )  # fmt: skip
    model = LlamaModel(config).eval()
    _randomize(model)
    model.save_pretrained(out)
    _copy_tokenizer(tokenizer_dir, out)
    return out


class Oracle:
    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoModel, AutoTokenizer

        self.model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)

    @torch.inference_mode()
    def embed(self, ids: Sequence[int], pooling: str, normalize: bool) -> np.ndarray:
        hidden = self.model(torch.tensor([list(ids)])).last_hidden_state[0]
        vec = {"last": hidden[-1], "mean": hidden.mean(dim=0), "cls": hidden[0]}[pooling]
        if normalize:
            vec = torch.nn.functional.normalize(vec, dim=-1)
        return vec.numpy()

    def ids(self, text: str) -> List[int]:
        return list(self.tokenizer(text).input_ids)


def _ids(n: int, seed: int) -> List[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(0, 49152, size=n)]


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory: pytest.TempPathFactory, embedded_model_dir: str) -> Path:
    return build_qwen3_lm(tmp_path_factory.mktemp("qwen3_embed"), embedded_model_dir)


@pytest.fixture(scope="module")
def bare_dir(tmp_path_factory: pytest.TempPathFactory, embedded_model_dir: str) -> Path:
    return build_bare_llama(tmp_path_factory.mktemp("llama_bare"), embedded_model_dir)


@pytest.fixture(scope="module")
def servers(lm_dir: Path, bare_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Dict[str, ServerProcess]]:
    """Both servers, started together so that their start-ups overlap."""
    logs = tmp_path_factory.mktemp("logs")
    common = ("--dtype", "float32", "--max-seq-len", str(MAX_SEQ_LEN))
    started = {
        "lm": ServerProcess(str(lm_dir), *common, "--task", "embed", "--chunked-prefill-size", "32", log_path=logs / "lm.log"),
        "bare": ServerProcess(
            str(bare_dir), *common, "--pooling", "mean", "--no-normalize", "--chunked-prefill-size", "16", log_path=logs / "bare.log"
        ),  # fmt: skip
    }
    try:
        for srv in started.values():
            srv.wait_ready()
        yield started
    finally:
        for srv in started.values():
            srv.stop()


@pytest.fixture(scope="module")
def lm_server(servers: Dict[str, ServerProcess]) -> ServerProcess:
    return servers["lm"]


@pytest.fixture(scope="module")
def bare_server(servers: Dict[str, ServerProcess]) -> ServerProcess:
    return servers["bare"]


def _assert_close(got: Any, want: np.ndarray) -> None:
    got = np.asarray(got, dtype=np.float32)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert np.abs(got - want).max() < ATOL, np.abs(got - want).max()


# ---------------------------------------------------------------------------------------------
# the causal LM with --task embed: last token + normalize from sentence-transformers files
# ---------------------------------------------------------------------------------------------


def test_text_batch_matches_hf_last_token_normalized(lm_server: ServerProcess, lm_dir: Path) -> None:
    oracle = Oracle(lm_dir)
    texts = ["hello", "The quick brown fox jumps over the lazy dog. " * 6, "a b c d e f g"]
    assert len(oracle.ids(texts[1])) > 32  # longer than a chunk: prefilled in several
    resp = lm_server.openai().embeddings.create(model=lm_dir.name, input=texts, encoding_format="float")
    assert [d.index for d in resp.data] == [0, 1, 2] and resp.object == "list"
    for text, item in zip(texts, resp.data):
        _assert_close(item.embedding, oracle.embed(oracle.ids(text), "last", normalize=True))
        assert abs(np.linalg.norm(item.embedding) - 1.0) < 1e-5
    total = sum(len(oracle.ids(t)) for t in texts)
    assert resp.usage.prompt_tokens == total and resp.usage.total_tokens == total


def test_token_ids_and_base64(lm_server: ServerProcess, lm_dir: Path) -> None:
    oracle = Oracle(lm_dir)
    prompts = [_ids(5, 1), _ids(77, 2), _ids(1, 3)]  # 77: three chunks of 32
    client = lm_server.openai()
    floats = client.embeddings.create(model=lm_dir.name, input=prompts, encoding_format="float")
    raw = httpx.post(
        lm_server.base_url + "/v1/embeddings", json={"input": prompts, "encoding_format": "base64", "user": "u1"}, timeout=60
    ).json()
    for ids, f, b in zip(prompts, floats.data, raw["data"]):
        _assert_close(f.embedding, oracle.embed(ids, "last", normalize=True))
        decoded = np.frombuffer(base64.b64decode(b["embedding"]), dtype="<f4")
        # (another request: its batch and prefix-cache hits differ, so the last bits may too)
        _assert_close(decoded, np.asarray(f.embedding, dtype=np.float32))
        _assert_close(decoded, oracle.embed(ids, "last", normalize=True))
    single = client.embeddings.create(model=lm_dir.name, input=prompts[1])  # the SDK asks for base64 and decodes it
    _assert_close(single.data[0].embedding, oracle.embed(prompts[1], "last", normalize=True))


def test_no_page_leak(lm_server: ServerProcess) -> None:
    for _ in range(2):  # the second round hits the prefix cache (fine for last-token pooling)
        httpx.post(lm_server.base_url + "/v1/embeddings", json={"input": [_ids(40, 4), _ids(9, 5)]}, timeout=60).raise_for_status()
    m = lm_server.wait_idle()
    assert m["minisgl_kv_pages_free"] == m["minisgl_kv_pages_total"], m


def test_bad_requests_are_400(lm_server: ServerProcess) -> None:
    url = lm_server.base_url + "/v1/embeddings"

    def post(body: Any) -> httpx.Response:
        return httpx.post(url, json=body, timeout=60)

    for empty in ("", [], [""], [[]]):
        assert_error_body(post({"input": empty}), 400, param="input")
    assert_error_body(post({"input": _ids(MAX_SEQ_LEN, 6)}), 400, param="input", code="context_length_exceeded")
    assert_error_body(post({"input": [[1]] * 2049}), 400, param="input")
    assert_error_body(post({"input": [[49152]]}), 400, param="input")  # outside the vocabulary
    assert_error_body(post({"input": "hi", "encoding_format": "int8"}), 400, param="encoding_format")
    assert_error_body(post({"input": "hi", "dimensions": 32}), 400, param="dimensions")  # no Matryoshka sizes declared
    assert_error_body(post({"input": "hi", "pooling": "mean"}), 400, param="pooling", code="unknown_parameter")
    # a long text gets past the byte check and is refused once tokenized, still naming `input`
    assert_error_body(post({"input": "word " * 400}), 400, param="input", code="context_length_exceeded")
    m = lm_server.wait_idle()
    assert m["minisgl_kv_pages_free"] == m["minisgl_kv_pages_total"], m


def test_embed_server_refuses_generation(lm_server: ServerProcess) -> None:
    for path, body in (
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/completions", {"prompt": "hi"}),
        ("/generate", {"text": "hi"}),
    ):
        err = assert_error_body(httpx.post(lm_server.base_url + path, json=body, timeout=60), 400, code="wrong_task")
        assert "embed task" in err["message"]


def test_generate_server_refuses_embeddings() -> None:
    from fastapi.testclient import TestClient

    from minisgl.server.api_server import create_app
    from minisgl.server.args import parse_args
    from minisgl.server.metrics import ServerMetrics

    args = parse_args([])
    args.model_path = "/models/x"
    app = create_app(args, {"max_seq_len": 64, "vocab_size": 100, "task": "generate"}, object(), ServerMetrics())  # type: ignore[arg-type]
    with TestClient(app) as client:
        err = assert_error_body(client.post("/v1/embeddings", json={"input": "hi"}), 400, code="wrong_task")
        assert "--task embed" in err["message"]


# ---------------------------------------------------------------------------------------------
# the bare decoder: --pooling mean --no-normalize, chunks of 16
# ---------------------------------------------------------------------------------------------


def test_bare_decoder_mean_pooling_chunked(bare_server: ServerProcess, bare_dir: Path) -> None:
    oracle = Oracle(bare_dir)
    prompts = [_ids(3, 10), _ids(16, 11), _ids(61, 12), _ids(200, 13)]  # one chunk .. 13 chunks
    resp = bare_server.openai().embeddings.create(model=bare_dir.name, input=prompts, encoding_format="float")
    for ids, item in zip(prompts, resp.data):
        _assert_close(item.embedding, oracle.embed(ids, "mean", normalize=False))
    # the long inputs again: their pages are in the prefix cache now, and a hit would skip rows
    # that mean pooling needs, so it is never looked up
    again = bare_server.openai().embeddings.create(model=bare_dir.name, input=[prompts[3], prompts[2]], encoding_format="float")
    _assert_close(again.data[0].embedding, oracle.embed(prompts[3], "mean", normalize=False))
    _assert_close(again.data[1].embedding, oracle.embed(prompts[2], "mean", normalize=False))
    assert again.usage.prompt_tokens == 200 + 61
    text = "The quick brown fox " * 20
    from_text = bare_server.openai().embeddings.create(model=bare_dir.name, input=text, encoding_format="float")
    _assert_close(from_text.data[0].embedding, oracle.embed(oracle.ids(text), "mean", normalize=False))
    m = bare_server.wait_idle()
    assert m["minisgl_kv_pages_free"] == m["minisgl_kv_pages_total"], m


# ---------------------------------------------------------------------------------------------
# in-process: cls pooling through the Scheduler, chunked, and the Matryoshka truncation
# ---------------------------------------------------------------------------------------------


def test_cls_pooling_in_process_chunked(bare_dir: Path) -> None:
    from sched_helpers import assert_idle_and_clean

    from minisgl.core import SamplingParams
    from minisgl.distributed import DistributedInfo
    from minisgl.scheduler import Scheduler, UserRequest
    from minisgl.scheduler.config import SchedulerConfig

    config = SchedulerConfig(
        model_path=str(bare_dir), tp_info=DistributedInfo(0, 1), dtype=torch.float32, device="cpu", pooling="cls",
        max_extend_tokens=8, max_running_req=4, max_seq_len_override=MAX_SEQ_LEN, num_page_override=512,
    )  # fmt: skip
    sched = Scheduler(config)
    try:
        assert sched.engine.config.task == "embed" and sched.engine.config.normalize is True  # auto: a bare decoder
        oracle = Oracle(bare_dir)
        prompts = [_ids(30, 20), _ids(2, 21), _ids(30, 20)[:20] + _ids(5, 22)]  # the third shares a prefix
        for uid, ids in enumerate(prompts):
            sched.add_request(UserRequest(uid, ids, SamplingParams(max_tokens=1)))
        outputs = {o.uid: o for o in sched.run_until_idle()}
        for uid, ids in enumerate(prompts):
            out = outputs[uid]
            assert out.finished and out.token_id is None and out.embedding is not None
            _assert_close(np.frombuffer(out.embedding, dtype="<f4"), oracle.embed(ids, "cls", normalize=True))
        assert_idle_and_clean(sched)
    finally:
        sched.shutdown()


def test_dimensions_truncate_and_renormalize() -> None:
    from minisgl.server.embeddings_protocol import encode_vector

    vec = np.random.default_rng(0).standard_normal(64).astype("<f4")
    got = np.asarray(encode_vector(vec.tobytes(), 16, "float"), dtype=np.float32)
    want = vec[:16] / np.linalg.norm(vec[:16].astype(np.float64))
    assert np.abs(got - want).max() < 1e-6
    b64 = encode_vector(vec.tobytes(), None, "base64")
    assert isinstance(b64, str) and np.array_equal(np.frombuffer(base64.b64decode(b64), dtype="<f4"), vec)


def test_offline_llm_embed(lm_dir: Path, bare_dir: Path) -> None:
    from minisgl.core import SamplingParams
    from minisgl.llm import LLM

    oracle = Oracle(lm_dir)
    small = dict(dtype="float32", device="cpu", max_seq_len_override=MAX_SEQ_LEN, max_running_req=4, num_page_override=512)
    llm = LLM(str(lm_dir), task="embed", max_extend_tokens=16, **small)
    try:
        prompts: List[Any] = ["hello there, how are you?", _ids(40, 30)]
        vectors = llm.embed(prompts)
        _assert_close(vectors[0], oracle.embed(oracle.ids(prompts[0]), "last", normalize=True))
        _assert_close(vectors[1], oracle.embed(prompts[1], "last", normalize=True))
        with pytest.raises(ValueError, match="embed task"):
            llm.generate("hi", SamplingParams(max_tokens=2))
    finally:
        llm.shutdown()
    with pytest.raises(ValueError, match="bare decoder"):  # no LM head: it cannot generate
        LLM(str(bare_dir), task="generate", **small)


def test_dimensions_follow_the_declared_matryoshka_sizes(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from minisgl.engine.pooling import read_pooling_spec
    from minisgl.server.routes.common import APIError
    from minisgl.server.routes.embeddings import _check_dimensions

    # what the scheduler reports comes from config.json (and the sentence-transformers files)
    _write_sentence_transformers(tmp_path, "mean_tokens", normalize=False)
    spec = read_pooling_spec(str(tmp_path), SimpleNamespace(matryoshka_dimensions=[64, 16, 32]), "auto", None)
    assert (spec.method, spec.normalize, spec.matryoshka_dims) == ("mean", False, (16, 32, 64))
    assert read_pooling_spec(str(tmp_path), SimpleNamespace(is_matryoshka=True), "cls", True).matryoshka_dims == ()
    with pytest.raises(ValueError, match="--pooling"):  # max pooling is not implemented: start-up says so
        _write_sentence_transformers(tmp_path, "max_tokens", normalize=False)
        read_pooling_spec(str(tmp_path), SimpleNamespace(), "auto", None)

    def state(dims: Any) -> Any:
        return SimpleNamespace(info={"hidden_size": 64, "matryoshka_dimensions": dims})

    assert _check_dimensions(state([16, 32, 64]), 32) == 32 and _check_dimensions(state([]), 7) == 7
    for dims, asked in (([16, 32, 64], 24), ([], 65), (None, 64)):
        with pytest.raises(APIError) as err:
            _check_dimensions(state(dims), asked)
        assert err.value.status == 400 and err.value.param == "dimensions"
