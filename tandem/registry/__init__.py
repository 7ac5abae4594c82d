"""Model and attention-backend registries."""

from tandem.registry.backends import AttentionBackendRegistry, BackendSelection, BackendUnavailableError
from tandem.registry.models import ModelRegistry, UnsupportedArchitectureError
from tandem.registry.modes import ModeRegistry

__all__ = [
    "AttentionBackendRegistry",
    "BackendSelection",
    "BackendUnavailableError",
    "ModelRegistry",
    "ModeRegistry",
    "UnsupportedArchitectureError",
]
