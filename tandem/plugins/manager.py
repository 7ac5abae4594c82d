"""Loading plugins from the ``tandem.plugins`` entry-point group."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint, entry_points

import pluggy

from tandem.plugins import hookspecs

ENTRY_POINT_GROUP = "tandem.plugins"
ENV_VAR = "TANDEM_PLUGINS"
_HOOKS = ("tandem_register_models", "tandem_register_attention_backends")


class PluginError(RuntimeError):
    """A plugin failed to import, or one of its hooks raised."""


@dataclass
class PluginInfo:
    name: str  # the entry point's name
    value: str  # what it points at, "package.module[:object]"
    distribution: str | None
    models: list[str] = field(default_factory=list)
    backends: list[str] = field(default_factory=list)


def allowed_plugins() -> set[str] | None:
    """Names from ``$TANDEM_PLUGINS``, or None when every plugin may load."""
    raw = os.environ.get(ENV_VAR)
    if raw is None or not raw.strip():
        return None
    return {name.strip() for name in raw.split(",") if name.strip()}


class PluginManager:
    """Discovers plugins, registers them with pluggy, and runs their hooks once."""

    def __init__(self, allow: set[str] | None = None, entry_point_list: list[EntryPoint] | None = None) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.allow = allow
        self._entry_points = entry_point_list
        self.plugins: dict[str, PluginInfo] = {}
        self._objects: dict[str, object] = {}

    def load(self) -> None:
        """Import every allowed plugin in the entry-point group."""
        eps = self._entry_points
        if eps is None:
            eps = list(entry_points(group=ENTRY_POINT_GROUP))
        for ep in sorted(eps, key=lambda e: e.name):
            if self.allow is not None and ep.name not in self.allow:
                continue
            if ep.name in self.plugins:
                raise PluginError(f"two plugins are named {ep.name!r}: {self.plugins[ep.name].value} and {ep.value}")
            try:
                obj = ep.load()
            except Exception as e:
                raise PluginError(f"plugin {ep.name!r} ({ep.value}) failed to import: {type(e).__name__}: {e}") from e
            dist = getattr(ep, "dist", None)
            self.plugins[ep.name] = PluginInfo(ep.name, ep.value, dist.name if dist is not None else None)
            self._objects[ep.name] = obj
            try:
                self.pm.register(obj, name=ep.name)
                self.pm.check_pending()  # a misspelled hook name is an error, not a no-op
            except pluggy.PluginValidationError as e:
                raise PluginError(f"plugin {ep.name!r} ({ep.value}) is invalid: {e}") from e
        if self.allow is not None:
            unknown = sorted(self.allow - set(self.plugins))
            if unknown:
                found = sorted(ep.name for ep in eps)
                raise PluginError(f"{ENV_VAR} names unknown plugins {unknown}; installed: {found}")

    def register_all(self, model_registry, backend_registry) -> None:
        """Call each plugin's hooks, one plugin at a time, so that every
        registration (and every failure) is attributed to its plugin."""
        from tandem.registry._lazy import DuplicateRegistrationError

        for name in self._objects:
            others = [o for n, o in self._objects.items() if n != name]
            for hook, registry in (
                ("tandem_register_models", model_registry),
                ("tandem_register_attention_backends", backend_registry),
            ):
                caller = self.pm.subset_hook_caller(hook, remove_plugins=others)
                with registry.owned_by(name):
                    try:
                        caller(registry=registry)
                    except DuplicateRegistrationError as e:
                        raise PluginError(str(e)) from e
                    except Exception as e:
                        raise PluginError(f"plugin {name!r} failed in {hook}: {type(e).__name__}: {e}") from e
        for name, info in self.plugins.items():
            info.models = [n for n in model_registry.names() if model_registry.owner(n) == name]
            info.backends = [n for n in backend_registry.names() if backend_registry.owner(n) == name]
