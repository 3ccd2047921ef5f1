"""Which tensor-parallel rank this process is; every layer reads it to pick its shard."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DistributedInfo:
    rank: int
    size: int

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"invalid tensor-parallel rank {self.rank} of size {self.size}")

    @property
    def is_primary(self) -> bool:
        return self.rank == 0


_TP_INFO: DistributedInfo | None = None


def set_tp_info(rank: int, size: int) -> None:
    global _TP_INFO
    _TP_INFO = DistributedInfo(rank, size)


def try_get_tp_info() -> DistributedInfo | None:
    return _TP_INFO


def get_tp_info() -> DistributedInfo:
    """The current rank; a single process that never set it is rank 0 of 1."""
    return _TP_INFO if _TP_INFO is not None else DistributedInfo(0, 1)


def clear_tp_info() -> None:
    global _TP_INFO
    _TP_INFO = None
