"""``LoRARequest``: which adapter a request runs with, as vLLM spells it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT LoRA adapter a request runs with.

    ``lora_name``: the name it is known by (the server's model name for it);
    ``lora_int_id``: an integer >= 1 that identifies the adapter (two requests with the
    same id share the loaded adapter; 0 is the base model); ``lora_path``: a local PEFT
    adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``) or a
    Hugging Face Hub repo id, resolved as checkpoints are.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name={self.lora_name!r}: must be a non-empty string")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id={self.lora_int_id!r}: must be an integer >= 1 (0 is the base model)")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path={self.lora_path!r}: must be a local adapter directory or a Hub repo id")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
