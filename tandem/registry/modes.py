"""Which request modes an engine offers (``tandem.core.strategies.modes.Mode``
subclasses by name), tandem's own first."""

from __future__ import annotations

from tandem.core.strategies.builtin import BUILTIN_MODES
from tandem.core.strategies.modes import Mode
from tandem.registry._lazy import LazyRegistry


class ModeRegistry(LazyRegistry[Mode]):
    kind = "mode"

    def __init__(self) -> None:
        super().__init__()
        with self.owned_by("tandem"):
            for name, cls in BUILTIN_MODES.items():
                self.register(name, cls)

    def register_mode(self, name: str, target: str | type, *, override: bool = False) -> None:
        """``target``: a ``Mode`` subclass (or ``"package.module:Class"``) whose ``name``
        equals ``name``."""
        self.register(name, target, override=override)

    def load(self, name: str) -> type[Mode]:
        cls = super().load(name)
        if not (isinstance(cls, type) and issubclass(cls, Mode)) or cls.name != name:
            raise TypeError(f"{self.origin(name)} resolves to {cls!r}, not a Mode subclass named {name!r}")
        return cls
