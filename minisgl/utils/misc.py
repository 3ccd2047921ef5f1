"""Small helpers: arithmetic, and lazy package exports."""

from __future__ import annotations

import importlib
from typing import Any, Callable, Dict


def div_ceil(a: int, b: int) -> int:
    return (a + b - 1) // b


def align_up(x: int, multiple: int) -> int:
    return div_ceil(x, multiple) * multiple


def div_even(a: int, b: int, allow_replicate: bool = False) -> int:
    """a / b when b divides a. With allow_replicate, a < b (e.g. fewer KV heads than TP ranks)
    gives 1: every rank keeps a replica of one head."""
    if allow_replicate and a < b:
        if b % a != 0:
            raise ValueError(f"cannot replicate {a} heads over {b} ranks: {b} is not a multiple of {a}")
        return 1
    if a % b != 0:
        raise ValueError(f"{a} is not divisible by {b}")
    return a // b


def gib(num_bytes: int) -> str:
    return f"{num_bytes / (1 << 30):.2f} GiB"


def lazy_exports(package: str, where: Dict[str, str]) -> Callable[[str], Any]:
    """A package's module-level `__getattr__` that imports `package.<where[name]>` only when
    `name` is first read: the package's light parts stay importable without its heavy ones."""

    def __getattr__(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{where[name]}"), name)

    return __getattr__
