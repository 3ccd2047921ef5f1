"""Request bodies of the HTTP API (pydantic), and how they turn into sampling parameters.

Unknown fields are ignored (as vLLM and SGLang do); known fields are type- and range-checked and a
violation becomes a 400 with the offending field named in `param`.
"""

from __future__ import annotations

from typing import Annotated, Any, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_N = 64
NonNegInt = Annotated[int, Field(ge=0)]
MAX_LOGPROBS = 20


class _Base(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class StreamOptions(_Base):
    include_usage: bool = False


class SamplingFields(_Base):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI + vLLM/SGLang extras)."""

    model: Optional[str] = None
    temperature: Optional[float] = Field(None, ge=0.0)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    top_k: Optional[int] = Field(None, ge=-1)
    min_p: Optional[float] = Field(None, ge=0.0, le=1.0)
    max_tokens: Optional[int] = Field(None, ge=1)
    stop: Union[str, List[str], None] = None
    stop_token_ids: Optional[List[NonNegInt]] = None
    seed: Optional[int] = None
    n: int = Field(1, ge=1, le=MAX_N)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: Union[str, List[str], None]) -> Union[str, List[str], None]:
        if isinstance(v, list) and len(v) > 16:
            raise ValueError("at most 16 stop strings")
        return v

    def stop_list(self) -> List[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else [s for s in self.stop if s]

    def sampling_dict(self, max_tokens: int | None, logprobs: int | None, index: int = 0) -> Dict[str, Any]:
        seed = None if self.seed is None else self.seed + index
        top_k = self.top_k if self.top_k not in (None, 0) else -1
        return {
            "temperature": 1.0 if self.temperature is None else float(self.temperature),
            "top_p": 1.0 if self.top_p is None else float(self.top_p),
            "top_k": top_k,
            "min_p": 0.0 if self.min_p is None else float(self.min_p),
            "max_tokens": max_tokens,
            "ignore_eos": self.ignore_eos,
            "stop_token_ids": list(self.stop_token_ids or []),
            "seed": seed,
            "presence_penalty": float(self.presence_penalty),
            "frequency_penalty": float(self.frequency_penalty),
            "repetition_penalty": float(self.repetition_penalty),
            "logprobs": logprobs,
        }


class ChatMessage(_Base):
    role: Literal["system", "user", "assistant", "tool", "developer", "function"]
    content: Union[str, List[Dict[str, Any]], None] = None
    name: Optional[str] = None

    def to_template(self) -> Dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            texts = []
            for i, part in enumerate(content):
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError(f"content part {i} has type {part.get('type')!r}: only text parts are supported")
                texts.append(part["text"])
            content = "".join(texts)
        msg: Dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": content or ""}
        if self.name is not None:
            msg["name"] = self.name
        return msg


class ChatCompletionRequest(SamplingFields):
    messages: List[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    chat_template_kwargs: Optional[Dict[str, Any]] = None

    @model_validator(mode="after")
    def _check(self) -> "ChatCompletionRequest":
        if self.top_logprobs is not None and self.top_logprobs > 0 and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        return self

    def effective_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def logprobs_k(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(SamplingFields):
    prompt: Union[str, List[str], List[int], List[List[int]]]
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: Optional[int] = None
    suffix: Optional[str] = None

    @model_validator(mode="after")
    def _check(self) -> "CompletionRequest":
        if self.echo:
            raise ValueError("echo is not supported")
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of is not supported (it must equal n)")
        return self

    def prompts(self) -> List[Union[str, List[int]]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise ValueError("prompt is empty")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class GenerateSampling(_Base):
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    max_new_tokens: Optional[int] = Field(128, ge=1)
    stop: Union[str, List[str], None] = None
    stop_token_ids: Optional[List[NonNegInt]] = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    seed: Optional[int] = None
    n: int = Field(1, ge=1, le=MAX_N)


class GenerateRequest(_Base):
    """SGLang's native /generate."""

    text: Union[str, List[str], None] = None
    input_ids: Union[List[int], List[List[int]], None] = None
    sampling_params: GenerateSampling = Field(default_factory=GenerateSampling)
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = Field(0, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _check(self) -> "GenerateRequest":
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of text or input_ids")
        return self
