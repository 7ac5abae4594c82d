"""Which model class serves which architecture named in ``config.json``."""

from __future__ import annotations

from tandem.core.model import EncoderDecoderModel
from tandem.registry._lazy import LazyRegistry



class UnsupportedArchitectureError(ValueError):
    pass


class ModelRegistry(LazyRegistry[EncoderDecoderModel]):
    kind = "model architecture"

    def register_model(self, arch: str, target: str | type, *, override: bool = False) -> None:
        self.register(arch, target, override=override)

    def resolve(self, architectures: list[str] | None) -> tuple[type[EncoderDecoderModel], str]:
        """The class for the first supported architecture of a config."""
        archs = list(architectures or [])
        for arch in archs:
            if arch in self:
                cls = self.load(arch)
                if not (isinstance(cls, type) and issubclass(cls, EncoderDecoderModel)):
                    raise TypeError(f"{self.origin(arch)} resolves to {cls!r}, not an EncoderDecoderModel subclass")
                return cls, arch
        if not self.names():
            raise UnsupportedArchitectureError(
                f"model architectures {archs} are not supported: no model is registered. Is tandem "
                "installed (pip install -e .) so its 'tandem.plugins' entry points exist, and does "
                "$TANDEM_PLUGINS allow 'tandem-models'?"
            )
        raise UnsupportedArchitectureError(
            f"model architectures {archs} are not supported; supported: {', '.join(self.names())}"
        )
