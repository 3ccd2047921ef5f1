"""The embed task: which pooling a checkpoint asks for, and the pooler that turns prefill steps'
final-normed hidden rows into one vector per request.

An embedding request is a prompt that is prefilled and never decoded. Its prompt may arrive in
several chunks (chunked prefill): mean pooling sums each chunk's rows into a per-table-row
accumulator and divides at the last chunk; cls keeps the first chunk's first row; last-token
pooling takes the last chunk's last row. Mean and cls need every row from position 0, so such a
request never matches the prefix cache (scheduler/policy.py); a last-token request may.

`read_pooling_spec` is torch-free: it reads the checkpoint's sentence-transformers files.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, List, Tuple

if TYPE_CHECKING:
    import torch

    from minisgl.core import Batch

POOLING_METHODS = ("last", "mean", "cls")
_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_NORMALIZE = "sentence_transformers.models.Normalize"
# 1_Pooling/config.json's switches -> our method (max and weighted-mean are not implemented)
_ST_MODES = (("pooling_mode_lasttoken", "last"), ("pooling_mode_mean_tokens", "mean"), ("pooling_mode_cls_token", "cls"))


@dataclass(frozen=True)
class PoolingSpec:
    method: str  # one of POOLING_METHODS
    normalize: bool  # L2-normalize the pooled vector
    # Matryoshka sizes the vector may be truncated to (`dimensions`): None: truncation is not
    # allowed; (): any size up to the hidden size
    matryoshka_dims: Tuple[int, ...] | None = None


def _st_modules(model_dir: Path) -> List[dict]:
    path = model_dir / "modules.json"
    if not path.exists():
        return []
    modules = json.loads(path.read_text())
    if not isinstance(modules, list):
        raise ValueError(f"{path}: expected a list of modules")
    return modules


def _st_pooling(model_dir: Path, modules: List[dict]) -> str | None:
    """The method 1_Pooling/config.json (or wherever modules.json puts the Pooling module) sets."""
    paths = [m.get("path", "") for m in modules if m.get("type") == _ST_POOLING]
    path = model_dir / (paths[0] if paths else "1_Pooling") / "config.json"
    if not path.exists():
        return None
    config = json.loads(path.read_text())
    on = [method for key, method in _ST_MODES if config.get(key)]
    unsupported = [k for k, v in config.items() if k.startswith("pooling_mode_") and v and k not in dict(_ST_MODES)]
    if unsupported or len(on) != 1:
        raise ValueError(
            f"{path} asks for pooling {', '.join(unsupported + on) or 'none'}; minisgl pools by exactly one of "
            "last token, mean or cls: pass --pooling last|mean|cls"
        )
    return on[0]


def _matryoshka_dims(hf_config: Any) -> Tuple[int, ...] | None:
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    if dims:
        return tuple(sorted(int(d) for d in dims))
    return () if getattr(hf_config, "is_matryoshka", False) else None


def read_pooling_spec(model_dir: str, hf_config: Any, pooling: str, normalize: bool | None) -> PoolingSpec:
    """The pooling the checkpoint declares, overridden by `pooling` (unless "auto") and
    `normalize` (unless None). Without sentence-transformers files: last token, normalized (the
    Qwen3-Embedding and gte-Qwen2 recipe)."""
    root = Path(model_dir)
    modules = _st_modules(root)
    method = pooling if pooling != "auto" else (_st_pooling(root, modules) or "last")
    if method not in POOLING_METHODS:
        raise ValueError(f"pooling must be one of auto, {', '.join(POOLING_METHODS)}; got {pooling!r}")
    if normalize is None:
        normalize = any(m.get("type") == _ST_NORMALIZE for m in modules) if modules else True
    return PoolingSpec(method, normalize, _matryoshka_dims(hf_config))


class Pooler:
    """One vector per request of an embed prefill step, on the device. State per table row
    (`rows` rows: the page table's, the dummy's included) carries mean/cls across chunks."""

    def __init__(self, spec: PoolingSpec, rows: int, hidden_size: int, device: torch.device) -> None:
        import torch

        self.spec = spec
        self.state = torch.zeros(rows, hidden_size, dtype=torch.float32, device=device) if spec.method != "last" else None

    def __call__(self, batch: Batch, hidden: torch.Tensor) -> torch.Tensor:
        """[batch.size, hidden] float32: the pooled (and normalized) vector of each request whose
        prompt ends in this step; zeros for a request whose prompt continues in a later chunk.
        Call before the requests advance (`complete_one`): it reads their fed ranges."""
        import torch

        out = torch.zeros(batch.size, hidden.shape[1], dtype=torch.float32, device=hidden.device)
        offset = 0
        for i, req in enumerate(batch.reqs):
            n = req.extend_len
            rows = hidden[offset : offset + n]
            offset += n
            final = req.device_len >= req.prompt_len
            if self.spec.method == "last":
                if final:
                    out[i] = rows[-1].float()
                continue
            assert self.state is not None
            t = req.table_idx
            if self.spec.method == "mean":
                if req.cached_len == 0:
                    self.state[t] = 0.0
                self.state[t] += rows.float().sum(dim=0)
                if final:
                    out[i] = self.state[t] / req.prompt_len
            else:  # cls: the first position's row
                if req.cached_len == 0:
                    self.state[t] = rows[0].float()
                if final:
                    out[i] = self.state[t]
        if self.spec.normalize:
            out = torch.nn.functional.normalize(out, dim=-1)
        return out
