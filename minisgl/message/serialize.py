"""msgpack serialization of message dataclasses.

A registered dataclass travels as the map {"__m": class name, "f": [field values in order]};
nested registered dataclasses (a batch of token outputs) are encoded the same way, recursively.
Tuples arrive as lists. Unknown class names raise ValueError: a process never guesses.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Tuple, Type, TypeVar

import msgpack

T = TypeVar("T")

_KEY = "__m"
_REGISTRY: Dict[str, Tuple[type, Tuple[str, ...]]] = {}


def register_message(cls: Type[T]) -> Type[T]:
    """Class decorator: make a dataclass serializable by `encode_msg`/`decode_msg`."""
    assert dataclasses.is_dataclass(cls), f"{cls.__name__} must be a dataclass"
    name = cls.__name__
    if name in _REGISTRY and _REGISTRY[name][0] is not cls:
        raise ValueError(f"message name {name!r} is registered twice")
    _REGISTRY[name] = (cls, tuple(f.name for f in dataclasses.fields(cls)))
    return cls


def _default(obj: Any) -> Any:
    entry = _REGISTRY.get(type(obj).__name__)
    if entry is None or entry[0] is not type(obj):
        raise TypeError(f"cannot serialize {type(obj).__name__}: not a registered message")
    return {_KEY: type(obj).__name__, "f": [getattr(obj, name) for name in entry[1]]}


def _object_hook(obj: Dict[str, Any]) -> Any:
    name = obj.get(_KEY)
    if name is None:
        return obj
    entry = _REGISTRY.get(name)
    if entry is None:
        raise ValueError(f"unknown message type {name!r}")
    return entry[0](*obj["f"])


def encode_msg(msg: Any) -> bytes:
    return msgpack.packb(msg, default=_default, use_bin_type=True)


def decode_msg(data: bytes) -> Any:
    return msgpack.unpackb(data, object_hook=_object_hook, raw=False, strict_map_key=False)
