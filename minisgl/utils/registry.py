"""A name -> factory registry, so backends and models are chosen by name, not by if-chains."""

from __future__ import annotations

from typing import Callable, Dict, Generic, List, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: Dict[str, T] = {}

    def register(self, *names: str) -> Callable[[T], T]:
        def wrap(item: T) -> T:
            for name in names:
                self._items[name] = item
            return item

        return wrap

    def names(self) -> List[str]:
        return sorted(self._items)

    def __contains__(self, name: str) -> bool:
        return name in self._items

    def get(self, name: str) -> T:
        if name not in self._items:
            raise ValueError(f"unknown {self.kind} {name!r}; supported: {', '.join(self.names())}")
        return self._items[name]
