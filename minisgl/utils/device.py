"""Device abstraction: the only place that asks "is this CUDA?".

On CUDA, streams, events and pinned memory are the real thing. On CPU every kernel runs
synchronously, so a stream is a no-op, an event is already complete when recorded, and
pinning host memory buys nothing.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch


def is_cuda(device: torch.device | str) -> bool:
    return torch.device(device).type == "cuda"


class NullStream:
    """The CPU stand-in for torch.cuda.Stream: work is already done when it is issued."""

    def synchronize(self) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def __enter__(self) -> "NullStream":
        return self

    def __exit__(self, *exc: object) -> None:
        pass


class NullEvent:
    """The CPU "event": record and synchronize are no-ops (the computation finished at record)."""

    def record(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def wait(self, stream: Any = None) -> None:
        pass


def create_stream(device: torch.device) -> Any:
    return torch.cuda.Stream(device=device) if is_cuda(device) else NullStream()


def create_event(device: torch.device) -> Any:
    return torch.cuda.Event() if is_cuda(device) else NullEvent()


def set_stream(stream: Any) -> None:
    """Make `stream` the current stream (CUDA); nothing to do on CPU."""
    if isinstance(stream, NullStream):
        return
    torch.cuda.set_stream(stream)


def current_stream(device: torch.device) -> Any:
    return torch.cuda.current_stream(device) if is_cuda(device) else NullStream()


def stream_context(stream: Any) -> Any:
    """`with stream_context(s):` runs the block on `s` (CUDA) or just runs it (CPU)."""
    if isinstance(stream, NullStream):
        return stream
    return torch.cuda.stream(stream)


def record_stream(tensor: torch.Tensor, stream: Any) -> None:
    """Tell the caching allocator that `tensor`, allocated on another stream, is used on `stream`,
    so its memory is not handed out again before `stream` is done with it."""
    if not isinstance(stream, NullStream) and tensor.is_cuda:
        tensor.record_stream(stream)


def pin(device: torch.device) -> bool:
    """Whether host staging tensors should be pinned: only useful for async H2D/D2H on CUDA."""
    return is_cuda(device)


def make_device_tensor(values: Sequence[Any], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Build a small tensor on the host and copy it to `device` without blocking the host."""
    host = torch.tensor(values, dtype=dtype, pin_memory=pin(device))
    return host.to(device, non_blocking=True)


def synchronize(device: torch.device) -> None:
    if is_cuda(device):
        torch.cuda.synchronize(device)
