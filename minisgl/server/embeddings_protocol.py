"""The request body of POST /v1/embeddings (pydantic, strict like every body: protocol.py), its
limits, and how a vector is written in the response."""

from __future__ import annotations

import base64
import math
import sys
from array import array
from typing import Annotated, List, Literal, Optional, Union

from pydantic import Field

from minisgl.sampling_params import INT64_MAX
from minisgl.server.protocol import Prompt, ShortStr, _Base

MAX_EMBEDDING_INPUTS = 2048  # inputs of one request, as OpenAI
MAX_EMBEDDING_TOKEN_IDS = 300_000  # token ids over all token-id inputs of one request, as OpenAI's token cap


class EmbeddingRequest(_Base):
    # a string, a list of strings, a list of token ids, or a list of lists of token ids
    input: Prompt
    model: Optional[str] = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[Annotated[int, Field(ge=1, le=INT64_MAX)]] = None
    user: Optional[ShortStr] = None  # accepted: OpenAI's abuse-monitoring id, nothing minisgl computes

    def inputs(self) -> List[Union[str, List[int]]]:
        """The inputs, one per vector; ValueError (naming `input`) when there are none or too many."""
        value = self.input
        if isinstance(value, str):
            inputs: List[Union[str, List[int]]] = [value]
        elif not value:
            raise ValueError("input is empty: give a string, a list of strings, token ids or lists of token ids")
        elif all(isinstance(x, int) for x in value):
            inputs = [list(value)]  # type: ignore[arg-type]
        else:
            inputs = list(value)  # type: ignore[arg-type]
        if len(inputs) > MAX_EMBEDDING_INPUTS:
            raise ValueError(f"input has {len(inputs)} items, more than the {MAX_EMBEDDING_INPUTS} one request may embed")
        for item in inputs:
            if not item:
                raise ValueError("input holds an empty string or an empty list of token ids")
        num_ids = sum(len(item) for item in inputs if not isinstance(item, str))
        if num_ids > MAX_EMBEDDING_TOKEN_IDS:
            raise ValueError(f"input has {num_ids} token ids, more than the {MAX_EMBEDDING_TOKEN_IDS} one request may embed")
        return inputs


def encode_vector(raw: bytes, dimensions: int | None, encoding_format: str) -> Union[List[float], str]:
    """A pooled vector (float32 little-endian bytes) as the response writes it: truncated to
    `dimensions` and L2-renormalized when asked (Matryoshka), as floats or as base64 of its
    float32 little-endian bytes (OpenAI's encoding_format=base64)."""
    vector = array("f")
    vector.frombytes(raw)
    if sys.byteorder == "big":
        vector.byteswap()
    if dimensions is not None:
        vector = vector[:dimensions]
        norm = math.sqrt(math.fsum(x * x for x in vector))
        if norm > 0.0:
            vector = array("f", (x / norm for x in vector))
    if encoding_format == "float":
        return vector.tolist()
    if sys.byteorder == "big":
        vector.byteswap()
    return base64.b64encode(vector.tobytes()).decode("ascii")
