"""The process-wide registries, filled once from the ``tandem.plugins`` entry points.

Entry points (``LLM``, the CLI) build them here and hand them to the engine; the
registry package knows nothing of plugins.
"""

from __future__ import annotations

from tandem.plugins.manager import PluginManager, allowed_plugins
from tandem.registry import AttentionBackendRegistry, ModelRegistry

_model_registry: ModelRegistry | None = None
_backend_registry: AttentionBackendRegistry | None = None
_plugin_manager = None


def _populate() -> None:
    """Load the ``tandem.plugins`` entry points once per process and run their hooks.

    Strict: a broken plugin raises ``PluginError`` rather than the engine running without it."""
    global _model_registry, _backend_registry, _plugin_manager
    manager = PluginManager(allow=allowed_plugins())
    manager.load()
    models, backends = ModelRegistry(), AttentionBackendRegistry()
    manager.register_all(models, backends)
    _model_registry, _backend_registry, _plugin_manager = models, backends, manager


def default_model_registry() -> ModelRegistry:
    """The process-wide model registry, filled by the plugins on first use."""
    if _model_registry is None:
        _populate()
    return _model_registry


def default_backend_registry() -> AttentionBackendRegistry:
    """The process-wide attention-backend registry, filled by the plugins on first use."""
    if _backend_registry is None:
        _populate()
    return _backend_registry


def plugin_manager():
    """The PluginManager that filled the default registries."""
    if _plugin_manager is None:
        _populate()
    return _plugin_manager


def plugin_report(entry_point_list=None) -> list:
    """Every allowed plugin as a ``PluginInfo``, broken ones included with their ``error``.

    Loads into fresh registries without raising for a broken plugin (``tandem plugins``
    shows them all); the default registries are neither filled nor changed. An unknown
    name in ``$TANDEM_PLUGINS`` still raises ``PluginError``.
    """
    manager = PluginManager(allow=allowed_plugins(), entry_point_list=entry_point_list)
    manager.load(strict=False)
    manager.register_all(ModelRegistry(), AttentionBackendRegistry(), strict=False)
    return list(manager.plugins.values())


def reset_registries() -> None:
    """Forget the plugins and their registrations; the next use loads them again."""
    global _model_registry, _backend_registry, _plugin_manager
    _model_registry = _backend_registry = _plugin_manager = None
