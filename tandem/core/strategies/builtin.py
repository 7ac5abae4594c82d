"""tandem's own modes, by name: what ``tandem.registry.ModeRegistry`` starts with
(plugins add theirs through the ``tandem_register_modes`` hook)."""

from tandem.core.strategies.beam import BeamSearchMode
from tandem.core.strategies.prompt_slot import PromptSlotMode
from tandem.core.strategies.sampling import SamplingMode
from tandem.core.strategies.speculative import SpeculativeMode
from tandem.core.strategies.structured import StructuredOutputMode

BUILTIN_MODES = {m.name: m for m in (SamplingMode, BeamSearchMode, SpeculativeMode, StructuredOutputMode, PromptSlotMode)}


class BuiltinModes:
    """The built-in modes alone, as a registry (``names()``, ``load(name)``): for an
    engine built without a mode registry."""

    def names(self) -> list[str]:
        return list(BUILTIN_MODES)

    def load(self, name: str):
        return BUILTIN_MODES[name]
