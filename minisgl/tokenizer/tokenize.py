"""Prompt encoding: text, token ids, or chat messages through the tokenizer's chat template.

The same rules as `minisgl.llm.LLM.encode`, so that the server and the offline API feed the model
identical token ids for the same prompt.
"""

from __future__ import annotations

from typing import Any, Dict, List

NO_TOKENIZER = "this server runs with --skip-tokenizer-init (no tokenizer): send token ids"


class PromptEncoder:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer  # None with --skip-tokenizer-init: only token-id prompts

    def encode_text(self, text: str) -> List[int]:
        if self.tokenizer is None:
            raise ValueError(NO_TOKENIZER)
        if not text:
            raise ValueError("prompt is empty")
        return list(self.tokenizer(text).input_ids)

    def encode_chat(
        self,
        messages: List[Dict[str, Any]],
        chat_template_kwargs: Dict[str, Any] | None = None,
        tools: List[Dict[str, Any]] | None = None,
    ) -> List[int]:
        if self.tokenizer is None:
            raise ValueError(NO_TOKENIZER)
        if not messages:
            raise ValueError("messages is empty: send at least one message")
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError("this model's tokenizer has no chat template: use /v1/completions with a plain prompt")
        kwargs = dict(chat_template_kwargs or {})
        kwargs.setdefault("add_generation_prompt", True)
        if tools:
            kwargs["tools"] = tools
        try:
            ids = self.tokenizer.apply_chat_template(messages, tokenize=True, **kwargs)
        except Exception as exc:  # jinja errors: the template rejected the conversation
            raise ValueError(f"the chat template rejected the messages: {exc}") from None
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]

    def tokenize_only(
        self, text: str | None, messages: List[Dict[str, Any]] | None, add_special_tokens: bool, add_generation_prompt: bool
    ) -> List[int]:
        """What /tokenize answers: chat messages through the template, or a text (possibly empty)."""
        if self.tokenizer is None:
            raise ValueError(NO_TOKENIZER)
        if messages is not None:
            return self.encode_chat(messages, {"add_generation_prompt": add_generation_prompt})
        return list(self.tokenizer(text or "", add_special_tokens=add_special_tokens).input_ids)

    def encode_ids(self, input_ids: List[int]) -> List[int]:
        if not input_ids:
            raise ValueError("prompt is empty")
        return list(input_ids)
