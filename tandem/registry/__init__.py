"""Model and attention-backend registries."""

from tandem.registry.backends import AttentionBackendRegistry, BackendUnavailableError
from tandem.registry.models import (
    _CONDITIONAL_GENERATION_MODELS,
    ModelRegistry,
    UnsupportedArchitectureError,
)

__all__ = [
    "_CONDITIONAL_GENERATION_MODELS",
    "AttentionBackendRegistry",
    "BackendUnavailableError",
    "ModelRegistry",
    "UnsupportedArchitectureError",
]

_model_registry: ModelRegistry | None = None
_backend_registry: AttentionBackendRegistry | None = None


def default_model_registry() -> ModelRegistry:
    """The process-wide model registry the engine resolves architectures in."""
    global _model_registry
    if _model_registry is None:
        _model_registry = ModelRegistry()
    return _model_registry


def default_backend_registry() -> AttentionBackendRegistry:
    """The process-wide attention-backend registry."""
    global _backend_registry
    if _backend_registry is None:
        _backend_registry = AttentionBackendRegistry()
    return _backend_registry


def reset_registries() -> None:
    """Forget every registration (for tests); the next use rebuilds the defaults."""
    global _model_registry, _backend_registry
    _model_registry = _backend_registry = None
