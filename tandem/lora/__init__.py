"""PEFT LoRA adapters served per request (docs/lora.md)."""

from tandem.lora.request import LoRARequest

__all__ = ["LoRARequest"]
