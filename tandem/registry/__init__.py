"""Model and attention-backend registries."""

from tandem.registry.backends import AttentionBackendRegistry, BackendUnavailableError
from tandem.registry.models import ModelRegistry, UnsupportedArchitectureError

__all__ = [
    "AttentionBackendRegistry",
    "BackendUnavailableError",
    "ModelRegistry",
    "UnsupportedArchitectureError",
]
