"""Per-request modes (sampling, beam search, a prompt slot) behind one narrow
interface (``base.RequestStrategy`` / ``base.StepMode``)."""

from tandem.core.strategies.prompt_slot import PromptSlot

__all__ = ["PromptSlot"]
