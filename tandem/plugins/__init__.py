"""Plugins: pluggy hooks discovered from the ``tandem.plugins`` entry-point group."""

from tandem.plugins.defaults import (
    default_backend_registry,
    default_mode_registry,
    default_model_registry,
    plugin_manager,
    plugin_report,
    reset_registries,
)
from tandem.plugins.hookspecs import hookimpl, hookspec
from tandem.plugins.manager import ENTRY_POINT_GROUP, PluginError, PluginInfo, PluginManager

__all__ = [
    "ENTRY_POINT_GROUP",
    "PluginError",
    "PluginInfo",
    "PluginManager",
    "default_backend_registry",
    "default_mode_registry",
    "default_model_registry",
    "hookimpl",
    "hookspec",
    "plugin_manager",
    "plugin_report",
    "reset_registries",
]
