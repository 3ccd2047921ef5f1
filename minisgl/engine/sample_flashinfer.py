"""FlashInfer's rejection-sampling kernels (CUDA only; imported lazily by the Sampler).

top_k is always passed as a per-row tensor: a Python int selects a kernel variant whose JIT
build is prohibitively slow (see PLATFORMS.md).
"""

from __future__ import annotations

import flashinfer.sampling as fs  # noqa: E402  (ImportError here means: use sample_torch)
import torch


def sample_flashinfer(
    logits: torch.Tensor, temperatures: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    probs = torch.softmax(logits / temperatures.unsqueeze(1), dim=-1)
    if top_k is None and top_p is None:
        return fs.sampling_from_probs(probs)
    if top_k is None:
        return fs.top_p_sampling_from_probs(probs, top_p)
    if top_p is None:
        return fs.top_k_sampling_from_probs(probs, top_k)
    return fs.top_k_top_p_sampling_from_probs(probs, top_k, top_p, filter_apply_order="top_k_first")
