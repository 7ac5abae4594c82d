"""Per-request modes (beam search, a prompt slot) behind one narrow interface."""

from tandem.core.strategies.prompt_slot import PromptSlot

__all__ = ["PromptSlot"]
