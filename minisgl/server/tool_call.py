"""One tool call read out of a model's output: the type every tool parser and the harmony reader
return (its own module, so that `tools` and `harmony` both use it without importing each other)."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Dict


@dataclass
class ToolCall:
    name: str
    arguments: Dict[str, Any]

    def to_openai(self, index: int | None = None) -> Dict[str, Any]:
        call: Dict[str, Any] = {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": self.name, "arguments": json.dumps(self.arguments, ensure_ascii=False)},
        }
        if index is not None:
            call["index"] = index
        return call
