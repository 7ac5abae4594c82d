"""``TokenizerGroup``: vLLM's tokenizer wrapper, as ``LLMEngine.get_tokenizer_group()`` returns it."""

from __future__ import annotations

from typing import Any


class TokenizerGroup:
    """The engine's tokenizer behind vLLM's ``encode(prompt, ...)`` signature (LoRA
    tokenizers are not built: ``lora_request`` must be None)."""

    def __init__(self, tokenizer: Any, max_input_length: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.max_input_length = max_input_length

    def get_max_input_len(self, lora_request: Any = None) -> int | None:
        return self.max_input_length

    def get_lora_tokenizer(self, lora_request: Any = None) -> Any:
        _no_lora(lora_request)
        return self.tokenizer

    def encode(self, prompt: str, max_length: int | None = None, truncation: bool | None = None,
               lora_request: Any = None, add_special_tokens: bool | None = None) -> list[int]:
        """Token ids of ``prompt``, special tokens added unless ``add_special_tokens=False``;
        longer than the model's encoder takes is a ``ValueError`` naming both."""
        _no_lora(lora_request)
        if self.tokenizer is None:
            raise ValueError("the model has no tokenizer")
        kw: dict[str, Any] = {"add_special_tokens": add_special_tokens is not False, "verbose": False}
        if max_length is not None:
            kw["max_length"] = max_length
        if truncation is not None:
            kw["truncation"] = truncation
        ids = list(self.tokenizer(prompt, **kw)["input_ids"])
        if self.max_input_length is not None and len(ids) > self.max_input_length:
            raise ValueError(f"prompt has {len(ids)} tokens; the model accepts at most {self.max_input_length}")
        return ids


def _no_lora(lora_request: Any) -> None:
    if lora_request is not None:
        raise ValueError(f"lora_request={lora_request!r}: LoRA adapters are not supported")
