"""Plugins: pluggy hooks discovered from the ``tandem.plugins`` entry-point group."""

from tandem.plugins.hookspecs import hookimpl, hookspec
from tandem.plugins.manager import ENTRY_POINT_GROUP, PluginError, PluginInfo, PluginManager

__all__ = ["ENTRY_POINT_GROUP", "PluginError", "PluginInfo", "PluginManager", "hookimpl", "hookspec"]
